"""A checkpoint slot, wherever it is: a device arena slot (an int, `cairn.workers.cache.arena`) or, when
no device slot could be had, a `HostSlot`: host blocks the state is copied to after the step
(`cairn.workers.plan.StepPlan.host_snapshots`). Typed, so that no id's sign means anything."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostSlot:
    """A pending checkpoint on host blocks: the state is copied there from the sequence's slot
    after the step (`StepPlan.host_snapshots`)."""
    id: int  # unique among the cache's pending host slots
    blocks: tuple[int, ...]  # the host blocks, slot_blocks of them

    def __repr__(self) -> str:
        return f"HostSlot({self.id})"


Slot = int | HostSlot  # a checkpoint slot: a device arena slot, or host blocks
