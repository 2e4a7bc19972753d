"""A speculating engine's second half of a step, and its drafter's turn (cairn.workers.speculative):
the engine hands `Verifier.verify` the step's plan and logits with its scheduler and sampler, and
calls `Verifier.propose` when the next step (or any other forward pass) begins.

`verify`: every row is sampled (a verify segment's at each drafted position, as the sequence's
output token of that index: `Sampler.sample`'s offsets), `acceptance.kept_tokens` says which
drafted tokens stand, `verify_slots.settle` rolls the states back and plans the checkpoints the
kept tokens reach (the rollbacks copied, then the snapshots), the kept drafted tokens join their
sequences before the step advances (so the pages and checkpoints it completes are hashed over
them), then the last tokens apply. It returns what `Scheduler.apply_tokens` applied, each
sequence's tokens in order, and leaves the drafter's runs for `propose`: one a segment that
computed something, wanting up to k drafts where its sequence decodes next (none while the gate
is closed; a decode-only step then runs no head pass at all).

`propose`: the drafter runs over the last step's kept positions and drafts, once that step's
tokens went out; runs over a prompt's earlier chunks wait for its last (`drafts.held_back`, one
device). A head pass that fails costs its sequences their drafts for one step, nothing else; a
tensor-parallel rank lost (`EngineBroken`) is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from cairn.workers.engine_errors import EngineBroken
from cairn.workers.engine_options import EngineOptions
from cairn.workers.plan import StepPlan
from cairn.workers.speculative.acceptance import kept_tokens
from cairn.workers.speculative.drafts import WAITING_STEPS, DraftRun, Drafter, held_back
from cairn.workers.speculative.gate import SpeculationGate
from cairn.workers.speculative.totals import SpeculationTotals
from cairn.workers.speculative.verify_slots import settle

log = logging.getLogger(__name__)


class Verifier:
    def __init__(self, options: EngineOptions, runner, drafter: Drafter, totals: SpeculationTotals):
        """`runner`: the engine's (a tensor-parallel one included): it copies the rollbacks and
        holds the step's hidden states the drafter reads; `totals`: where what is kept is counted."""
        self.options, self.runner, self.drafter = options, runner, drafter
        self.gate = SpeculationGate() if options.speculative_adaptive else None
        self.totals = totals
        self._proposal: list[DraftRun] = []  # the head's pass over the last step's kept positions
        self._waiting: dict[int, DraftRun] = {}  # runs over prompts' earlier chunks (`held_back`)

    @property
    def proposing(self) -> bool:
        """The drafter has runs to make before the next forward pass replaces the hidden states."""
        return bool(self._proposal)

    @property
    def holding(self) -> bool:
        """Runs are pending or waiting: an export must flush them first (its pages carry head K/V)."""
        return bool(self._proposal or self._waiting)

    def verify(self, plan: StepPlan, logits: torch.Tensor, scheduler, sampler,
               snapshot_after: Callable[[StepPlan], None]) -> list:
        sampling = plan.sampling_rows()
        results = sampler.sample(logits, [seq for seq, _ in sampling], [j for _, j in sampling])
        segments = plan.decodes + plan.prefills
        first_row, row = {}, 0  # each segment's first row of the step's hidden states
        for seg in segments:
            first_row[id(seg)] = row
            row += seg.num_tokens
        rows, i = [], 0  # each sampling segment's results
        for seg in segments:
            if seg.samples:
                rows.append((seg, results[i:i + seg.drafts + 1]))
                i += seg.drafts + 1
        verified = [(seg, mine) for seg, mine in rows if seg.verify]
        verdicts = dict(zip((id(seg) for seg, _ in verified),
                            kept_tokens([seg for seg, _ in verified], [mine for _, mine in verified],
                                        scheduler.stop_reason)))
        kept, seqs, tokens = {}, [], []
        drafted_seqs, drafted_tokens = [], []  # the kept drafted tokens, which the step computed
        for seg, mine in rows:
            if seg.verify:
                n, accepted = verdicts[id(seg)]
                self.totals.count(seg.drafts, accepted)
                sampler.count_kept(seg.seq, [result[0] for result in mine[1:n]])  # penalties' counts
                if n:
                    kept[id(seg.seq)] = n
                drafted_seqs += [seg.seq] * (n - 1)
                drafted_tokens += mine[:n - 1]
                mine = mine[max(n - 1, 0):max(n, 1)]  # the token after them (none kept: the first row's fault)
            seqs.append(seg.seq)
            tokens += mine
        self.runner.copy_states(settle(scheduler, plan, kept))  # the rollbacks, before the snapshots
        snapshot_after(plan)
        for seq in seqs:
            seq.draft = []
        # the computed drafted tokens join the sequences first (none of them stops one:
        # `kept_tokens` ends at the first that does), so the pages and checkpoints the step
        # completes are hashed over them; then the step advances, and the last tokens apply
        early = scheduler.apply_tokens(drafted_seqs, drafted_tokens)
        scheduler.advance(plan)
        applied = self._in_order(early, scheduler.apply_tokens(seqs, tokens))
        self._plan_runs(plan, first_row, len(scheduler.running))
        return applied

    def _plan_runs(self, plan: StepPlan, first_row: dict[int, int], running: int) -> None:
        """The drafter's runs for `propose`: one per segment that computed something, with the
        drafts its sequence wants (k, less what its length leaves) where it decodes next."""
        k = self.options.num_speculative_tokens
        if self.gate is not None and not self.gate.drafting(running):
            if not plan.prefilling:  # decode-only: no head pass either (`SpeculationGate`)
                return
            k = 0  # a prefill: the head runs over it for its K/V there, drafting nothing
        runs = []
        for seg in plan.decodes + plan.prefills:
            seq = seg.seq
            if seq.finished or seg.num_tokens == 0 or seq.images:  # images: no drafts, no head pass
                continue
            want = 0
            if seq.num_computed == len(seq.token_ids) - 1:
                want = max(0, min(k, seq.max_total_tokens - len(seq.token_ids) - 1))
            runs.append(DraftRun(seg, first_row[id(seg)], want))
        self._proposal = runs

    def observe(self, plan: StepPlan, tokens: int, seconds: float) -> None:
        """A decode-only step's rate, for the gate (with drafts or without)."""
        if self.gate is not None and not plan.prefilling:
            self.gate.observe(len(plan.segments), any(seg.drafts for seg in plan.segments), tokens, seconds)

    def propose(self, flush: bool = False) -> None:
        """The drafts of the last step's sequences (`Drafter.propose` over its kept positions), at
        the start of the next step or of any other forward pass (which replaces the runner's kept
        hidden states), so that the last step's tokens go out before the head runs: a prompt's
        first token waits for the target's prefill alone, not for the head's pass over it too,
        however many steps it takes (`held_back`; `flush`: none waits). Sequences that ended in
        between (aborted) are left out."""
        runs, self._proposal = self._proposal, []
        if self.options.tensor_parallel_size == 1:  # (a rank's hidden states stay on it: none held back there)
            runs, self._waiting = held_back(runs, self._waiting, self.runner.hidden,
                                            WAITING_STEPS * self.options.max_num_batched_tokens, flush)
        try:
            self.drafter.propose([run for run in runs if not run.segment.seq.finished])
        except EngineBroken:
            raise
        except Exception:
            log.exception("the MTP head's pass failed; %d sequence(s) decode this step without drafts", len(runs))
            for run in runs:
                run.segment.seq.draft = []

    @staticmethod
    def _in_order(early: list, last: list) -> list:
        """`Scheduler.apply_tokens`' results of a verify step, each sequence's kept drafted
        tokens (`early`) before its last token (`last`), sequence by sequence."""
        before: dict[int, list] = {}
        for entry in early:
            before.setdefault(id(entry[0]), []).append(entry)
        out = []
        for entry in last:
            out += before.pop(id(entry[0]), [])
            out.append(entry)
        for rest in before.values():  # (a sequence whose last token failed to apply)
            out += rest
        return out
