"""Async scheduling (`EngineOptions.async_scheduling`, one device): a decode-only step's tokens are
drawn on the device and read one engine call later, after the next step was planned and launched
behind them, so the host's planning and the device's step overlap.

A step whose tokens are drawn and not yet read is in flight (`Flight`: its plan, its sampling
rows, its `Draw`). The next call `advance`s it (what needs no token: computed tokens, pages,
checkpoints), then asks `plans_ahead`: can the next plan be made without those tokens, i.e. is it
the plan `Scheduler.schedule` would make once they are known, less the rows of sequences that
stop there? True when nothing waits to be admitted, every running sequence that is not paused is
one of the flight's (its next segment is the decode of its pending token), the new pages those
decodes need come from free blocks alone (nothing evicted, so nothing preempted, and a page taken
for a sequence that stops goes back leaving the cache as it was), and they fit the step's budget.

If so (`AsyncScheduling.resume`): a placeholder (`PENDING`, cairn.workers.sequence) stands in each
sequence's pending token while the plan is made (`schedule(ahead=True)`), the step is launched
with its decodes' input ids taken from the drawn ones on the device (the runner's `fed`), then the
flight lands: its tokens are read and applied. A sequence that stopped there gets nothing from the
new step (its row is computed and dropped, `drop_stopped`: it wrote only its own unregistered page
and its own state slot, both given back). Then `plan_deferred` does for those that go on what
`schedule` left: the next token's page taken a step early, and the checkpoints at the page
boundaries their decodes reach (copied after the launched step). The new step is sampled after
that, so penalties, grammars and `min_tokens` see every token before it. Outputs come one call
late. Any other step runs as without async scheduling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cairn.workers.plan import StepPlan
from cairn.workers.sampler import Draw
from cairn.workers.sequence import PENDING, Sequence


@dataclass
class Flight:
    """A step launched by one call of `Engine.step` whose tokens the next call reads."""
    plan: StepPlan
    sampling: list[Sequence]  # its sampling rows, in the order of `draw`
    draw: Draw


@dataclass
class Launched:
    """A step planned and launched: its plan, its sampling rows, its logits (None: nothing ran or
    its forward failed), the exception that failed its forward, and the seconds it took."""
    plan: StepPlan
    rows: list[Sequence]
    logits: torch.Tensor | None = None
    failure: Exception | None = None
    seconds: float = 0.0


def plans_ahead(scheduler, pending: list[Sequence]) -> bool:
    """Whether the next plan can be made before the tokens `pending` (the running sequences
    sampling in the step in flight, already `advance`d) draw there are known (module doc)."""
    if scheduler.waiting:
        return False
    ps, mine = scheduler.page_size, {id(seq) for seq in pending}
    rows = pages = 0
    for seq in scheduler.running:
        if seq.paused:
            continue
        position = seq.num_computed  # where the pending token goes
        if id(seq) not in mine or position != seq.num_tokens:
            return False
        rows += 1
        pages += len(seq.cache.page_ids) * ps <= position
    return rows <= scheduler.options.max_num_batched_tokens and scheduler.cache.can_take_free_pages(pages)


def plan_deferred(scheduler, plan: StepPlan) -> None:
    """What `schedule` would have done for a plan made ahead, once the tokens before it are known,
    for the sequences that go on (one that stopped does none of it), in its order: the next
    token's page taken a step early (`Scheduler.look_ahead`), then the checkpoints of decodes
    reaching a page boundary (states taken after the step: the runner copies them after the step
    it launched)."""
    scheduler.take_early_pages(plan)
    for seg in plan.deferred:
        if not seg.seq.finished:
            scheduler.checkpoints_or_fail(plan, seg)
    plan.deferred = []


class AsyncScheduling:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.flight: Flight | None = None  # the step whose drawn tokens the next call reads
        self.overlapped_steps = 0  # steps planned and launched before the last one's tokens were read
        self.dropped_rows = 0  # rows of those steps computed for sequences that stopped the step before

    def resume(self, scheduler, launch: Callable[[StepPlan, tuple | None], Launched],
               snapshot_after: Callable[[StepPlan], None]) -> tuple[list, Launched | None]:
        """With a step in flight: advances it, plans and launches the next one ahead of its tokens
        where `plans_ahead` allows (`launch(plan, fed)`), and lands it. Returns (what
        `Scheduler.apply_tokens` applied of the flight's tokens; the step launched ahead, or None:
        the caller plans the next step as usual)."""
        flight, self.flight = self.flight, None
        if flight is None:
            return [], None
        scheduler.advance(flight.plan)
        pending = [seq for seq in flight.sampling if not seq.finished]
        if not plans_ahead(scheduler, pending):
            return self._land(scheduler, flight), None
        for seq in pending:
            seq.token_ids.append(PENDING)
        try:
            plan = scheduler.schedule(ahead=True)
            launched = launch(plan, (flight.draw.ids, {id(seq): i for i, seq in enumerate(flight.sampling)}))
        finally:
            for seq in pending:
                seq.token_ids.pop()
        applied = self._land(scheduler, flight)
        self.overlapped_steps += bool(plan)
        if (plan.deferred or plan.lookahead) and launched.failure is None:  # next pages, boundary checkpoints
            plan_deferred(scheduler, plan)
            snapshot_after(plan)
        return applied, launched

    @staticmethod
    def _land(scheduler, flight: Flight) -> list:
        """Reads the flight's tokens and applies them (its plan was `advance`d already)."""
        live = [(seq, r) for seq, r in zip(flight.sampling, flight.draw.read()) if not seq.finished]  # (aborts)
        return scheduler.apply_tokens([seq for seq, _ in live], [r for _, r in live])

    def drop_stopped(self, step: Launched) -> None:
        """The rows of sequences that stopped in the flight that landed after `step` was launched
        leave its logits."""
        live = [i for i, seq in enumerate(step.rows) if not seq.finished]
        if len(live) < len(step.rows):
            self.dropped_rows += len(step.rows) - len(live)
            step.logits = step.logits.index_select(0, torch.tensor(live, dtype=torch.long, device=step.logits.device))
            step.rows = [step.rows[i] for i in live]

    def takes(self, plan: StepPlan) -> bool:
        """This step's tokens are left in flight (a decode-only step)."""
        return self.enabled and not plan.prefills

    def launch(self, step: Launched, draw: Draw) -> None:
        self.flight = Flight(step.plan, step.rows, draw) if step.rows else None
