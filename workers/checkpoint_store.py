"""Recurrent-state checkpoints: which state-pool slots hold the state at which page boundary.

A checkpoint is the full recurrent state (every linear layer's conv and delta-rule state) after
the page named by its chain hash. Its slot is a row of the runner's state pool, beside the
running sequences' slots but in a range of its own. Plain Python; the runner copies the data.

Slots are `pending` (allocated, being written, not yet usable) or `stored` under a hash. A
stored checkpoint remembers the kinds that asked for it (so hits can credit them) and, for the
`exact` baseline, the tokens after its boundary that a prompt must repeat to use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Checkpoint:
    page_hash: bytes
    slot: int
    depth: int  # pages under it
    kinds: set[str] = field(default_factory=set)
    exact_tail: tuple[int, ...] | None = None  # `end` kind: tokens a prompt must repeat after it

    def usable_by(self, token_ids: list[int], page_size: int) -> bool:
        """True unless this is an `exact` checkpoint the prompt does not fully extend."""
        if self.exact_tail is None:
            return True
        start = self.depth * page_size
        end = start + len(self.exact_tail)
        return len(token_ids) > end and tuple(token_ids[start:end]) == self.exact_tail


class CheckpointStore:
    def __init__(self, first_slot: int, num_slots: int):
        self.first_slot = first_slot
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._pending: set[int] = set()
        self._by_hash: dict[bytes, Checkpoint] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_stored(self) -> int:
        return len(self._by_hash)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take(self) -> int:
        slot = self._free.pop()
        self._pending.add(slot)
        return slot

    def give_back(self, slot: int) -> None:
        """Returns a pending slot unused."""
        self._pending.remove(slot)
        self._free.append(slot)

    def store(self, slot: int, page_hash: bytes, depth: int, kinds: set[str],
              exact_tail: tuple[int, ...] | None = None) -> Checkpoint:
        self._pending.remove(slot)
        ckpt = Checkpoint(page_hash, slot, depth, set(kinds), exact_tail)
        self._by_hash[page_hash] = ckpt
        return ckpt

    def get(self, page_hash: bytes) -> Checkpoint | None:
        return self._by_hash.get(page_hash)

    def remove(self, page_hash: bytes) -> Checkpoint:
        ckpt = self._by_hash.pop(page_hash)
        self._free.append(ckpt.slot)
        return ckpt

    def hashes(self) -> list[bytes]:
        return list(self._by_hash)

    def check(self) -> None:
        stored = {c.slot for c in self._by_hash.values()}
        if len(self._free) + len(self._pending) + len(stored) != self.num_slots or set(self._free) & stored:
            raise AssertionError(f"checkpoint store corrupt: free={len(self._free)} pending={len(self._pending)} "
                                 f"stored={len(stored)} total={self.num_slots}")
