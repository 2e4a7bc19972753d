"""The cache index as a Ray actor.

`index_actor(...)` gets or creates the one named, detached `CacheIndexActor` of a cluster (Ray
restarts it on failure, `max_restarts=-1`), on the head node whoever creates it (an engine replica
on a worker node usually does): a worker node can be lost, and the head is the one node the
cluster cannot lose anyway. Its async methods wrap `CacheIndex`: `apply(bytes)`,
`score(page_hashes)`, `drop_worker`, `workers`, `contents`, `host_contents`, `workers_needing_resync`,
`needs_resync`, `stats`, `digest` (`CacheIndex.digest`, to compare a router's mirror with the
index), and `feed(epoch, cursor, wait_s)`: the change feed routers mirror the index from
(cairn.cache_service.feed; a long poll: it answers at once if something changed since `cursor`, else
when something does or `wait_s` passes).
- Dead replicas are dropped by the index itself: a worker id that is a Serve replica id
  (`SERVE_REPLICA::app#deployment#id`, the name Serve gives the replica's actor in the `serve`
  namespace) is looked up every `liveness_interval_s`; once its actor is gone on two lookups in a
  row the worker is dropped (`stats()["workers_reaped"]`). So a killed replica leaves the index
  within about two intervals even if no router ever sends it a request (routers that do drop it
  at once, on `on_replica_actor_died`). Other worker ids (tests, other launchers) are never reaped.
- With a Redis URL the index lives in Redis: a restarted actor resumes exactly where the last
  one stopped (contents, seq numbers, trust), and fences the old one out. The host `ray-head`
  in the URL names the Ray head node (`resolve_head`): the cluster config runs Redis there,
  and the actor dials the head's address, never 127.0.0.1.
- Without, a restarted actor starts empty and asks every worker it does not know to resync:
  `needs_resync(worker)` is true for them, and their next incremental batch is refused as a gap.
Only this file under cache_service imports Ray. Replicas feed the actor through
`cairn.cache_service.publisher.EventPublisher`; the cluster reaches it through
`cairn.cluster.routing.index_handle.IndexHandle`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from cairn.cache_service.events import EventBatch, EventDecodeError
from cairn.cache_service.feed import ChangeFeed, FeedChunk
from cairn.cache_service.index import CacheIndex
from cairn.cache_service.publisher import ApplyResult

logger = logging.getLogger(__name__)

DEFAULT_ACTOR_NAME = "cairn-cache-index"
DEFAULT_RAY_NAMESPACE = "cairn"
SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"  # ray.serve._private.common.REPLICA_ID_FULL_ID_STR_PREFIX
SERVE_NAMESPACE = "serve"                 # where Serve names its replica actors
HEAD_NODE_RESOURCE = "node:__internal_head__"  # ray._common.constants.HEAD_NODE_RESOURCE_NAME: the head's alone
LIVENESS_INTERVAL_S = 1.0


HEAD_HOST = "ray-head"  # in a Redis URL: the Ray head node, wherever the actor runs


def resolve_head(url: str | None) -> str | None:
    """`url` with the host `ray-head` replaced by the Ray head node's address (the node holding
    Ray's head resource, else the GCS address's host); any other URL as it is."""
    from urllib.parse import urlsplit, urlunsplit

    if not url:
        return url
    parts = urlsplit(url)
    if parts.hostname != HEAD_HOST:
        return url
    head = next((n["NodeManagerAddress"] for n in ray.nodes()
                 if n.get("Alive") and "node:__internal_head__" in n.get("Resources", {})), None)
    if head is None:
        head = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
    netloc = parts.netloc.replace(HEAD_HOST, head, 1)
    return urlunsplit(parts._replace(netloc=netloc))


@ray.remote
class CacheIndexActor:
    def __init__(self, redis_url: str | None = None, namespace: str = "cairn", max_pages: int = 4_000_000,
                 liveness_interval_s: float = LIVENESS_INTERVAL_S):
        self._restarted = ray.get_runtime_context().was_current_actor_reconstructed
        redis_url = resolve_head(redis_url)
        if redis_url:
            from cairn.cache_service.redis_store import RedisStore

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

    async def score(self, page_hashes: list[bytes]) -> dict[str, tuple[int, int, int, bool]]:
        """worker -> (hit_pages, state_pages, device_pages, state_on_host), the fields of
        `cairn.cache_service.scoring.WorkerScore`; workers absent from the answer score nothing."""
        self._watch()
        return {w: (s.hit_pages, s.state_pages, s.device_pages, s.state_on_host)
                for w, s in self._index.score(page_hashes).items() if s.hit_pages}

    async def states_at(self, keys: list[bytes]) -> dict[str, list[tuple[int, bool]]]:
        """`CacheIndex.states_at`: worker -> [(i, on host)] for the sub-page states at `keys[i]`."""
        self._watch()
        return self._index.states_at(keys)

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
        """(page hashes, state page hashes) held for the worker, in either medium; None if it is
        unknown."""
        try:
            return self._index.contents(worker_id)
        except KeyError:
            return None

    async def host_contents(self, worker_id: str) -> tuple[frozenset[bytes], frozenset[bytes]] | None:
        """The part of `contents` in the worker's host memory; None if it is unknown."""
        try:
            return self._index.host_contents(worker_id)
        except KeyError:
            return None

    async def workers_needing_resync(self) -> set[str]:
        return self._index.workers_needing_resync()

    async def needs_resync(self, worker_id: str) -> bool:
        """Whether `worker_id` must send a snapshot: it lost events, or the index lost what it
        knew (restarted without Redis, or its Redis lost everything) and does not know it since."""
        if self._index.needs_resync(worker_id):
            return True
        forgot = self._resync_unknown or self._index.store_lost()
        return forgot and worker_id not in self._index.workers()

    async def digest(self) -> dict[str, Any]:
        """The index's `CacheIndex.digest` with the feed's `epoch` and `cursor` it is as of (read in
        one step): a mirror at that epoch and cursor holds the same digest. Reads every entry
        (from Redis, with that backend): for tests and operators, not for routing."""
        return dict(epoch=self._feed.epoch, cursor=self._feed.cursor, digest=self._index.digest())

    async def stats(self) -> dict[str, Any]:
        self._watch()
        return dict(self._index.stats(), backend=self._backend, restarted=self._restarted,
                    store_losses=self._index.store_losses,
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
    """The cluster's index actor, created on first use (blocking: call it off the event loop), on
    the head node (a sliver of its head resource; restarts stay there too). Later callers get the
    existing actor whatever arguments they pass."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return CacheIndexActor.options(
        name=name, namespace=ray_namespace, lifetime="detached", get_if_exists=True,
        max_restarts=-1, num_cpus=num_cpus, resources={HEAD_NODE_RESOURCE: 0.001},
        # never inside the placement group of whoever creates it (a tensor-parallel replica's):
        # it would not fit there, and it would die with that replica's group
        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None),
    ).remote(redis_url, namespace, max_pages)
