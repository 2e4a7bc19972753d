"""The cache index as a Ray actor, and the replica-side publisher that feeds it.

`index_actor(...)` gets or creates the one named, detached `CacheIndexActor` of a cluster (Ray
restarts it on failure, `max_restarts=-1`). Its async methods wrap `CacheIndex`: `apply(bytes)`,
`score(page_hashes)`, `drop_worker`, `workers`, `contents`, `workers_needing_resync`,
`needs_resync`, `stats`, and `feed(epoch, cursor, wait_s)`: the change feed routers mirror the
index from (cache_service.feed; a long poll: it answers at once if something changed since
`cursor`, else when something does or `wait_s` passes).
- Dead replicas are dropped by the index itself: a worker id that is a Serve replica id
  (`SERVE_REPLICA::app#deployment#id`, the name Serve gives the replica's actor in the `serve`
  namespace) is looked up every `liveness_interval_s`; once its actor is gone on two lookups in a
  row the worker is dropped (`stats()["workers_reaped"]`). So a killed replica leaves the index
  within about two intervals even if no router ever sends it a request (routers that do drop it
  at once, on `on_replica_actor_died`). Other worker ids (tests, other launchers) are never reaped.
- With a Redis URL the index lives in Redis: a restarted actor resumes exactly where the last
  one stopped (contents, seq numbers, trust), and fences the old one out.
- Without, a restarted actor starts empty and asks every worker it does not know to resync:
  `needs_resync(worker)` is true for them, and their next incremental batch is refused as a gap.
Only this file under cache_service imports Ray.

`EventPublisher` is a replica's outgoing side, plain asyncio: `publish(batch)` queues and returns
at once, never blocking the engine loop; one background task sends. Its rules:
- Everything queued is coalesced into one outgoing batch (events in order; a snapshot drops
  whatever came before it), restamped by the publisher's own `EventStream`: several engine
  batches cost one actor call.
- A sent batch is retried, byte for byte, until the actor answers (redelivery is harmless to
  the index); each attempt is awaited with a timeout, with backoff between attempts.
- The stream opens with a snapshot, and the actor's answer (or an idle-time poll) can ask for
  another: the publisher then calls the `snapshot` callback, and drops queued engine batches the
  snapshot supersedes (engine seq below the snapshot's; the callback must stamp its snapshot
  with the same stream as the published batches, as `Engine.snapshot_events` does).
- Past `max_queued` batches it drops the queue and resyncs instead of growing without bound.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import ray

from cache_service.events import EventBatch, EventDecodeError, EventStream
from cache_service.feed import ChangeFeed, FeedChunk
from cache_service.index import CacheIndex

logger = logging.getLogger(__name__)

DEFAULT_ACTOR_NAME = "cairn-cache-index"
DEFAULT_RAY_NAMESPACE = "cairn"
SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"  # ray.serve._private.common.REPLICA_ID_FULL_ID_STR_PREFIX
SERVE_NAMESPACE = "serve"                 # where Serve names its replica actors
LIVENESS_INTERVAL_S = 1.0


class ApplyResult(NamedTuple):
    applied: bool  # the batch changed the index
    resync: bool   # the sender must send a snapshot


@ray.remote
class CacheIndexActor:
    def __init__(self, redis_url: str | None = None, namespace: str = "cairn", max_pages: int = 4_000_000,
                 liveness_interval_s: float = LIVENESS_INTERVAL_S):
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if redis_url:
            from cache_service.redis_store import RedisStore

            self._index = CacheIndex(store=RedisStore.from_url(redis_url, namespace, max_pages))
        else:
            self._index = CacheIndex(max_pages)
        self._backend = "redis" if redis_url else "memory"
        self._resync_unknown = self._restarted and not redis_url  # what it knew died with it
        self._decode_errors = 0
        self._liveness_s, self._watcher, self._reaped = liveness_interval_s, None, 0
        self._feed = ChangeFeed(max_pages)

    def _watch(self) -> None:
        """Starts the dead-replica watcher on the actor's loop (first call of any method)."""
        if self._watcher is None and self._liveness_s > 0:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_replicas())

    async def _watch_replicas(self) -> None:
        missing: set[str] = set()
        while True:
            await asyncio.sleep(self._liveness_s)
            try:
                replicas = sorted(w for w in self._index.workers() if w.startswith(SERVE_REPLICA_PREFIX))
                gone = {w for w, alive in zip(replicas, await asyncio.to_thread(_actors_alive, replicas))
                        if alive is False}
                for worker in gone & missing:  # gone on two lookups in a row
                    logger.info("replica %s is gone: dropping it from the cache index", worker)
                    self._drop(worker)
                    self._reaped += 1
                missing = gone - missing
            except Exception as e:  # GCS or Redis hiccup: look again next time
                logger.warning("replica liveness check failed: %s", e)

    async def apply(self, data: bytes) -> ApplyResult:
        self._watch()
        try:
            batch = EventBatch.decode(data)
        except EventDecodeError as e:
            self._decode_errors += 1
            logger.warning("refused an undecodable event batch: %s", e)
            return ApplyResult(False, True)
        if self._feed.apply(self._index, batch, data):
            return ApplyResult(True, False)
        return ApplyResult(False, self._index.needs_resync(batch.worker_id))

    async def score(self, page_hashes: list[bytes]) -> dict[str, tuple[int, int]]:
        """worker -> (hit_pages, state_pages); workers absent from the answer score (0, 0)."""
        self._watch()
        return {w: (s.hit_pages, s.state_pages) for w, s in self._index.score(page_hashes).items() if s.hit_pages}

    async def drop_worker(self, worker_id: str) -> None:
        self._drop(worker_id)

    def _drop(self, worker_id: str) -> None:
        self._index.drop_worker(worker_id)
        self._feed.worker_dropped(worker_id)

    async def feed(self, epoch: str | None, cursor: int, wait_s: float = 0.0) -> FeedChunk:
        """What the index applied since `cursor` (a snapshot if the reader is new, from another
        incarnation, or too far behind); with nothing new, waits up to `wait_s` (at most 10 s)."""
        self._watch()
        if epoch == self._feed.epoch and wait_s > 0:
            await self._feed.wait(cursor, min(wait_s, 10.0))
        return self._feed.read(self._index, epoch, cursor)

    async def workers(self) -> set[str]:
        """Every worker the index knows (trusted or awaiting a resync)."""
        self._watch()
        return self._index.workers()

    async def contents(self, worker_id: str) -> tuple[frozenset[bytes], frozenset[bytes]] | None:
        """(page hashes, state page hashes) held for the worker; None if it is unknown."""
        try:
            return self._index.contents(worker_id)
        except KeyError:
            return None

    async def workers_needing_resync(self) -> set[str]:
        return self._index.workers_needing_resync()

    async def needs_resync(self, worker_id: str) -> bool:
        if self._index.needs_resync(worker_id):
            return True
        return self._resync_unknown and worker_id not in self._index.workers()

    async def stats(self) -> dict[str, Any]:
        self._watch()
        return dict(self._index.stats(), backend=self._backend, restarted=self._restarted,
                    resync_unknown_workers=self._resync_unknown, decode_errors=self._decode_errors,
                    workers_reaped=self._reaped)


def _actors_alive(names: list[str]) -> list[bool | None]:
    """Per Serve replica actor name: True if it exists, False if Ray says it does not, None if
    the lookup failed otherwise (unknown: never a reason to drop). Blocking: run off the loop."""
    out: list[bool | None] = []
    for name in names:
        try:
            ray.get_actor(name, namespace=SERVE_NAMESPACE)
            out.append(True)
        except ValueError:  # "Failed to look up actor ...": no live actor has this name
            out.append(False)
        except Exception:
            out.append(None)
    return out


def index_actor(name: str = DEFAULT_ACTOR_NAME, ray_namespace: str = DEFAULT_RAY_NAMESPACE,
                redis_url: str | None = None, namespace: str = "cairn", max_pages: int = 4_000_000,
                num_cpus: float = 0.0) -> ray.actor.ActorHandle:
    """The cluster's index actor, created on first use (blocking: call it off the event loop).
    Later callers get the existing actor whatever arguments they pass."""
    return CacheIndexActor.options(
        name=name, namespace=ray_namespace, lifetime="detached", get_if_exists=True,
        max_restarts=-1, num_cpus=num_cpus,
    ).remote(redis_url, namespace, max_pages)


async def _call(method: Any, *args: object) -> Any:
    return await method.remote(*args)


class EventPublisher:
    def __init__(self, worker_id: str, index: Any,
                 snapshot: Callable[[], EventBatch | Awaitable[EventBatch]], *,
                 timeout_s: float = 2.0, max_queued: int = 1024, poll_interval_s: float = 5.0,
                 backoff_s: tuple[float, float] = (0.05, 2.0)):
        """`index`: the actor handle (anything with `.apply.remote(bytes)` and
        `.needs_resync.remote(worker_id)` returning awaitables)."""
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

    def request_snapshot(self) -> None:
        """Sends a full snapshot soon (as if the index had asked)."""
        self._start()
        self._need_snapshot = True
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
                await asyncio.wait_for(_call(self._index.drop_worker, self.worker_id), timeout_s)
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
            if await asyncio.wait_for(_call(self._index.needs_resync, self.worker_id), self._timeout_s):
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
                result = await asyncio.wait_for(_call(self._index.apply, data), self._timeout_s)
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
