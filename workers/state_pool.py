"""Recurrent-state slots: which slot ids are free and which are held.

A slot holds one sequence's full recurrent state (conv + delta-rule state of every linear
layer); the tensors live in the runner, this pool owns the ids. A model without recurrent
layers still gets slots (they index nothing), so the scheduler treats every model alike.

A refused allocation is a result (`can_allocate` is False), never an exception.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot; call can_allocate first")
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def release(self, slot: int) -> None:
        self._held.remove(slot)
        self._free.append(slot)

    def check(self) -> None:
        if len(self._free) + len(self._held) != self.num_slots:
            raise AssertionError(f"state pool corrupt: free={len(self._free)} held={len(self._held)} "
                                 f"total={self.num_slots}")
