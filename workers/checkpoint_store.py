"""Recurrent-state checkpoints: which state slot holds the state at which page boundary.

A checkpoint is the full recurrent state (every linear layer's conv and delta-rule state) after
the page named by its chain hash. Its slot comes from the arena like a running sequence's
(`workers.arena`); the runner copies the data. Plain Python.

Slots are `pending` (taken for a checkpoint, being written, not yet usable) or `stored` under a
hash. A stored checkpoint remembers the kinds that asked for it (so hits can credit them) and,
for the `exact` baseline, the tokens after its boundary that a prompt must repeat to use it.
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
    def __init__(self) -> None:
        self._pending: set[int] = set()
        self._by_hash: dict[bytes, Checkpoint] = {}
        self._by_slot: dict[int, Checkpoint] = {}

    @property
    def num_stored(self) -> int:
        return len(self._by_hash)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def add_pending(self, slot: int) -> None:
        self._pending.add(slot)

    def is_pending(self, slot: int) -> bool:
        return slot in self._pending

    def drop_pending(self, slot: int) -> None:
        self._pending.remove(slot)

    def store(self, slot: int, page_hash: bytes, depth: int, kinds: set[str],
              exact_tail: tuple[int, ...] | None = None) -> Checkpoint:
        self._pending.remove(slot)
        ckpt = Checkpoint(page_hash, slot, depth, set(kinds), exact_tail)
        self._by_hash[page_hash] = self._by_slot[slot] = ckpt
        return ckpt

    def get(self, page_hash: bytes) -> Checkpoint | None:
        return self._by_hash.get(page_hash)

    def in_slot(self, slot: int) -> Checkpoint | None:
        return self._by_slot.get(slot)

    def remove(self, page_hash: bytes) -> Checkpoint:
        ckpt = self._by_hash.pop(page_hash)
        del self._by_slot[ckpt.slot]
        return ckpt

    def hashes(self) -> list[bytes]:
        return list(self._by_hash)

    def slots(self) -> set[int]:
        """Slots taken by checkpoints, pending or stored."""
        return set(self._by_slot) | self._pending

    def check(self) -> None:
        if set(self._by_slot) & self._pending or len(self._by_slot) != len(self._by_hash):
            raise AssertionError(f"checkpoint store corrupt: pending={len(self._pending)} "
                                 f"stored={len(self._by_hash)}/{len(self._by_slot)}")
