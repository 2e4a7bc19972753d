"""The cluster-wide index of what every worker holds, and how deep a prompt would hit on each.

Workers report every change as `EventBatch`es (cairn.cache_service.events); `CacheIndex.apply` replays
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
whole prefix. Media: each page and state is in one medium (`contents` lists every medium,
`host_contents` the host's part); storing one that is resident in the other medium moves it,
and a move is not a new entry.

Bounded memory: at most `max_pages` (worker, page) entries in all. Past it, further pages a
worker stores are dropped (counted as `pages_dropped` in `stats()`); the index then under-reports
hits for them, which costs a cache miss, never a wrong hit.

Storage is a backend (`IndexStore`): everything the index knows — contents, last seq numbers,
trust, counters — lives in it, so an index rebuilt on the same backend resumes exactly.
`MemoryStore` (the default) keeps it in this process; `cairn.cache_service.redis_store.RedisStore`
keeps it in Redis, where it outlives the actor and several readers share it. The event
semantics are written once, here: the Redis backend replays a batch on a `MemoryStore` slice of
the keys it touches and writes back the difference. Scoring walks the prompt's hashes once over
hash -> worker-bitmask maps and stops as soon as no trusted worker still matches.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from dataclasses import dataclass
from typing import Protocol

import msgpack

from cairn.cache_service.events import (HOST, AllCleared, Event, EventBatch, PagesRemoved, PagesStored,
                                  StateRemoved, StateStored)
from cairn.cache_service.scoring import WorkerScore, held_states, walk_scores

COUNTERS = ("batches_applied", "batches_ignored", "batches_refused", "gaps_detected", "pages_dropped")


@dataclass(frozen=True)
class WorkerStatus:
    known: bool
    last_seq: int | None  # None: no batch applied yet (or unknown)
    needs_resync: bool


class IndexStore(Protocol):
    """A backend: holds contents, seq numbers, trust and counters; CacheIndex decides ordering."""
    max_pages: int

    def status(self, worker: str) -> WorkerStatus: ...
    def ignore(self, worker: str) -> None: ...
    def refuse(self, worker: str) -> None: ...
    def commit(self, worker: str, seq: int, events: Sequence[Event]) -> None: ...
    def forget(self, worker: str) -> None: ...
    def score(self, page_hashes: Sequence[bytes]) -> dict[str, WorkerScore]: ...
    def states_at(self, keys: Sequence[bytes]) -> dict[str, list[tuple[int, bool]]]: ...
    def workers(self) -> set[str]: ...
    def needing_resync(self) -> set[str]: ...
    def contents(self, worker: str) -> tuple[frozenset[bytes], frozenset[bytes]]: ...
    def host_contents(self, worker: str) -> tuple[frozenset[bytes], frozenset[bytes]]: ...
    def stats(self) -> dict: ...


class MemoryStore:
    """The in-process backend: hash -> bitmask of workers (and of those holding it in host
    memory), plus each worker's own sets (for clearing, removal and `contents`), seq numbers,
    the untrusted set and the counters."""

    def __init__(self, max_pages: int):
        if max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {max_pages}")
        self.max_pages = max_pages
        self.entries = 0  # (worker, page) pairs, the quantity max_pages bounds
        self.bits: dict[str, int] = {}
        self.pages: dict[bytes, int] = {}   # hash -> mask of workers holding the page (either medium)
        self.states: dict[bytes, int] = {}  # hash -> mask of workers holding a state there (either medium)
        self.host_pages: dict[bytes, int] = {}   # hash -> the part of its pages mask in host memory
        self.host_states: dict[bytes, int] = {}  # hash -> the part of its states mask in host memory
        self.held: dict[str, tuple[set[bytes], set[bytes]]] = {}  # worker -> (pages, states), every medium
        self.on_host: dict[str, tuple[set[bytes], set[bytes]]] = {}  # worker -> the part of held on host
        self.last_seq: dict[str, int | None] = {}  # None: known, but no batch applied yet
        self.resync: set[str] = set()
        self.counts = dict.fromkeys(COUNTERS, 0)

    # ---- ordering state ----------------------------------------------------------------------
    def status(self, worker: str) -> WorkerStatus:
        return WorkerStatus(worker in self.last_seq, self.last_seq.get(worker), worker in self.resync)

    def ignore(self, worker: str) -> None:
        self.counts["batches_ignored"] += 1

    def refuse(self, worker: str) -> None:
        self.counts["batches_refused"] += 1
        if worker not in self.resync:
            self.counts["gaps_detected"] += 1
            self.resync.add(worker)
            self.last_seq.setdefault(worker, None)
            self._add_worker(worker)

    def commit(self, worker: str, seq: int, events: Sequence[Event]) -> None:
        self.last_seq[worker] = seq
        self.resync.discard(worker)
        self._add_worker(worker)
        for event in events:
            self._apply_event(worker, event)
        self.counts["batches_applied"] += 1

    def forget(self, worker: str) -> None:
        if worker in self.bits:
            self._clear(worker)
            del self.bits[worker], self.held[worker], self.on_host[worker]
        self.last_seq.pop(worker, None)
        self.resync.discard(worker)

    # ---- contents ----------------------------------------------------------------------------
    def _add_worker(self, worker: str) -> None:
        if worker not in self.bits:
            taken = set(self.bits.values())
            self.bits[worker] = next(b for b in range(len(taken) + 1) if b not in taken)
            self.held[worker] = (set(), set())
            self.on_host[worker] = (set(), set())

    def _apply_event(self, worker: str, event: Event) -> None:
        match event:
            case PagesStored(hashes, _, medium):
                self.counts["pages_dropped"] += self._add_pages(worker, hashes, medium == HOST)
            case PagesRemoved(hashes):
                self._remove_pages(worker, hashes)
            case StateStored(page_hash, medium):
                self._add_state(worker, page_hash, medium == HOST)
            case StateRemoved(page_hash):
                self._remove_state(worker, page_hash)
            case AllCleared():
                self._clear(worker)
            case _:
                raise TypeError(f"expected an Event, got {type(event).__name__}")

    def _add_pages(self, worker: str, hashes: Sequence[bytes], to_host: bool) -> int:
        """Stores what fits under max_pages (in host memory if `to_host`) and moves the pages
        already held in the other medium; returns how many pages were dropped."""
        bit, pages, held, dropped = 1 << self.bits[worker], self.pages, self.held[worker][0], 0
        host = self.on_host[worker][0]
        for h in hashes:
            if h in held:
                if (h in host) != to_host:
                    self._set_medium(worker, h, host, self.host_pages, to_host)
                continue
            if self.entries >= self.max_pages:
                dropped += 1
                continue
            held.add(h)
            pages[h] = pages.get(h, 0) | bit
            self.entries += 1
            if to_host:
                self._set_medium(worker, h, host, self.host_pages, True)
        return dropped

    def _set_medium(self, worker: str, h: bytes, host: set[bytes], host_masks: dict[bytes, int],
                    to_host: bool) -> None:
        """Puts the worker's page or state `h` (held) in host memory, or back on the device."""
        if to_host:
            host.add(h)
            host_masks[h] = host_masks.get(h, 0) | 1 << self.bits[worker]
        elif h in host:
            host.remove(h)
            _unset(host_masks, h, self.bits[worker])

    def _remove_pages(self, worker: str, hashes: Iterable[bytes]) -> None:
        held, host = self.held[worker][0], self.on_host[worker][0]
        for h in hashes:
            if h in held:
                held.remove(h)
                _unset(self.pages, h, self.bits[worker])
                self._set_medium(worker, h, host, self.host_pages, False)
                self.entries -= 1
                self._remove_state(worker, h)

    def _add_state(self, worker: str, page_hash: bytes, to_host: bool) -> None:
        held, held_states = self.held[worker]
        if page_hash not in held:
            return
        host = self.on_host[worker][1]
        if page_hash not in held_states:
            held_states.add(page_hash)
            self.states[page_hash] = self.states.get(page_hash, 0) | 1 << self.bits[worker]
        elif (page_hash in host) == to_host:
            return
        self._set_medium(worker, page_hash, host, self.host_states, to_host)

    def _remove_state(self, worker: str, page_hash: bytes) -> None:
        held_states = self.held[worker][1]
        if page_hash in held_states:
            held_states.remove(page_hash)
            _unset(self.states, page_hash, self.bits[worker])
            self._set_medium(worker, page_hash, self.on_host[worker][1], self.host_states, False)

    def _clear(self, worker: str) -> None:
        bit = self.bits[worker]
        self.entries -= len(self.held[worker][0])
        for sets, tables in ((self.held[worker], (self.pages, self.states)),
                             (self.on_host[worker], (self.host_pages, self.host_states))):
            for hashes, table in zip(sets, tables):
                for h in hashes:
                    _unset(table, h, bit)
                hashes.clear()

    # ---- reading -----------------------------------------------------------------------------
    def score(self, page_hashes: Sequence[bytes]) -> dict[str, WorkerScore]:
        trusted = 0
        for w, bit in self.bits.items():
            if w not in self.resync:
                trusted |= 1 << bit

        def column(table: dict[bytes, int]) -> Iterator[int]:
            """The table's mask per prompt page: lazy, and looped in C (this is the hot path)."""
            return map(table.get, page_hashes, repeat(0))
        if not self.host_pages and not self.host_states:  # nothing on any host: skip two lookups a page
            masks = zip(column(self.pages), column(self.states), repeat(0), repeat(0))
        else:
            masks = zip(column(self.pages), column(self.states), column(self.host_pages), column(self.host_states))
        return walk_scores(masks, trusted, self.bits)

    def _trusted(self) -> int:
        return sum(1 << bit for w, bit in self.bits.items() if w not in self.resync)

    def states_at(self, keys: Sequence[bytes]) -> dict[str, list[tuple[int, bool]]]:
        g = (self.pages.get, self.states.get, self.host_pages.get, self.host_states.get)
        return held_states(([get(k, 0) for get in g] for k in keys), self._trusted(), self.bits)

    def workers(self) -> set[str]:
        return set(self.last_seq)

    def needing_resync(self) -> set[str]:
        return set(self.resync)

    def contents(self, worker: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        if worker not in self.last_seq:
            raise KeyError(worker)
        held, held_states = self.held[worker]
        return frozenset(held), frozenset(held_states)

    def host_contents(self, worker: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        if worker not in self.last_seq:
            raise KeyError(worker)
        pages, states = self.on_host[worker]
        return frozenset(pages), frozenset(states)

    def stats(self) -> dict:
        # containers plus one 16-byte bytes object (~49 B) and one mask int (~28 B) per key
        sets = sum(sys.getsizeof(a) + sys.getsizeof(b) for w in self.held for a, b in (self.held[w], self.on_host[w]))
        tables = (self.pages, self.states, self.host_pages, self.host_states)
        approx = sum(sys.getsizeof(t) + len(t) * 77 for t in tables) + sets
        return dict(workers=len(self.last_seq), workers_needing_resync=len(self.resync),
                    pages=self.entries, states=sum(len(s) for _, s in self.held.values()),
                    max_pages=self.max_pages, approx_bytes=approx, **self.counts)


def _unset(table: dict[bytes, int], h: bytes, bit: int) -> None:
    m = table[h] & ~(1 << bit)
    if m:
        table[h] = m
    else:
        del table[h]


class CacheIndex:
    """Replays workers' event batches in seq order and scores prompts against every worker.

    `store` is the backend (default: a `MemoryStore(max_pages)`). `max_pages` bounds the
    (worker, page) entries held in all; pages stored past it are dropped and counted in
    `stats()["pages_dropped"]`."""

    def __init__(self, max_pages: int = 4_000_000, store: IndexStore | None = None):
        self._store: IndexStore = store if store is not None else MemoryStore(max_pages)

    def apply(self, batch: EventBatch | bytes) -> bool:
        """Applies the batch if it is the worker's next one (or a snapshot); True iff applied.
        Bytes are decoded first; EventDecodeError propagates and nothing changes."""
        if not isinstance(batch, EventBatch):
            batch = EventBatch.decode(batch)
        worker, seq, store = batch.worker_id, batch.seq, self._store
        if not batch.is_snapshot:
            status = store.status(worker)
            last = status.last_seq
            if last is not None and seq <= last:
                store.ignore(worker)  # redelivery: already applied
                return False
            if seq != (0 if last is None else last + 1) or status.needs_resync:
                store.refuse(worker)
                return False
        store.commit(worker, seq, batch.events)
        return True

    def workers_needing_resync(self) -> set[str]:
        return self._store.needing_resync()

    def store_lost(self) -> bool:
        """True once the backend has lost its contents (a Redis restarted empty) and was claimed
        again: workers the index does not know since must resync. Checks the backend now."""
        reclaim = getattr(self._store, "reclaim_if_lost", None)
        if reclaim is not None:
            reclaim()
        return self.store_losses > 0

    @property
    def store_losses(self) -> int:
        """Times the backend lost its contents and was claimed again (0 for the in-memory one)."""
        return getattr(self._store, "losses", 0)

    def needs_resync(self, worker_id: str) -> bool:
        """The worker lost events and scores 0/0 until its next snapshot."""
        return self._store.status(worker_id).needs_resync

    def score(self, page_hashes: Sequence[bytes]) -> dict[str, WorkerScore]:
        """Every known worker's hit for this prompt (units: pages); 0/0 for untrusted ones."""
        return self._store.score(page_hashes)

    def states_at(self, keys: Sequence[bytes]) -> dict[str, list[tuple[int, bool]]]:
        """worker -> [(i, on host)]: the trusted workers holding a state at `keys[i]` named as a
        page of its own (a sub-page state: `cairn.cache_service.scoring.held_states`)."""
        return self._store.states_at(keys) if keys else {}

    def drop_worker(self, worker_id: str) -> None:
        self._store.forget(worker_id)

    def distrust(self, worker_id: str) -> None:
        """Treats the worker as having lost events (what a gap does): it scores 0/0 until its
        next snapshot; what it held stays, and counts towards max_pages, until then."""
        self._store.refuse(worker_id)

    def workers(self) -> set[str]:
        return self._store.workers()

    def last_seq(self, worker_id: str) -> int | None:
        """The seq of the worker's last applied batch; None if none was (or it is unknown)."""
        return self._store.status(worker_id).last_seq

    def contents(self, worker_id: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(page hashes, state page hashes) the index holds for the worker, trusted or not, in
        either medium. KeyError for a worker it does not know."""
        return self._store.contents(worker_id)

    def host_contents(self, worker_id: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """The part of `contents` in the worker's host memory: (page hashes, state page hashes).
        KeyError for a worker it does not know."""
        return self._store.host_contents(worker_id)

    def stats(self) -> dict:
        """workers, workers_needing_resync, pages, states, max_pages, approx_bytes, and the
        counters batches_applied/ignored/refused, gaps_detected, pages_dropped."""
        return self._store.stats()

    def digest(self) -> str:
        """A hash (hex) of everything scoring and the next batch depend on, for every worker a
        batch was applied from (the workers a feed snapshot carries): its last seq, whether it is
        trusted, its pages and states, and which of them are in host memory. Two indexes with
        the same digest score every prompt alike and take or refuse the next batch alike, on
        either backend. It reads every entry: for tests and operators comparing copies (a
        router's mirror against the actor's index), never on the request path."""
        h = hashlib.blake2b(digest_size=16)
        untrusted = self.workers_needing_resync()
        for worker in sorted(self.workers()):
            last = self.last_seq(worker)
            if last is None:  # known only as untrusted, holding nothing: scores nothing anywhere
                continue
            held, on_host = self.contents(worker), self.host_contents(worker)
            h.update(msgpack.packb([worker, last, worker in untrusted, *(sorted(s) for s in (*held, *on_host))],
                                   use_bin_type=True))
        return h.hexdigest()
