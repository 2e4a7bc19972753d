"""The cluster-wide index of what every worker holds, and how deep a prompt would hit on each.

Workers report every change as `EventBatch`es (cache_service.events); `CacheIndex.apply` replays
them, and `score(page_hashes)` tells the router, per worker, the longest run of the prompt's
pages resident there (`hit_pages`) and the deepest state checkpoint under it (`state_pages`),
from which the resume point follows (design rule 4). A plain class: the Ray actor wraps it.

Ordering, and who acts:
- Per worker, a batch applies only as seq = last + 1. A redelivered old batch (seq <= last) is
  ignored harmlessly. A gap (seq > last + 1, or a first batch that is neither seq 0 nor a
  snapshot) means events were lost: the batch is refused, the worker is listed by
  `workers_needing_resync()` and scores 0/0 until a snapshot arrives. The index's owner (the
  actor) acts: it asks that worker for `EventStream.snapshot`. Scoring a worker 0/0 costs a
  cache miss, never a wrong hit.
- A snapshot (a batch opening with AllCleared) is accepted at any seq and resets the worker to
  exactly its contents; its seq becomes the last one.
- `drop_worker` forgets a dead replica entirely; if that id speaks again it is a new worker.

Event semantics: a state is kept only while its page is resident on that worker (a StateStored
for a non-resident page is ignored, a PagesRemoved takes the page's state with it); removing
something absent is a no-op. PagesStored.parent is not needed here: the hash already names the
whole prefix.

Bounded memory: at most `max_pages` (worker, page) entries in all. Past it, further pages a
worker stores are dropped (counted as `pages_dropped` in `stats()`); the index then under-reports
hits for them, which costs a cache miss, never a wrong hit.

Storage sits behind `_MemoryStore` (who holds which hash, and the scoring walk); a Redis backend
implements the same methods. Scoring walks the prompt's hashes once over hash -> worker-bitmask
maps and stops as soon as no trusted worker still matches.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cache_service.events import (AllCleared, Event, EventBatch, PagesRemoved, PagesStored,
                                  StateRemoved, StateStored)


@dataclass(frozen=True)
class WorkerScore:
    """hit_pages: longest k with page_hashes[0:k] all resident on the worker.
    state_pages: deepest j in 1..hit_pages with a state at page_hashes[j-1] there, 0 if none."""
    hit_pages: int
    state_pages: int


ZERO = WorkerScore(0, 0)


class _MemoryStore:
    """Who holds which page and state: hash -> bitmask of workers, plus each worker's own sets
    (for clearing, removal and `contents`). Knows nothing of seq numbers or trust."""

    def __init__(self, max_pages: int):
        self.max_pages = max_pages
        self.entries = 0  # (worker, page) pairs, the quantity max_pages bounds
        self._bit: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._pages: dict[bytes, int] = {}
        self._states: dict[bytes, int] = {}
        self._held: dict[str, tuple[set[bytes], set[bytes]]] = {}

    def add_worker(self, worker: str) -> None:
        if worker not in self._bit:
            self._bit[worker] = self._free_bits.pop() if self._free_bits else len(self._bit)
            self._held[worker] = (set(), set())

    def forget(self, worker: str) -> None:
        if worker in self._bit:
            self.clear(worker)
            self._free_bits.append(self._bit.pop(worker))
            del self._held[worker]

    def mask(self, workers: Iterable[str]) -> int:
        m = 0
        for w in workers:
            m |= 1 << self._bit[w]
        return m

    def add_pages(self, worker: str, hashes: Sequence[bytes]) -> int:
        """Stores what fits under max_pages; returns how many pages were dropped."""
        bit, pages, held = 1 << self._bit[worker], self._pages, self._held[worker][0]
        for i, h in enumerate(hashes):
            if h in held:
                continue
            if self.entries >= self.max_pages:
                return sum(1 for h in hashes[i:] if h not in held)
            held.add(h)
            pages[h] = pages.get(h, 0) | bit
            self.entries += 1
        return 0

    def remove_pages(self, worker: str, hashes: Iterable[bytes]) -> None:
        held = self._held[worker][0]
        for h in hashes:
            if h in held:
                held.remove(h)
                _unset(self._pages, h, self._bit[worker])
                self.entries -= 1
                self.remove_state(worker, h)

    def add_state(self, worker: str, page_hash: bytes) -> None:
        held, held_states = self._held[worker]
        if page_hash in held and page_hash not in held_states:
            held_states.add(page_hash)
            self._states[page_hash] = self._states.get(page_hash, 0) | 1 << self._bit[worker]

    def remove_state(self, worker: str, page_hash: bytes) -> None:
        held_states = self._held[worker][1]
        if page_hash in held_states:
            held_states.remove(page_hash)
            _unset(self._states, page_hash, self._bit[worker])

    def clear(self, worker: str) -> None:
        held, held_states = self._held[worker]
        bit = self._bit[worker]
        for h in held:
            _unset(self._pages, h, bit)
        for h in held_states:
            _unset(self._states, h, bit)
        self.entries -= len(held)
        held.clear()
        held_states.clear()

    def contents(self, worker: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        held, held_states = self._held[worker]
        return frozenset(held), frozenset(held_states)

    def score(self, page_hashes: Sequence[bytes], trusted: int) -> dict[str, WorkerScore]:
        pages_get, states_get = self._pages.get, self._states.get
        alive, depth = trusted, 0
        ends: list[tuple[int, int]] = []   # (hit_pages, workers whose run ends there)
        marks: list[tuple[int, int]] = []  # (j, alive workers with a state at page j-1)
        for h in page_hashes:
            here = pages_get(h, 0) & alive
            if here != alive:
                ends.append((depth, alive & ~here))
                alive = here
                if not alive:
                    break
            depth += 1
            s = states_get(h, 0) & alive
            if s:
                marks.append((depth, s))
        if alive:
            ends.append((depth, alive))
        out = {}
        for worker, bit in self._bit.items():
            m = 1 << bit
            hit = next((d for d, ended in ends if ended & m), 0)
            state = next((j for j, s in reversed(marks) if s & m), 0) if marks else 0
            out[worker] = WorkerScore(hit, state) if hit else ZERO
        return out

    def approx_bytes(self) -> int:
        # containers plus one 16-byte bytes object (~49 B) and one mask int (~28 B) per key
        sets = sum(sys.getsizeof(a) + sys.getsizeof(b) for a, b in self._held.values())
        keys = len(self._pages) + len(self._states)
        return sys.getsizeof(self._pages) + sys.getsizeof(self._states) + sets + keys * 77

    def counts(self) -> tuple[int, int]:
        return self.entries, sum(len(s) for _, s in self._held.values())


def _unset(table: dict[bytes, int], h: bytes, bit: int) -> None:
    m = table[h] & ~(1 << bit)
    if m:
        table[h] = m
    else:
        del table[h]


class CacheIndex:
    """Replays workers' event batches in seq order and scores prompts against every worker.

    `max_pages` bounds the (worker, page) entries held in all; pages stored past it are dropped
    and counted in `stats()["pages_dropped"]`."""

    def __init__(self, max_pages: int = 4_000_000):
        if max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {max_pages}")
        self._store = _MemoryStore(max_pages)
        self._last_seq: dict[str, int | None] = {}  # None: known, but no batch applied yet
        self._resync: set[str] = set()
        self._counts = dict(batches_applied=0, batches_ignored=0, batches_refused=0,
                            gaps_detected=0, pages_dropped=0)

    def apply(self, batch: EventBatch | bytes) -> bool:
        """Applies the batch if it is the worker's next one (or a snapshot); True iff applied.
        Bytes are decoded first; EventDecodeError propagates and nothing changes."""
        if not isinstance(batch, EventBatch):
            batch = EventBatch.decode(batch)
        worker, seq = batch.worker_id, batch.seq
        last = self._last_seq.get(worker)
        if not batch.is_snapshot:
            if last is not None and seq <= last:
                self._counts["batches_ignored"] += 1  # redelivery: already applied
                return False
            expected = 0 if last is None else last + 1
            if seq != expected or worker in self._resync:
                self._counts["batches_refused"] += 1
                if worker not in self._resync:
                    self._counts["gaps_detected"] += 1
                    self._resync.add(worker)
                    self._last_seq.setdefault(worker, None)
                    self._store.add_worker(worker)
                return False
        self._last_seq[worker] = seq
        self._resync.discard(worker)
        self._store.add_worker(worker)
        for event in batch.events:
            self._apply_event(worker, event)
        self._counts["batches_applied"] += 1
        return True

    def _apply_event(self, worker: str, event: Event) -> None:
        store = self._store
        match event:
            case PagesStored(hashes):
                self._counts["pages_dropped"] += store.add_pages(worker, hashes)
            case PagesRemoved(hashes):
                store.remove_pages(worker, hashes)
            case StateStored(page_hash):
                store.add_state(worker, page_hash)
            case StateRemoved(page_hash):
                store.remove_state(worker, page_hash)
            case AllCleared():
                store.clear(worker)
            case _:
                raise TypeError(f"expected an Event, got {type(event).__name__}")

    def workers_needing_resync(self) -> set[str]:
        return set(self._resync)

    def score(self, page_hashes: Sequence[bytes]) -> dict[str, WorkerScore]:
        """Every known worker's hit for this prompt (units: pages); 0/0 for untrusted ones."""
        return self._store.score(page_hashes, self._store.mask(self._last_seq.keys() - self._resync))

    def drop_worker(self, worker_id: str) -> None:
        self._store.forget(worker_id)
        self._last_seq.pop(worker_id, None)
        self._resync.discard(worker_id)

    def workers(self) -> set[str]:
        return set(self._last_seq)

    def contents(self, worker_id: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(page hashes, state page hashes) the index holds for the worker, trusted or not.
        KeyError for a worker it does not know."""
        if worker_id not in self._last_seq:
            raise KeyError(worker_id)
        return self._store.contents(worker_id)

    def stats(self) -> dict:
        pages, states = self._store.counts()
        return dict(workers=len(self._last_seq), workers_needing_resync=len(self._resync),
                    pages=pages, states=states, max_pages=self._store.max_pages,
                    approx_bytes=self._store.approx_bytes(), **self._counts)
