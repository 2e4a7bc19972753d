"""The Ray Serve adapters: `CacheAffinityRouter` (cairn's) and `RayPrefixRouter` (Ray's, mended).

`CacheAffinityRouter` is a thin `RequestRouter` around `cairn.cluster.routing.ranker.AffinityRanker`,
which decides; this module only connects it to Serve and to the index actor. How it reads the
index is `index_mode`:
- mirror (default): from its own copy of the index (cairn.cache_service.feed.IndexMirror), which a
  background task keeps following the index actor's change feed (a long poll, never on the
  request path). Scoring costs no round trip; a mirror not heard from for `index_staleness_s`
  counts as unavailable. An index actor without a change feed (an older cairn started it) turns
  the router to remote mode.
- remote: it awaits the actor's `score` per request (never a blocking ray.get; at most
  `index_timeout_ms`, enforced by the ranker).
The actor is reached through one `cairn.cluster.routing.index_handle.IndexHandle` (found off the loop,
found again after it dies). A replica that died is dropped from the index at once.

Replica identity everywhere (events, index, routing) is `replica_worker_id(replica_id)`, the full
Serve replica id string, which the router (RunningReplica.replica_id) and the replica
(serve.get_replica_context().replica_id) both produce.

Serve ships this module by value into the router's process (see `cairn.cluster.routing.router_registry`): its
module-level objects there are copies. Nothing process-wide lives here; the registry the ingress
reads is reached through `register_router`, a function of a module imported by reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable
from typing import Any

from ray.exceptions import ActorDiedError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cairn.cache_service.feed import IndexMirror
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.cluster.routing.index_handle import IndexHandle
from cairn.cluster.routing.ranker import AffinityRanker, IndexAnswer, IndexUnavailable, StatesAnswer
from cairn.cluster.routing.router_registry import register_router
from cairn.workers.request import ExportRequest, GenerateRequest

logger = logging.getLogger(__name__)


def replica_worker_id(replica_id: ReplicaID) -> str:
    """The worker id a replica reports events under and the index scores by."""
    return replica_id.to_full_id_str()


class CacheAffinityRouter(RequestRouter):
    """Ray Serve adapter around `AffinityRanker`; configured through request_router_kwargs
    (`RoutingConfig.router_kwargs()`)."""

    MIRROR_WAIT_S = 1.0         # the feed's long poll (at most): it answers at once when something changed
    MIRROR_INTERVAL_S = 0.02    # at least this between reads, so a busy index is read in chunks
    SNAPSHOT_TIMEOUT_S = 120.0  # a snapshot of a large index takes a while to build, send and load
    WARN_EVERY_S = 30.0

    def initialize_state(self, **kwargs: Any) -> None:
        from ray.util import metrics

        self._config = RoutingConfig.model_validate(kwargs)
        self._fallbacks = metrics.Counter(
            "cairn_router_index_fallbacks_total",
            description="Requests routed by load alone because the cache index timed out or failed.",
            tag_keys=("deployment", "reason"))
        self._fallbacks.set_default_tags({"deployment": self._deployment_id.name})
        self.ranker = AffinityRanker(self._config,
                                     on_fallback=lambda reason: self._fallbacks.inc(1, tags={"reason": reason}))
        self.index = IndexHandle(self._config)
        self.mirror = IndexMirror(self._config.index_max_pages) if self._config.index_mode == "mirror" else None
        self._mirror_sync: asyncio.Task | None = None
        self._feed_missing = False
        self._registered = False
        if self.mirror is not None:
            self.ranker.gauges = self.mirror.gauges
        try:  # start looking for the index now if Serve calls this on the router's loop
            asyncio.get_running_loop()
            if not self._in_own_replica():
                self._start()
        except RuntimeError:
            pass

    def _in_own_replica(self) -> bool:
        """This router serves an engine replica's own handle (its peers' fetches, which name their
        replica): it never scores, so it follows no index."""
        try:
            from ray import serve

            return serve.get_replica_context().deployment == self._deployment_id.name
        except Exception:  # not in a replica
            return False

    def _start(self) -> None:
        """On the router's loop: registers the router with this process's registry (first outputs
        are reported to it there; its mirror is read there), starts finding the index and, in
        mirror mode, following its change feed. Idempotent."""
        if not self._registered:
            register_router(self.ranker, asyncio.get_running_loop(), self.mirror, self._deployment_id.name)
            self._registered = True
        self.index.current()
        if self.mirror is not None and self._mirror_sync is None:
            self._mirror_sync = asyncio.get_running_loop().create_task(self._sync_mirror())

    def _score(self, page_hashes: list[bytes]) -> IndexAnswer | Awaitable[IndexAnswer]:
        if self.mirror is not None and not self._feed_missing:
            if not self.mirror.fresh(self._config.index_staleness_s):
                raise IndexUnavailable(f"mirror of {self._config.index_actor_name} is stale")
            if not self.mirror.known_workers():  # a restarted index before any replica resynced
                raise IndexUnavailable(f"mirror of {self._config.index_actor_name} knows no replica yet")
            return {w: s for w, s in self.mirror.score(page_hashes).items() if s.hit_pages}
        if self.index.current() is None:
            raise IndexUnavailable(self._config.index_actor_name)
        return self.index.call("score", page_hashes)

    def _probe(self, keys: list[bytes]) -> StatesAnswer | Awaitable[StatesAnswer]:
        """The index's sub-page states at `keys` (`CacheIndex.states_at`), where `_score` reads."""
        if self.mirror is not None and not self._feed_missing:
            if not self.mirror.fresh(self._config.index_staleness_s):
                raise IndexUnavailable(f"mirror of {self._config.index_actor_name} is stale")
            return self.mirror.states_at(keys)
        if self.index.current() is None:
            raise IndexUnavailable(self._config.index_actor_name)
        return self.index.call("states_at", keys)

    async def _sync_mirror(self) -> None:
        """Keeps `mirror` following the index actor's change feed, for the router's lifetime.
        Failures are logged (a warning at most every WARN_EVERY_S); an index actor without a
        change feed (started by an older cairn) turns this router to remote mode."""
        mirror, cfg = self.mirror, self._config
        wait_s = min(self.MIRROR_WAIT_S, cfg.index_staleness_s / 2)  # answers arrive well within staleness
        failures, warned_at = 0, float("-inf")
        while True:
            if self.index.current() is None:  # not found yet: the handle is looking
                await asyncio.sleep(0.1)
                continue
            try:
                timeout = wait_s + cfg.index_staleness_s if mirror.epoch is not None else self.SNAPSHOT_TIMEOUT_S
                chunk = await asyncio.wait_for(self.index.call("feed", mirror.epoch, mirror.cursor, wait_s), timeout)
                await mirror.apply(chunk)
                failures = 0
                await asyncio.sleep(self.MIRROR_INTERVAL_S)
            except asyncio.CancelledError:
                raise
            except (ActorDiedError, IndexUnavailable):  # gone for good: the handle looks up its successor
                await asyncio.sleep(0.1)
            except AttributeError:  # the actor has no `feed` method
                logger.warning("cache index actor %s has no change feed (an older cairn started it): routing "
                               "asks it per request (index_mode remote) from now on", cfg.index_actor_name)
                self._feed_missing = True
                return
            except Exception as e:  # restarting, slow, unreachable: the mirror ages, then counts as stale
                failures += 1
                if time.monotonic() - warned_at >= self.WARN_EVERY_S:
                    warned_at = time.monotonic()
                    logger.warning("reading the cache index's change feed failed (%d in a row, last: %r); "
                                   "requests route by load and memory while the mirror is stale", failures, e)
                await asyncio.sleep(0.2)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        if isinstance(request, ExportRequest):  # a peer's fetch (cairn.cluster.replica_peer_fetch): that replica,
            match = [r for r in candidate_replicas if replica_worker_id(r.replica_id) == request.target_worker]
            return [match or candidate_replicas[:1]] if candidate_replicas else []  # or, gone, one that says so
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when every rank is full
        self._start()  # a no-op if Serve created this router on this loop (initialize_state started it)
        if not candidate_replicas:
            return []
        by_id = {replica_worker_id(r.replica_id): r for r in candidate_replicas}
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else ""
        if not isinstance(request, GenerateRequest):  # not ours to rank (a health probe, a test): by load
            request = GenerateRequest(request_id, [])
        ranking = await self.ranker.rank(request_id, request, {w: r.routing_stats for w, r in by_id.items()},
                                         self._score, self._probe)
        if ranking.fetch is not None and pending_request is not None:  # sent along with a copy: the
            pending_request.args[0] = dataclasses.replace(request, fetch=ranking.fetch)  # request stays as it was
        return [[by_id[w]] for w in ranking.order]  # singleton ranks: Serve tries them strictly in order

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = pending_request.args[0] if pending_request.args else None
        if isinstance(request, GenerateRequest):  # (a peer's ExportRequest is not load to count)
            self.ranker.on_routed(pending_request.metadata.internal_request_id, replica_worker_id(replica_id), request)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ranker.on_completed(internal_request_id, replica_worker_id(replica_id))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        worker = replica_worker_id(replica_id)
        self.ranker.forget(worker)
        self.index.call_nowait("drop_worker", worker)  # fire and forget: its cache died with it

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new replica set (on the router's loop). With none (the app deleted, or
        scaled to zero; also before the first replica is up) there is nothing to route: the
        router stops following the index, so a handle kept in a long-lived process does not
        poll, or create, an index no one uses. A router that was following starts again when
        replicas come back, before their first request."""
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.ranker.forget(replica_worker_id(replica_id))
        if not replicas and self._mirror_sync is not None:
            self._mirror_sync.cancel()
            self._mirror_sync = None
        elif replicas and self._registered and self._mirror_sync is None and self.mirror is not None:
            self._start()


def _ray_prefix_router() -> type:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

    class RayPrefixRouter(PrefixCacheAffinityRouter):
        """Ray Serve LLM's PrefixCacheAffinityRouter, reading `.messages` only when it is set
        (Ray's stops at a `messages` attribute that is None, as a completions request has) and
        routing a request without text by its power-of-two fallback instead of failing."""

        def _extract_text_from_request(self, pending_request: PendingRequest) -> str | None:
            for arg in pending_request.args:
                messages, prompt = getattr(arg, "messages", None), getattr(arg, "prompt", None)
                text = self._normalize_prompt_to_string(messages if messages else prompt)
                if text:
                    return text
            return None

    RayPrefixRouter.__module__, RayPrefixRouter.__qualname__ = __name__, "RayPrefixRouter"
    return RayPrefixRouter


def __getattr__(name: str) -> Any:  # PEP 562: ray.llm is imported only when ray_prefix is chosen
    if name == "RayPrefixRouter":
        globals()[name] = cls = _ray_prefix_router()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
