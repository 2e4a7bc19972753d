"""The state slots of a verify step (speculative decoding): spare slots beside the cache's arena
(`ArenaLayout.spare_slots`, so the cache is as without speculation) keep the recurrent state
after each drafted token of a verify segment, and after the step the slot of the last kept token
is copied back over the sequence's own (the rollback). Plans, not tensors: no torch here.

- `take_states(plan, spare, whole)`, while the scheduler plans: each verify segment gets a spare
  slot per drafted token, as many as are left (none: a plain decode); a step that prefills
  verifies drafts only where the token budget held every prompt chunk whole (`whole`).
- `settle(scheduler, plan, kept)`, once it is known how many tokens of each stand: the segment
  ends after them, the page after a boundary they reach is taken a step early, the checkpoints
  there are planned as for a decode ending the page, and the spare slots go back.
"""

from __future__ import annotations

from cairn.workers.plan import StepPlan


def take_states(plan: StepPlan, spare: list[int], whole: bool = True) -> None:
    """A spare slot (popped from `spare`) for the state after each drafted token of the plan's
    verify segments: a segment gets as many drafts as slots are left (none: a plain decode). A
    step that prefills verifies drafts beside its prompts' chunks where the token budget held
    them all: every running prompt's chunk is the rest of it, and the budget was not spent
    before the waiting prompts (`whole`); else none (drafts never take a prompt's tokens)."""
    cut = plan.prefilling and (not whole or any(
        seg.end < seg.seq.num_tokens for seg in plan.prefills if not seg.verify))
    for seg in plan.decodes + plan.prefills:
        if seg.drafts:
            take = 0 if cut else min(seg.drafts, len(spare))
            seg.states = [spare.pop() for _ in range(take)]
            seg.drafts, seg.num_tokens = take, 1 + take
    # a verify chunk's states the chunked rule takes (verify decode rows: `ForwardBatch.level_saves`);
    # one left without drafts is a plain decode
    for seg in plan.prefills:
        if seg.verify:
            seg.ckpt_slots = {j + 1: [slot] for j, slot in enumerate(seg.states)}
    plain = [seg for seg in plan.prefills if seg.verify and not seg.drafts]
    if plain:
        plan.prefills = [seg for seg in plan.prefills if seg.drafts or not seg.verify]
        plan.decodes += plain


def settle(scheduler, plan: StepPlan, kept: dict[int, int]) -> list[tuple[int, int]]:
    """After a step with verify segments, once it is known how many tokens of each stand
    (`kept`, by `id(seq)`: 1 + the drafted tokens kept; a sequence missing there, finished or
    failed, keeps none): each such segment ends after its kept tokens, so only they advance,
    and only whole pages of them are registered. A verify segment lies in one page, so a
    boundary its kept tokens reach is their end: the page after it is taken a step early, and
    the checkpoints there are planned, as for a decode ending the page (`Scheduler.schedule`),
    copied after the step from the sequence's slot once rolled back (`plan.snapshots` /
    `plan.host_snapshots`, which the caller runs after the returned copies). Returns the
    rollbacks, (spare slot, sequence's state slot): the state after its last kept token,
    copied over the one after its last drafted one. The spare slots go back to the scheduler's
    `spare_slots`."""
    rollbacks: list[tuple[int, int]] = []
    plan.snapshots, plan.host_snapshots = [], []
    for seg in plan.decodes + plan.prefills:
        if not seg.verify:
            continue
        seq, states = seg.seq, seg.states
        seg.states = []
        scheduler.spare_slots += states
        n = kept.get(id(seq), 0) if not seq.finished else 0
        seg.num_tokens = n  # nothing stands: nothing of it is advanced or stored
        if n == 0:
            continue
        if n <= len(states):
            rollbacks.append((states[n - 1], seq.cache.state_slot))
        if n > 1 and seg.end % scheduler.page_size == 0:  # as a decode ending this page would have
            scheduler.look_ahead(seq, seg.end + 1)
        if scheduler.cache.recurrent:  # (a boundary it reaches is its end: it lies in one page)
            scheduler.checkpoints_or_fail(plan, seg)
    return rollbacks
