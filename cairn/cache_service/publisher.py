"""A replica's outgoing side of the cache index: `EventPublisher`. Plain asyncio, no Ray.

`publish(batch)` queues and returns at once, never blocking the engine loop; one background task
sends. Its rules:
- Everything queued is coalesced into one outgoing batch (events in order; a snapshot drops
  whatever came before it), restamped by the publisher's own `EventStream`: several engine
  batches cost one actor call.
- A sent batch is retried, byte for byte, until the index answers (redelivery is harmless to
  the index); each attempt is awaited with a timeout, with backoff between attempts.
- The stream opens with a snapshot, and the index's answer (`ApplyResult.resync`) or an
  idle-time poll can ask for another: the publisher then calls the `snapshot` callback, and
  drops queued engine batches the snapshot supersedes (engine seq below the snapshot's; the
  callback must stamp its snapshot with the same stream as the published batches, as
  `Engine.snapshot_events` does).
- Past `max_queued` batches it drops the queue and resyncs instead of growing without bound.
It reaches the index through an `IndexClient`: in the cluster, an
`cairn.cluster.routing.index_handle.IndexHandle` over the index actor (`cairn.cache_service.actor`), which
finds the actor again if it dies.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

from cairn.cache_service.events import EventBatch, EventStream

logger = logging.getLogger(__name__)


class ApplyResult(NamedTuple):
    """The index's answer to a batch (`CacheIndexActor.apply`)."""
    applied: bool  # the batch changed the index
    resync: bool   # the sender must send a snapshot


class IndexClient(Protocol):
    async def call(self, method: str, *args: Any) -> Any:
        """Awaits the index actor's `method(*args)`: `apply(bytes) -> ApplyResult`,
        `needs_resync(worker_id) -> bool`, `drop_worker(worker_id)`."""
        ...


class EventPublisher:
    def __init__(self, worker_id: str, index: IndexClient,
                 snapshot: Callable[[], EventBatch | Awaitable[EventBatch]], *,
                 timeout_s: float = 2.0, max_queued: int = 1024, poll_interval_s: float = 5.0,
                 backoff_s: tuple[float, float] = (0.05, 2.0)):
        """`index`: how the index is reached (`IndexClient`); `snapshot`: makes this worker's
        snapshot batch (sync or async)."""
        self.worker_id, self._index, self._snapshot = worker_id, index, snapshot
        self._timeout_s, self._max_queued = timeout_s, max_queued
        self._poll_s, self._backoff = poll_interval_s, backoff_s
        self._out = EventStream(worker_id)
        self._queue: list[EventBatch] = []
        self._need_snapshot = True  # a publisher's stream opens with a snapshot
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self.stats = dict(published=0, sent=0, coalesced=0, send_failures=0, snapshots=0, overflows=0)

    def publish(self, batch: EventBatch | None) -> None:
        """Queues an engine batch (None: nothing to send) and returns at once. Call it from the
        event loop's thread; the first call starts the sender task on that loop."""
        if batch is None or self._closed:
            return
        self._start()
        self.stats["published"] += 1
        if len(self._queue) >= self._max_queued:
            self._queue.clear()
            self._need_snapshot = True
            self.stats["overflows"] += 1
        self._queue.append(batch)
        self._idle.clear()
        self._wake.set()

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until everything published so far was delivered; False on timeout."""
        if self._task is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def close(self, timeout_s: float = 2.0, drop_worker: bool = False) -> None:
        """Delivers what is queued (up to timeout_s), stops the sender; `drop_worker` also tells
        the index to forget this worker (a replica shutting down for good)."""
        await self.flush(timeout_s)
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if drop_worker:
            try:
                await asyncio.wait_for(self._index.call("drop_worker", self.worker_id), timeout_s)
            except Exception as e:  # the index may be gone too; nothing left to do
                logger.warning("could not drop worker %s from the index: %s", self.worker_id, e)

    def _start(self) -> None:
        if self._task is None:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                if not self._queue and not self._need_snapshot:
                    self._idle.set()
                    await self._wait_or_poll()
                    continue
                if self._need_snapshot and not any(b.is_snapshot for b in self._queue):
                    overflows = self.stats["overflows"]
                    snap = self._snapshot()
                    snap = await snap if inspect.isawaitable(snap) else snap
                    if self.stats["overflows"] != overflows:
                        continue  # the queue was dropped meanwhile, perhaps with batches newer than snap
                    self._queue = [snap, *(b for b in self._queue if b.seq > snap.seq)]
                    self.stats["snapshots"] += 1
                await self._send(self._coalesce())
                attempt = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failing snapshot callback: try again later
                logger.warning("event publisher for %s: %s", self.worker_id, e)
                await asyncio.sleep(self._delay(attempt))
                attempt += 1

    async def _wait_or_poll(self) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), self._poll_s)
            return
        except asyncio.TimeoutError:
            pass
        try:
            if await asyncio.wait_for(self._index.call("needs_resync", self.worker_id), self._timeout_s):
                self._need_snapshot = True
        except Exception as e:  # index down: the next send finds out and retries
            logger.debug("resync poll failed: %s", e)

    def _coalesce(self) -> EventBatch:
        queued, self._queue = self._queue, []
        start = max((i for i, b in enumerate(queued) if b.is_snapshot), default=0)
        events = [e for b in queued[start:] for e in b.events]
        self.stats["coalesced"] += len(queued) - 1
        if queued[start].is_snapshot:
            self._need_snapshot = False
        return self._out.batch(events)

    async def _send(self, batch: EventBatch) -> None:
        data, attempt = batch.encode(), 0
        while not self._closed:
            try:
                result = await asyncio.wait_for(self._index.call("apply", data), self._timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # timeout, actor restarting or dead: same bytes, later
                self.stats["send_failures"] += 1
                logger.debug("sending events of %s failed (%s); retrying", self.worker_id, e)
                if self._need_snapshot:
                    return  # a snapshot is due (overflow, resync): it supersedes this batch
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
                continue
            self.stats["sent"] += 1
            if ApplyResult(*result).resync:
                self._need_snapshot = True
            return

    def _delay(self, attempt: int) -> float:
        first, most = self._backoff
        return min(most, first * 2 ** min(attempt, 30))
