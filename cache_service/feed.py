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
Reading gives the same scores as the actor's index, as of the last chunk.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from cache_service.events import AllCleared, EventBatch, PagesStored, StateStored
from cache_service.index import CacheIndex, WorkerScore

# kinds of feed items: (BATCH, an encoded EventBatch the index applied), (DROP, worker id: the index
# forgot it), (RESET, worker id: the index stopped trusting it after a gap; it scores 0/0 until its
# snapshot, which follows in the feed as a BATCH)
BATCH, DROP, RESET = "batch", "drop", "reset"


class FeedChunk(NamedTuple):
    epoch: str
    cursor: int                     # where the next read starts
    items: list[tuple[str, object]]
    snapshot: bool                  # items are a whole picture: the reader starts over from them


class ChangeFeed:
    def __init__(self, max_bytes: int = 64 << 20):
        self.epoch = secrets.token_hex(8)
        self.max_bytes = max_bytes
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
        if index.apply(batch):
            self._push(BATCH, data, len(data))
            return True
        if trusted and index.needs_resync(batch.worker_id):
            self._push(RESET, batch.worker_id, len(batch.worker_id))
        return False

    def read(self, index: CacheIndex, epoch: str | None, cursor: int, max_items: int = 4096) -> FeedChunk:
        """What follows `cursor` (at most `max_items`), or a snapshot of `index` if the reader's
        epoch or cursor is not this feed's."""
        if epoch != self.epoch or not self._first <= cursor <= self.cursor:
            return FeedChunk(self.epoch, self.cursor, snapshot_items(index), True)
        start = cursor - self._first
        items = [(kind, payload) for kind, payload, _ in list(self._items)[start:start + max_items]]
        return FeedChunk(self.epoch, cursor + len(items), items, False)

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
    """One snapshot batch per worker the index has applied a batch from: its contents if trusted,
    empty if it awaits a resync; stamped with its last seq."""
    items: list[tuple[str, object]] = []
    untrusted = index.workers_needing_resync()
    for worker in sorted(index.workers()):
        last = index.last_seq(worker)
        if last is None:
            continue  # nothing applied yet: its first batch (seq 0 or a snapshot) comes through the feed
        events: list = [AllCleared()]
        if worker not in untrusted:
            pages, states = index.contents(worker)
            if pages:
                events.append(PagesStored(tuple(pages), None))  # a hash names its prefix: order is free
            events.extend(StateStored(h) for h in states)
        items.append((BATCH, EventBatch(worker, last, time.time(), tuple(events)).encode()))
    return items


class IndexMirror:
    """A reader's copy of the index, fed by `ChangeFeed.read` chunks."""

    def __init__(self, max_pages: int = 4_000_000, clock: Callable[[], float] = time.monotonic):
        self.max_pages, self._clock = max_pages, clock
        self.index = CacheIndex(max_pages)
        self.epoch: str | None = None
        self.cursor = 0
        self.heard_at = float("-inf")
        self.snapshots = 0

    def fresh(self, max_age_s: float) -> bool:
        return self.epoch is not None and self._clock() - self.heard_at <= max_age_s

    async def apply(self, chunk: FeedChunk, yield_every: int = 256) -> None:
        """Applies a chunk (a snapshot into a new index, swapped in when complete), yielding the
        event loop every `yield_every` items so scoring goes on meanwhile."""
        index = CacheIndex(self.max_pages) if chunk.snapshot else self.index
        for i, (kind, payload) in enumerate(chunk.items):
            if kind == BATCH:
                index.apply(payload)
            elif kind == DROP:
                index.drop_worker(payload)
            elif kind == RESET and payload in index.workers():  # holds nothing until its snapshot
                index.apply(EventBatch(payload, index.last_seq(payload) or 0, time.time(), (AllCleared(),)))
            if yield_every and i % yield_every == yield_every - 1:
                await asyncio.sleep(0)
        self.index, self.cursor, self.heard_at = index, chunk.cursor, self._clock()
        self.snapshots += chunk.snapshot
        # a gap here means this mirror missed a batch the index applied: start over from a snapshot
        self.epoch = None if index.workers_needing_resync() else chunk.epoch

    def score(self, page_hashes: Sequence[bytes]) -> dict[str, WorkerScore]:
        return self.index.score(page_hashes)

    def gauges(self) -> dict[str, float]:
        """What the mirror costs and how current it is: index_mirror_pages, _states, _bytes
        (approximate), _snapshots (taken so far), _age_seconds (since the feed last answered)."""
        stats = self.index.stats()
        age = self._clock() - self.heard_at
        return dict(index_mirror_pages=stats["pages"], index_mirror_states=stats["states"],
                    index_mirror_bytes=stats["approx_bytes"], index_mirror_snapshots=self.snapshots,
                    index_mirror_age_seconds=age if age != float("inf") else -1.0)
