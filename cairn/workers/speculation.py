"""Speculative decoding in the engine: who drafts, what a verify step keeps, what is counted.

With `EngineOptions.num_speculative_tokens` k > 0, a running sequence carries up to k tokens
drafted after its last one (`Sequence.draft`). The scheduler makes its next decode a verify
segment: that token and the drafted ones, computed in one forward with the other sequences'
prefills and decodes, each position sampled (`cairn.workers.plan.Segment.drafts`), the state
after each offset kept in a free slot (`Scheduler._take_states`). Then:

1. `kept_tokens`: every row is sampled as the sequence's output token of its index would be
   without speculation (the sampler's rules, and its uniform at (key, output index): the
   request's seed, or the key the sampler gave the sequence; `Sampler.sample`'s `offsets`); the
   drafted tokens equal to the draws before them stand, then the first draw that differs (or the
   bonus after all of them): `accept_greedy`'s rule (cairn.workers.acceptance) over the draws, on
   the host. The drafts are drawn by the row's own rules from the head's logits
   (`Sampler.draft_tokens`; a greedy row's is the argmax):
   - a seeded row's with the uniform its verify row draws with: every output token is then the
     very draw k = 0 makes at its index, and a seeded request gives its k = 0 tokens wherever the
     logits are the same; a draft stands where the head's and the target's inverse CDFs agree at
     that uniform;
   - an unseeded row's with a uniform of its own, from the head's distribution q, which its
     verify row tests by rejection sampling (the draft d kept with probability min(1, p(d) /
     q(d)); else a draw from the residual max(0, p - q), which never draws d, so the rule above
     ends there): each token is distributed as the target's, and a draft stands at sum(min(p,
     q)), the most any test can keep.
   The tokens kept also end at the first that stops the sequence (a stop id, EOS, its length).
2. `Scheduler.settle`: the segment ends after its kept tokens; the state after its last kept
   token is copied back into the sequence's slot from the slot that kept it (the rollback), the
   checkpoints at the page boundaries the kept tokens reach are planned then, and the other
   slots go back. K/V written for rejected positions lies past the sequence's computed tokens:
   the next step writes those positions again, and no page holding them is whole, so none is
   registered. The prefix cache, its tiers and the router see only kept tokens.
3. The drafter proposes the next drafts (`Drafter.propose`): the engine's is the checkpoint's
   MTP head (cairn.workers.execution.mtp_drafter), which also runs over every position the step
   kept (its own K/V at them). It runs when the next step begins, after the step's tokens went
   out (`Engine._propose`): a prompt's first token does not wait for the head's pass over it,
   nor, for a prompt computed over several steps, over its earlier chunks (`held_back`).

When drafts are worth it is measured (`SpeculationGate`, `EngineOptions.speculative_adaptive`):
the engine drafts only while decode steps with drafts give more tokens per second than steps
without, at the current number of running sequences. Drafts never take a prompt's tokens: a
step verifies them beside prompt chunks only where the token budget held every chunk whole
(`Scheduler._take_states`).

Every row drafts, whatever its sampling parameters: a drafted row is sampled as its output
index would be, after the drafted tokens before it (they are its output there, if it is kept at
all): penalties count them (`TokenCounts.scratch`; the kept ones are counted after the step), a
grammar's matcher steps through them and rolls back (`Grammars.mask`'s `draft`). What a step counts: `SpeculationTotals`, vLLM's numbers (drafts, drafted
tokens, accepted tokens in all and by position; mean acceptance length = 1 + accepted / drafts).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cairn.workers.engine_errors import SequenceFault
from cairn.workers.engine_options import MAX_SPECULATIVE_TOKENS
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
    """Which of the head's pending runs run now, and which wait (`Engine._propose`, one device):
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


class SpeculationGate:
    """Whether the running sequences draft for the next step (`speculative_adaptive`): drafts pay
    only where a verify step's tokens per second beat a plain decode step's at the same load. A
    verify step computes 1 + k rows a sequence and runs the head k times; where a step's cost grows
    with its rows (a CPU, or a GPU past its memory-bound batch sizes) that can cost more than the
    kept tokens give. Measured, not assumed: for each bucket of running sequences (a power of two),
    the tokens per second of decode-only steps with drafts and without, each way's rate the median
    of its last `WINDOW` steps (the first step of each left out: it pays the compiles of its
    shapes), so that one step slowed by something else (another process, a collection) decides
    nothing; a bucket lacking either tries it. Then the faster way is taken, and the other tried
    for `PROBE` steps after `REPROBE` steps, so that its rate follows the load and the acceptance
    as they change; each try that leaves the choice as it was doubles the wait before the next (up
    to `MAX_REPROBE`), one that changes it resets it. While the gate is closed, decode-only steps
    skip the head too (`Engine._verify`): its K/V at their positions stays as it was, and drafting
    after them reads it so; the gate then measures what such drafts are worth."""
    REPROBE, MAX_REPROBE = 32, 1024
    WINDOW = 8  # steps a way's rate is the median of
    PROBE = 2  # steps a try of the other way takes

    def __init__(self):
        self._samples: dict[tuple[int, bool], deque] = {}  # (bucket, drafted) -> the last tokens/s
        self._seen: dict[tuple[int, bool], int] = {}  # (bucket, drafted) -> steps observed
        self._choices: dict[int, _Choice] = {}  # bucket -> its choice and when the other way is tried

    @staticmethod
    def _bucket(running: int) -> int:
        return 1 << max(running - 1, 0).bit_length()

    def rate(self, running: int, drafted: bool) -> float | None:
        """Tokens per second of decode-only steps at this load, with drafts or without (None:
        not measured yet)."""
        samples = self._samples.get((self._bucket(running), drafted))
        return statistics.median(samples) if samples else None

    def drafting(self, running: int) -> bool:
        bucket = self._bucket(running)
        drafted, plain = self.rate(running, True), self.rate(running, False)
        if drafted is None:
            return True
        if plain is None:
            return False
        better = drafted > plain
        choice = self._choices.get(bucket)
        if choice is None or (choice.trying == 0 and better != choice.drafting):
            # a first choice, or it changed: try the other way soon (again)
            choice = self._choices[bucket] = _Choice(better, self.REPROBE, self.REPROBE)
        if choice.trying > 0:
            choice.trying -= 1
            return not choice.drafting
        choice.until -= 1
        if choice.until > 0:
            return better
        choice.wait = min(2 * choice.wait, self.MAX_REPROBE)
        choice.until, choice.trying = choice.wait, self.PROBE - 1
        return not better

    def observe(self, running: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `running` sequences (`drafted`: it verified drafts) gave `tokens`
        in `seconds`."""
        if seconds <= 0 or not running:
            return
        key = self._bucket(running), drafted
        self._seen[key] = seen = self._seen.get(key, 0) + 1
        if seen == 1:  # the first such step at a new shape pays its compiles: not a measure
            return
        self._samples.setdefault(key, deque(maxlen=self.WINDOW)).append(tokens / seconds)


@dataclass
class _Choice:
    """A bucket's choice (`SpeculationGate`): drafting or not, the steps until the other way is
    tried, the wait that set them, and the steps of a try of the other way left."""
    drafting: bool
    until: int
    wait: int
    trying: int = 0


@dataclass
class SpeculationTotals:
    drafts: int = 0  # verify segments with at least one drafted token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_SPECULATIVE_TOKENS)

    def count(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            for j in range(accepted):
                self.accepted_by_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verify step yields on average: 1 + accepted / drafts (None before any)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None


def kept_tokens(segments: list[Segment], results: list[list], stop_reason) -> list[tuple[int, int]]:
    """For each verify segment, (its tokens that stand, its drafted tokens accepted), from its rows'
    sampled `results` (one per position, a (token, logprob) or a `SequenceFault`): the drafts equal
    to the draws before them (`accept_greedy`'s rule, applied here on the host to what the sampler
    read back), cut before the first faulted row and after the first token that stops the
    sequence (`stop_reason(seq, token, length)`, the scheduler's). 0 kept: its first row faulted."""
    out = []
    for seg, rows in zip(segments, results):
        draft, accepted = seg.seq.draft, 0
        while accepted < seg.drafts and rows[accepted].__class__ is not SequenceFault and \
                rows[accepted][0] == draft[accepted]:
            accepted += 1
        kept, length = 0, len(seg.seq.token_ids)
        while kept <= accepted and rows[kept].__class__ is not SequenceFault:
            kept += 1
            if stop_reason(seg.seq, rows[kept - 1][0], length + kept) is not None:
                break
        out.append((kept, accepted))
    return out
