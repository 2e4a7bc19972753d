"""Which recurrent states a step saves on the way, and where (the scheduler's
`checkpoints_or_fail`, for each segment that crosses a page boundary or reaches a checkpoint
target inside its prompt). Plans, not tensors: no torch here.

`plan_checkpoints(cache, policy, plan, seg)`: the segment's targets inside it (thinned by the
policy when checkpoint room is short), plus every decode crossing under the `all` baseline, each
admitted by the policy and given a checkpoint slot: a state at a boundary inside the segment is
taken from the chunked delta rule (`Segment.ckpt_slots`), one at its end is a slot copy after the
step (`StepPlan.snapshots`). With no device slot left and a host tier, the state goes straight to
the host (`StepPlan.host_snapshots`) and the segment ends at that boundary (later positions wait
for the next step). Then the finish capture: the last boundary crossed, from the prompt's last one
on (`PrefixCache.finish_capture`), kept on whichever tier has room. Every checkpoint is committed
after the step (`StepPlan.commits`, `Scheduler.advance`).
"""

from __future__ import annotations

from cairn.workers.cache.checkpoint_policy import EVERY, CheckpointPolicy
from cairn.workers.cache.prefix_cache import PrefixCache
from cairn.workers.plan import Commit, Segment, StepPlan
from cairn.workers.slot import HostSlot


def plan_checkpoints(cache: PrefixCache, policy: CheckpointPolicy, plan: StepPlan, seg: Segment) -> None:
    """The checkpoints `seg` takes on its way (module doc), added to `plan`; may end the segment
    early at a boundary whose state goes straight to the host tier."""
    seq, ps = seg.seq, cache.page_size
    first, last = seg.start // ps + 1, seg.end // ps  # boundaries inside (start, end]
    targets = seq.cache.checkpoint_targets
    if any(seg.start < p <= seg.end for p in targets):  # (a decode step past the prompt has none)
        targets = policy.thin(targets, ps, bool(seq.hints), not cache.checkpoint_room())
    wanted = {p: set(k) for p, k in targets.items() if seg.start < p <= seg.end}
    if EVERY in policy.kinds:
        for j in range(max(first, seq.num_prompt_tokens // ps + 1), last + 1):
            wanted.setdefault(j * ps, set()).add(EVERY)  # decode crossings of the `all` baseline
    for pos in sorted(wanted):
        admitted = policy.admit(wanted[pos], room=cache.checkpoint_room())
        if not admitted:
            continue
        slot = cache.take_checkpoint_slot()
        if slot is None and cache.host:  # no device slot: the state goes straight
            slot = cache.take_host_checkpoint_slot()  # to the host tier, copied from the sequence's slot after the step
            if slot is not None:
                seg.num_tokens = pos - seg.start  # so the segment ends at this boundary
                plan.host_snapshots.append((seq.cache.state_slot, slot.blocks))
                plan.commits.append(Commit(seq, slot, pos, admitted))
                return  # later positions (and the finish capture) wait for the next step
        if slot is not None:
            _attach(plan, seg, pos - seg.start, slot)
            plan.commits.append(Commit(seq, slot, pos, admitted))
    # The finish capture: the last boundary crossed, from the prompt's last one on.
    if policy.captures_finish is None or last < max(first, seq.num_prompt_tokens // ps, 1):
        return
    offset = last * ps - seg.start
    slot = cache.finish_capture(seq, last, at_end=offset == seg.num_tokens)
    if isinstance(slot, HostSlot):  # copied from the sequence's slot after the step
        plan.host_snapshots.append((seq.cache.state_slot, slot.blocks))
    elif slot is not None:
        _attach(plan, seg, offset, slot)

def _attach(plan: StepPlan, seg: Segment, offset: int, slot: int) -> None:
    if offset == seg.num_tokens:  # the segment's final state: copy the slot after the step
        plan.snapshots.append((seg.seq.cache.state_slot, slot))
    else:
        seg.ckpt_slots.setdefault(offset, []).append(slot)
