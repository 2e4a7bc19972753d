"""The index's change feed, and a reader's local mirror of the index built from it.

A router that asked the index actor per request would pay a network round trip (and the actor's
queue) on every routing decision. Instead each router keeps a mirror: a `CacheIndex` of its own,
fed from the actor's `ChangeFeed` by a background long-poll, and scores prompts locally.

Writer side (`ChangeFeed`, kept by the index actor, which applies batches through
`ChangeFeed.apply`): every batch the index applied, as the same encoded bytes, every worker the
index dropped, and every worker it stopped trusting (a gap), numbered by a cursor. The feed is bounded
(`max_bytes`); a reader whose cursor fell off its start, or that comes from another incarnation
of the actor (`epoch`, random per feed), gets a snapshot instead: one self-contained batch per
worker the index knows, stamped with that worker's last seq, so the batches that follow in the
feed apply on top of it exactly as they did in the index. A worker the index no longer trusts
(it lost events) is sent as empty: it scores 0/0 there too, and its next applied batch is the
snapshot that restores it. A snapshot and the cursor it ends at are read in one synchronous
step, so nothing falls between them.

Reader side (`IndexMirror`): applies chunks in order (a snapshot replaces its whole index),
remembers the epoch and cursor to ask from next, and when it was last heard from (`fresh`). If
its own index ever detects a gap (it missed something), it asks for a snapshot on the next read.
It bounds its pages as the index does (the bound travels in every chunk) and keeps an untrusted
worker's contents as the index does, so both keep and drop the same pages. Reading gives the
same scores as the actor's index, as of the last chunk. A batch the index may or may not have
applied (its store failed mid-write) starts a new epoch: every reader takes a snapshot.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from cairn.cache_service.events import HOST, AllCleared, EventBatch, PagesStored, StateStored
from cairn.cache_service.index import CacheIndex
from cairn.cache_service.scoring import WorkerScore

# kinds of feed items: (BATCH, an encoded EventBatch the index applied), (DROP, worker id: the index
# forgot it), (RESET, worker id: the index stopped trusting it after a gap; it scores 0/0 until its
# snapshot, which follows in the feed as a BATCH)
BATCH, DROP, RESET = "batch", "drop", "reset"


class FeedChunk(NamedTuple):
    epoch: str
    cursor: int                     # where the next read starts
    items: list[tuple[str, object]]
    snapshot: bool                  # items are a whole picture: the reader starts over from them
    max_pages: int                  # the index's bound, which the mirror must apply the same way


class ChangeFeed:
    def __init__(self, max_pages: int, max_bytes: int = 64 << 20):
        self.epoch = secrets.token_hex(8)
        self.max_pages, self.max_bytes = max_pages, max_bytes
        self._items: deque[tuple[str, object, int]] = deque()  # (kind, payload, bytes)
        self._first = 0   # cursor of _items[0]
        self._bytes = 0
        self._changed = asyncio.Event()  # set on every push; bound to no loop until awaited

    @property
    def cursor(self) -> int:
        """The cursor the next item will get."""
        return self._first + len(self._items)

    def worker_dropped(self, worker_id: str) -> None:
        self._push(DROP, worker_id, len(worker_id))

    def apply(self, index: CacheIndex, batch: EventBatch, data: bytes) -> bool:
        """Applies the batch (`data`: its encoding) to `index` and records what that did: the batch
        if applied, a RESET if it made the index stop trusting its worker. True iff applied."""
        trusted = not index.needs_resync(batch.worker_id)
        try:
            applied = index.apply(batch)
        except BaseException:
            # it may have been applied (a store that committed, then failed to say so): its retry
            # would be ignored as a redelivery and never reach the feed, so every reader starts over
            self.epoch = secrets.token_hex(8)
            raise
        if applied:
            self._push(BATCH, data, len(data))
            return True
        if trusted and index.needs_resync(batch.worker_id):
            self._push(RESET, batch.worker_id, len(batch.worker_id))
        return False

    def read(self, index: CacheIndex, epoch: str | None, cursor: int, max_items: int = 4096) -> FeedChunk:
        """What follows `cursor` (at most `max_items`), or a snapshot of `index` if the reader's
        epoch or cursor is not this feed's."""
        if epoch != self.epoch or not self._first <= cursor <= self.cursor:
            return FeedChunk(self.epoch, self.cursor, snapshot_items(index), True, self.max_pages)
        start, n = cursor - self._first, len(self._items)
        if start >= n // 2:  # near the newest end (a reader keeping up): walk in from the right
            picked = list(itertools.islice(reversed(self._items), 0, n - start))[::-1][:max_items]
        else:
            picked = list(itertools.islice(self._items, start, start + max_items))
        items = [(kind, payload) for kind, payload, _ in picked]
        return FeedChunk(self.epoch, cursor + len(items), items, False, self.max_pages)

    async def wait(self, cursor: int, timeout_s: float) -> None:
        """Returns once there is something past `cursor`, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while cursor >= self.cursor and (left := deadline - time.monotonic()) > 0:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return

    def _push(self, kind: str, payload: object, size: int) -> None:
        self._items.append((kind, payload, size))
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._items) > 1:
            self._bytes -= self._items.popleft()[2]
            self._first += 1
        self._changed.set()


def snapshot_items(index: CacheIndex) -> list[tuple[str, object]]:
    """One snapshot batch per worker the index has applied a batch from, with its contents, each
    page and state in its medium, stamped with its last seq; a RESET after it if the index awaits
    its resync (untrusted, its contents kept)."""
    items: list[tuple[str, object]] = []
    untrusted = index.workers_needing_resync()
    for worker in sorted(index.workers()):
        last = index.last_seq(worker)
        if last is None:
            continue  # nothing applied yet: its first batch (seq 0 or a snapshot) comes through the feed
        events: list = [AllCleared()]
        pages, states = index.contents(worker)
        host_pages, host_states = index.host_contents(worker)
        if pages - host_pages:  # a hash names its prefix: order is free
            events.append(PagesStored(tuple(pages - host_pages), None))
        if host_pages:
            events.append(PagesStored(tuple(host_pages), None, HOST))
        events.extend(StateStored(h) for h in states - host_states)
        events.extend(StateStored(h, HOST) for h in host_states)
        items.append((BATCH, EventBatch(worker, last, time.time(), tuple(events)).encode()))
        if worker in untrusted:
            items.append((RESET, worker))
    return items


class IndexMirror:
    """A reader's copy of the index, fed by `ChangeFeed.read` chunks. Its page bound is the
    index's (from the chunks), so both keep and drop the same pages."""

    def __init__(self, max_pages: int = 4_000_000, clock: Callable[[], float] = time.monotonic):
        self.max_pages, self._clock = max_pages, clock
        self.index = CacheIndex(max_pages)
        self.epoch: str | None = None
        self.cursor = 0
        self.heard_at = float("-inf")
        self.snapshots = 0
        self._distrusted: set[str] = set()  # untrusted in the index too (RESET), until their snapshot
        self._gauges: dict[str, float] = {}

    def fresh(self, max_age_s: float) -> bool:
        return self.epoch is not None and self._clock() - self.heard_at <= max_age_s

    async def apply(self, chunk: FeedChunk, yield_every: int = 256) -> None:
        """Applies a chunk, yielding the event loop every `yield_every` items so scoring goes on
        meanwhile. A snapshot builds a new index in a worker thread (nothing reads it until it is
        complete and swapped in), so even a huge one leaves the loop free."""
        if chunk.snapshot:
            index, distrusted = CacheIndex(chunk.max_pages), set()
            await asyncio.to_thread(self._apply_items, index, distrusted, chunk.items)
        else:
            index, distrusted = self.index, self._distrusted
            step = yield_every or max(len(chunk.items), 1)
            for start in range(0, len(chunk.items), step):
                if start:
                    await asyncio.sleep(0)
                self._apply_items(index, distrusted, chunk.items[start:start + step])
        self.index, self._distrusted, self.cursor, self.heard_at = index, distrusted, chunk.cursor, self._clock()
        self.max_pages = chunk.max_pages
        self.snapshots += chunk.snapshot
        # an untrusted worker the index does trust means this mirror missed a batch: start over
        self.epoch = None if index.workers_needing_resync() - distrusted else chunk.epoch
        stats = index.stats()  # here, on the reader's loop: gauges() may be read from another thread
        self._gauges = dict(index_mirror_pages=stats["pages"], index_mirror_states=stats["states"],
                            index_mirror_bytes=stats["approx_bytes"], index_mirror_snapshots=self.snapshots,
                            index_mirror_workers=stats["workers"])

    @staticmethod
    def _apply_items(index: CacheIndex, distrusted: set[str], items: Sequence[tuple[str, object]]) -> None:
        for kind, payload in items:
            if kind == BATCH:
                batch = EventBatch.decode(payload)
                if index.apply(batch) and batch.is_snapshot:
                    distrusted.discard(batch.worker_id)
            elif kind == DROP:
                index.drop_worker(payload)
                distrusted.discard(payload)
            elif kind == RESET:
                index.distrust(payload)
                distrusted.add(payload)

    def score(self, page_hashes: Sequence[bytes]) -> dict[str, WorkerScore]:
        return self.index.score(page_hashes)

    def states_at(self, keys: Sequence[bytes]) -> dict[str, list[tuple[int, bool]]]:
        return self.index.states_at(keys)

    def known_workers(self) -> int:
        """Workers the mirror knows, as of its last chunk (counted there, off the request path)."""
        return int(self._gauges.get("index_mirror_workers", 0))

    def summary(self) -> dict:
        """Where this mirror stands, to compare it with other mirrors and with the index: the
        feed's `epoch` it follows (None before its first chunk or while it waits for a snapshot),
        its `cursor`, the `workers` it knows (sorted), its `pages` ((worker, page) entries), the
        `digest` of its index (`CacheIndex.digest`) and `age_s` since the feed last answered
        (None before it ever did). Reads every entry, on the caller's thread: call it where the
        mirror is applied (its router's loop), off the request path; a chunk being applied there
        in slices shows partly applied, under the cursor it started from."""
        age = self._clock() - self.heard_at
        return dict(epoch=self.epoch, cursor=self.cursor, workers=sorted(self.index.workers()),
                    pages=self.index.stats()["pages"], digest=self.index.digest(),
                    age_s=None if age == float("inf") else round(age, 3))

    def gauges(self) -> dict[str, float]:
        """What the mirror costs and how current it is, as of its last chunk: index_mirror_pages,
        _states, _bytes (approximate), _workers, _snapshots (taken so far), and _age_seconds
        (since the feed last answered; -1 before it ever did). Safe from any thread."""
        age = self._clock() - self.heard_at
        return {**self._gauges, "index_mirror_age_seconds": age if age != float("inf") else -1.0}
