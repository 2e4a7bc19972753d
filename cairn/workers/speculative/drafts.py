"""What the drafter sees of a step, and when it sees it: `DraftRun` (a segment's kept positions
and where their hidden states are), `Drafter` (who proposes drafts: the engine's is
cairn.workers.speculative.mtp_drafter), and `held_back` (which runs over a prompt's earlier
chunks wait for its last one, so its first token does not wait for the head's pass over them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cairn.workers.plan import Segment


@dataclass
class DraftRun:
    """One segment of a step, seen by the drafter once its kept tokens are applied: the head
    runs over its positions (`segment`, cut to its kept tokens), whose final hidden states are
    rows `row`.. of the step's (`ModelRunner.hidden`), or `hidden` where the run kept its own
    (`held_back`); `want`: drafts to propose after its sequence's last token (0: none, the
    head's K/V alone)."""
    segment: Segment
    row: int
    want: int
    hidden: torch.Tensor | None = None


WAITING_STEPS = 8  # steps' worth of prompt positions (max_num_batched_tokens each) whose head pass may wait


def held_back(runs: list[DraftRun], waiting: dict[int, DraftRun], hidden: torch.Tensor | None, budget: int,
              flush: bool = False) -> tuple[list[DraftRun], dict[int, DraftRun]]:
    """Which of the head's pending runs run now, and which wait (`Verifier.propose`, one device):
    a run over a chunk of a prompt that is not its last (its sequence has prompt tokens left to
    compute, and wants no drafts) waits, its hidden states copied out of `hidden` (the last
    step's), and joins the sequence's next run. So the step that computes a prompt's last chunk
    runs no head pass over the earlier ones before its first token goes out (TTFT as without
    speculation, however many steps the prompt takes), and the prompt is one head pass after
    it. At most `budget` positions wait (past it, a run goes now); `flush` runs them all (an
    export: its pages carry their head K/V). Returns (the runs to make now, the new waiting
    runs by sequence); a run whose sequence no longer holds its positions (it ended, or was
    preempted) is dropped."""
    now, left, held = [], {}, dict(waiting)
    for run in runs:
        seq, n = run.segment.seq, run.segment.num_tokens
        earlier = held.pop(id(seq), None)
        if earlier is not None and earlier.segment.end == run.segment.start:
            n += earlier.segment.num_tokens
            run = DraftRun(Segment(seq, earlier.segment.start, n), 0, run.want,
                           torch.cat((earlier.hidden, hidden[run.row:run.row + run.segment.num_tokens])))
        elif earlier is not None:
            now.append(earlier)
        if not flush and run.want == 0 and seq.num_computed < seq.num_prompt_tokens and n <= budget:
            budget -= n
            left[id(seq)] = run if run.hidden is not None else \
                DraftRun(run.segment, 0, 0, hidden[run.row:run.row + n].clone())
        else:
            now.append(run)
    now += held.values()  # sequences whose next chunk did not come (held back, or preempted)
    now = [run for run in now if not run.segment.seq.finished and run.segment.seq.num_computed >= run.segment.end]
    return now, left


class Drafter(Protocol):
    """Proposes drafts (`Sequence.draft`) for the sequences a step's runs name."""

    def propose(self, runs: list[DraftRun]) -> None: ...
