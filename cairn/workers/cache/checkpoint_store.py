"""Recurrent-state checkpoints: which state slot holds the state at which token position.

A checkpoint is the full recurrent state (every linear layer's conv and delta-rule state) after
a position of a chain: at a page boundary, the page named by its chain hash; inside a page (a
sub-page checkpoint, where a template diverges), its `floor` page plus the `tail` tokens after
it, keyed by the hash those tokens would have as the next page (`cairn.cache_service.hashing`).
Inside the first page the floor is the chain's hash root, which stands before page 0 in the
chain (a new conversation parts from others of its tenant a few tokens in, past the first
message's role header); such a state is under no page, so the index is not told of it
(`state_page` None). Its
slot comes from the arena like a running sequence's (`cairn.workers.cache.arena`); the runner copies the
data. Plain Python.

Slots are `pending` (taken for a checkpoint, being written, not yet usable) or `stored` under a
key. A stored checkpoint remembers the kinds that asked for it (so hits can credit them) and,
for the `exact` baseline, the tokens after its boundary that a prompt must repeat to use it.
Sub-page checkpoints are also found by their floor page (`at_floor`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cairn.cache_service.hashing import branch_root, sub_state_keys


@dataclass
class Checkpoint:
    page_hash: bytes  # its key: the page it ends, or (sub-page) the hash of floor + tail
    slot: int
    depth: int  # whole pages under it
    kinds: set[str] = field(default_factory=set)
    exact_tail: tuple[int, ...] | None = None  # `end` kind: tokens a prompt must repeat after it
    tail: tuple[int, ...] = ()  # sub-page: the tokens after its floor page that it also covers
    floor: bytes | None = None  # sub-page: the hash of the page under it
    admitted_at: int = 0  # the policy's clock when it was stored (how long its hits take to come back)
    root: bytes | None = None  # sub-page: the hash root it was computed under (only that root's prompts use it)
    _index_key: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def index_key(self) -> bytes | None:
        """What the index knows a sub-page checkpoint by, beside its floor's state: a page of its
        own after the floor page, with a state (`cairn.cache_service.hashing.sub_state_keys`), so
        a router can tell which replica resumes a prompt inside that page. None for a whole-page
        checkpoint, and inside the first page (no page under it)."""
        if self.floor is None or not self.depth:
            return None
        if self._index_key is None:
            self._index_key = sub_state_keys(branch_root(self.floor, self.root), self.tail)[-1]
        return self._index_key

    @property
    def state_page(self) -> bytes | None:
        """The page the index knows this state by: the page it ends, or a sub-page one's floor
        page; None inside the first page (its floor is a hash root, no page)."""
        if self.floor is None:
            return self.page_hash
        return self.floor if self.depth else None

    def position(self, page_size: int) -> int:
        """Tokens the state has seen."""
        return self.depth * page_size + len(self.tail)

    def usable_by(self, token_ids: list[int], page_size: int) -> bool:
        """True unless the prompt does not repeat its tail (a sub-page one), or this is an
        `exact` checkpoint the prompt does not fully extend."""
        start = self.depth * page_size
        if self.tail and tuple(token_ids[start:start + len(self.tail)]) != self.tail:
            return False
        if self.exact_tail is None:
            return True
        end = start + len(self.exact_tail)
        return len(token_ids) > end and tuple(token_ids[start:end]) == self.exact_tail


class CheckpointStore:
    def __init__(self) -> None:
        self._pending: set[int] = set()
        self._by_hash: dict[bytes, Checkpoint] = {}
        self._by_slot: dict[int, Checkpoint] = {}
        self._floors: dict[bytes, dict[bytes, Checkpoint]] = {}  # floor page -> its sub-page ones

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
              exact_tail: tuple[int, ...] | None = None, tail: tuple[int, ...] = (),
              floor: bytes | None = None, admitted_at: int = 0, root: bytes | None = None) -> Checkpoint:
        self._pending.remove(slot)
        ckpt = Checkpoint(page_hash, slot, depth, set(kinds), exact_tail, tail, floor, admitted_at, root)
        self._by_hash[page_hash] = self._by_slot[slot] = ckpt
        if floor is not None:
            self._floors.setdefault(floor, {})[page_hash] = ckpt
        return ckpt

    def get(self, page_hash: bytes) -> Checkpoint | None:
        return self._by_hash.get(page_hash)

    def in_slot(self, slot: int) -> Checkpoint | None:
        return self._by_slot.get(slot)

    def at_floor(self, floor: bytes) -> list[Checkpoint]:
        """The sub-page checkpoints inside the page after `floor`."""
        return list(self._floors.get(floor, {}).values())

    def has_sub_page(self, floor: bytes) -> bool:
        return floor in self._floors

    def remove(self, page_hash: bytes) -> Checkpoint:
        ckpt = self._by_hash.pop(page_hash)
        del self._by_slot[ckpt.slot]
        if ckpt.floor is not None:
            at = self._floors[ckpt.floor]
            del at[page_hash]
            if not at:
                del self._floors[ckpt.floor]
        return ckpt

    def state_pages(self) -> list[bytes]:
        """The pages with a state at their end or inside the page after them (the index's view)."""
        return [p for p in dict.fromkeys(c.state_page for c in self._by_hash.values()) if p is not None]

    def sub_pages(self) -> list[Checkpoint]:
        """The sub-page checkpoints."""
        return [c for at in self._floors.values() for c in at.values()]

    def hashes(self) -> list[bytes]:
        return list(self._by_hash)

    def slots(self) -> set[int]:
        """Slots taken by checkpoints, pending or stored."""
        return set(self._by_slot) | self._pending

    def check(self) -> None:
        sub = sum(map(len, self._floors.values()))
        if set(self._by_slot) & self._pending or len(self._by_slot) != len(self._by_hash) or \
                sub != sum(c.floor is not None for c in self._by_hash.values()):
            raise AssertionError(f"checkpoint store corrupt: pending={len(self._pending)} "
                                 f"stored={len(self._by_hash)}/{len(self._by_slot)} sub-page={sub}")
