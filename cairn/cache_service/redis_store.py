"""The Redis backend of the cache index: what every worker holds, their seq numbers, trust and
counters all live in Redis, so an index rebuilt on the same namespace (a restarted actor)
resumes exactly, and any number of readers score against one copy.

Layout, every key under the namespace prefix `{ns}:` (one namespace per cluster):
- `workers`          hash  worker id -> msgpack [bit, last seq or nil, needs resync]
- `pages`            hash  page hash -> msgpack [mask of workers holding the page,
                                                 mask of workers holding a state there,
                                                 the part of each in host memory]; the two
                                                 host masks are left out while both are 0
- `w:{worker}:pages`, `w:{worker}:states`   sets of the worker's page / state hashes (every
                                            medium)
- `w:{worker}:host_pages`, `w:{worker}:host_states`   the part of those sets in host memory
- `counts`           hash  entries ((worker, page) pairs) and the index counters
- `epoch`            int   the fencing token of the one writer
A mask packs as a msgpack int, or as little-endian bytes past 64 workers.

Rules it keeps:
- One writer per namespace. A writing store takes the next `epoch` when it is made; every write
  WATCHes `epoch` and fails with `StoreSuperseded` once a newer writer exists, so a zombie
  actor cannot corrupt what its replacement owns. Readers (writer=False) never write.
- A namespace whose `epoch` is gone lost everything with it (a Redis restarted empty, a flush):
  the writer claims it again with its own epoch (`reclaim_if_lost`, counted in `losses`) and
  writes on; the index then asks the workers it no longer knows to resync.
- A write is one MULTI/EXEC: a reader sees a batch entirely or not at all, and a writer that dies
  mid-batch leaves nothing half-applied (the sender retries; redelivery is harmless).
- The event semantics are `MemoryStore`'s: a write loads a slice (the keys the batch touches)
  into a scratch `MemoryStore`, replays the batch there, and writes back what changed.
- `score` reads with one round trip per chunk of `chunk_pages` hashes (one for most prompts),
  each chunk a consistent snapshot, and stops fetching once no trusted worker still matches.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence

import msgpack
import redis

from cairn.cache_service.events import AllCleared, Event, PagesRemoved, PagesStored, StateRemoved, StateStored
from cairn.cache_service.index import COUNTERS, MemoryStore, WorkerStatus
from cairn.cache_service.scoring import WorkerScore, held_states, walk_scores


class StoreSuperseded(RuntimeError):
    """A newer writer took over this namespace; this store must stop writing (its owner exits)."""


def _pack_mask(mask: int) -> int | bytes:
    return mask if mask < 1 << 64 else mask.to_bytes((mask.bit_length() + 7) // 8, "little")


def _unpack_mask(value: int | bytes) -> int:
    return value if isinstance(value, int) else int.from_bytes(value, "little")


def _pack(*fields: object) -> bytes:
    return msgpack.packb(list(fields), use_bin_type=True)


Masks = tuple[int, int, int, int]  # page, state, host page, host state: one hash's `pages` value


def _pack_masks(masks: Masks) -> bytes:
    return _pack(*map(_pack_mask, masks if masks[2] or masks[3] else masks[:2]))


def _unpack_masks(raw: bytes | None) -> Masks:
    """A `pages` value's masks; None (no entry) is all 0, and two masks (the host part left out,
    or written before the host tier) are all on the device."""
    if raw is None:
        return 0, 0, 0, 0
    return (*map(_unpack_mask, msgpack.unpackb(raw)), 0, 0)[:4]  # type: ignore[return-value]


def _masks_of(store: MemoryStore, h: bytes) -> Masks:
    return store.pages.get(h, 0), store.states.get(h, 0), store.host_pages.get(h, 0), store.host_states.get(h, 0)


class RedisStore:
    def __init__(self, client: redis.Redis, namespace: str, max_pages: int = 4_000_000,
                 writer: bool = True, chunk_pages: int = 512):
        if max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {max_pages}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", namespace or ""):
            raise ValueError(f"expected a namespace of letters, digits, '_', '.', '-', got {namespace!r}")
        self.max_pages, self.namespace, self._r, self._chunk = max_pages, namespace, client, chunk_pages
        self._k_workers, self._k_pages = f"{namespace}:workers", f"{namespace}:pages"
        self._k_counts, self._k_epoch = f"{namespace}:counts", f"{namespace}:epoch"
        self._epoch = int(client.incr(self._k_epoch)) if writer else None
        self.losses = 0  # times this namespace was found gone and claimed again

    @classmethod
    def from_url(cls, url: str, namespace: str, max_pages: int = 4_000_000, writer: bool = True,
                 timeout_s: float = 5.0) -> RedisStore:
        """A store on `url` (redis://host:port/db); a hung Redis fails calls after `timeout_s`."""
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, namespace, max_pages, writer)

    def reclaim_if_lost(self) -> bool:
        """If the namespace's `epoch` is gone (its data with it), claims it again with this
        writer's epoch; True if it did. A newer writer always has a larger epoch, set after the
        loss, so a claim never takes a namespace from one."""
        if self._epoch is None or not self._r.set(self._k_epoch, self._epoch, nx=True):
            return False
        self.losses += 1
        return True

    def _held_keys(self, worker: str) -> tuple[str, str, str, str]:
        """The worker's sets: pages, states (every medium), then those of them in host memory."""
        prefix = f"{self.namespace}:w:{worker}"
        return f"{prefix}:pages", f"{prefix}:states", f"{prefix}:host_pages", f"{prefix}:host_states"

    # ---- ordering state and writes ---------------------------------------------------------
    def status(self, worker: str) -> WorkerStatus:
        raw = self._r.hget(self._k_workers, worker)
        if raw is None:
            return WorkerStatus(False, None, False)
        _, last, resync = msgpack.unpackb(raw)
        return WorkerStatus(True, last, bool(resync))

    def ignore(self, worker: str) -> None:
        self._write(worker, [], False, lambda s: s.ignore(worker))

    def refuse(self, worker: str) -> None:
        self._write(worker, [], False, lambda s: s.refuse(worker))

    def commit(self, worker: str, seq: int, events: Sequence[Event]) -> None:
        touched: list[bytes] = []
        for e in events:
            if isinstance(e, (PagesStored, PagesRemoved)):
                touched.extend(e.hashes)
            elif isinstance(e, (StateStored, StateRemoved)):
                touched.append(e.page_hash)
        full = any(isinstance(e, AllCleared) for e in events)
        self._write(worker, touched, full, lambda s: s.commit(worker, seq, events))

    def forget(self, worker: str) -> None:
        self._write(worker, [], True, lambda s: s.forget(worker))

    def _write(self, worker: str, touched: Sequence[bytes], full: bool, change: Callable[[MemoryStore], None]) -> None:
        """Loads the slice `change` needs into a scratch MemoryStore, applies it there, and writes
        the difference back in one fenced transaction. `full`: the change needs all the worker's
        sets (AllCleared, forget), not just the `touched` hashes."""
        if self._epoch is None:
            raise PermissionError(f"this RedisStore reads namespace {self.namespace!r}; it was made with writer=False")
        with self._r.pipeline(transaction=True) as tx:
            tx.watch(self._k_epoch)
            reads = self._r.pipeline(transaction=False)
            reads.get(self._k_epoch).hgetall(self._k_workers).hget(self._k_counts, "entries")
            if full:
                for key in self._held_keys(worker):
                    reads.smembers(key)
            epoch, workers, entries, *members = reads.execute()
            if epoch is None and self.reclaim_if_lost():  # the store lost everything: write into the new one
                return self._write(worker, touched, full, change)
            if int(epoch or 0) != self._epoch:
                raise StoreSuperseded(f"namespace {self.namespace!r} has a newer writer "
                                      f"(epoch {int(epoch or 0)} > {self._epoch})")
            hashes = list(dict.fromkeys([*touched, *(h for m in members for h in m)]))
            scratch, base = self._slice(worker, hashes, workers, int(entries or 0), members)
            change(scratch)
            tx.multi()
            self._write_diff(tx, worker, hashes, scratch, base)
            try:
                tx.execute()
            except redis.WatchError:
                raise StoreSuperseded(f"namespace {self.namespace!r} got a newer writer during a write") from None

    def _slice(self, worker: str, hashes: list[bytes], workers: dict, entries: int,
               members: list) -> tuple[MemoryStore, dict]:
        scratch = MemoryStore(self.max_pages)
        scratch.entries = entries
        for w, raw in workers.items():
            bit, last, resync = msgpack.unpackb(raw)
            w = w.decode()
            scratch.bits[w], scratch.last_seq[w] = bit, last
            if resync:
                scratch.resync.add(w)
        keys = self._held_keys(worker)
        if hashes:
            reads = self._r.pipeline(transaction=False)
            reads.hmget(self._k_pages, hashes)
            if not members:
                for key in keys:
                    reads.smismember(key, hashes)
            masks, *membership = reads.execute()
        else:
            masks, membership = [], [[] for _ in keys]
        held = [set(m) for m in members] if members else \
            [{h for h, isin in zip(hashes, column) if isin} for column in membership]
        tables = (scratch.pages, scratch.states, scratch.host_pages, scratch.host_states)
        for h, raw in zip(hashes, masks):
            for table, mask in zip(tables, _unpack_masks(raw)):
                if mask:
                    table[h] = mask
        if worker in scratch.bits:
            scratch.held[worker] = (set(held[0]), set(held[1]))
            scratch.on_host[worker] = (set(held[2]), set(held[3]))
        base = dict(entries=entries, worker=workers.get(worker.encode()),
                    masks={h: _masks_of(scratch, h) for h in hashes}, held=held)
        return scratch, base

    def _write_diff(self, tx, worker: str, hashes: list[bytes], scratch: MemoryStore, base: dict) -> None:
        if worker in scratch.bits:
            row = _pack(scratch.bits[worker], scratch.last_seq.get(worker), worker in scratch.resync)
            if row != base["worker"]:
                tx.hset(self._k_workers, worker, row)
        elif base["worker"] is not None:
            tx.hdel(self._k_workers, worker)
        changed, gone = {}, []
        for h in hashes:
            new = _masks_of(scratch, h)
            if new != base["masks"][h]:
                if new[0]:
                    changed[h] = _pack_masks(new)
                else:
                    gone.append(h)
        if changed:
            tx.hset(self._k_pages, mapping=changed)
        if gone:
            tx.hdel(self._k_pages, *gone)
        new_held = (*scratch.held.get(worker, (set(), set())), *scratch.on_host.get(worker, (set(), set())))
        for key, old, new in zip(self._held_keys(worker), base["held"], new_held):
            if worker not in scratch.bits:
                tx.delete(key)
                continue
            if new - old:
                tx.sadd(key, *(new - old))
            if old - new:
                tx.srem(key, *(old - new))
        deltas = dict(scratch.counts, entries=scratch.entries - base["entries"])
        for name, delta in deltas.items():
            if delta:
                tx.hincrby(self._k_counts, name, delta)

    # ---- reading -----------------------------------------------------------------------------
    def score(self, page_hashes: Sequence[bytes]) -> dict[str, WorkerScore]:
        first = list(page_hashes[:self._chunk])
        with self._r.pipeline(transaction=True) as reads:
            reads.hgetall(self._k_workers)
            if first:
                reads.hmget(self._k_pages, first)
            workers, *masks = reads.execute()
        bits, trusted = self._bits(workers)
        return walk_scores(self._masks(page_hashes, masks[0] if masks else []), trusted, bits)

    def states_at(self, keys: Sequence[bytes]) -> dict[str, list[tuple[int, bool]]]:
        with self._r.pipeline(transaction=True) as reads:
            reads.hgetall(self._k_workers)
            reads.hmget(self._k_pages, list(keys))
            workers, raw = reads.execute()
        bits, trusted = self._bits(workers)
        return held_states(map(_unpack_masks, raw), trusted, bits)

    @staticmethod
    def _bits(workers: dict) -> tuple[dict[str, int], int]:
        """(worker -> bit, the mask of trusted workers) from the `workers` hash."""
        bits, trusted = {}, 0
        for w, raw in workers.items():
            bit, _, resync = msgpack.unpackb(raw)
            bits[w.decode()] = bit
            if not resync:
                trusted |= 1 << bit
        return bits, trusted

    def _masks(self, page_hashes: Sequence[bytes], first: list) -> Iterator[Masks]:
        chunk = first
        for start in range(0, len(page_hashes), self._chunk):
            if start:
                chunk = self._r.hmget(self._k_pages, list(page_hashes[start:start + self._chunk]))
            for raw in chunk:
                yield _unpack_masks(raw)

    def workers(self) -> set[str]:
        return {w.decode() for w in self._r.hkeys(self._k_workers)}

    def needing_resync(self) -> set[str]:
        return {w.decode() for w, raw in self._r.hgetall(self._k_workers).items() if msgpack.unpackb(raw)[2]}

    def contents(self, worker: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        return self._sets(worker, *self._held_keys(worker)[:2])

    def host_contents(self, worker: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        return self._sets(worker, *self._held_keys(worker)[2:])

    def _sets(self, worker: str, k_pages: str, k_states: str) -> tuple[frozenset[bytes], frozenset[bytes]]:
        known, pages, states = self._r.pipeline(transaction=True).hexists(self._k_workers, worker) \
            .smembers(k_pages).smembers(k_states).execute()
        if not known:
            raise KeyError(worker)
        return frozenset(pages), frozenset(states)

    def stats(self) -> dict:
        workers = [w.decode() for w in self._r.hkeys(self._k_workers)]
        keys = [self._k_workers, self._k_pages, self._k_counts, *(k for w in workers for k in self._held_keys(w))]
        reads = self._r.pipeline(transaction=True)
        reads.hgetall(self._k_counts)
        for w in workers:
            reads.scard(self._held_keys(w)[1])
        reads.hgetall(self._k_workers)
        counts, *rest = reads.execute()
        states, rows = rest[:len(workers)], rest[len(workers)]
        sizes = self._r.pipeline(transaction=False)
        for k in keys:
            sizes.memory_usage(k)
        counts = {k.decode(): int(v) for k, v in counts.items()}
        return dict(workers=len(workers),
                    workers_needing_resync=sum(1 for raw in rows.values() if msgpack.unpackb(raw)[2]),
                    pages=counts.get("entries", 0), states=sum(states), max_pages=self.max_pages,
                    approx_bytes=sum(s or 0 for s in sizes.execute()),
                    **{name: counts.get(name, 0) for name in COUNTERS})

    def wipe(self) -> int:
        """Deletes everything this namespace holds but its writer epoch (an operator's reset);
        returns how many keys went."""
        keys = [k for k in self._r.scan_iter(match=f"{self.namespace}:*", count=1000) if k != self._k_epoch.encode()]
        return self._r.delete(*keys) if keys else 0
