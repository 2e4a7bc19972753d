"""The engine deployment's replica: one `EngineFront`, its cache reported to the index.

`EngineReplica` owns one engine (`num_gpus: 1` on GPU nodes, fractional CPUs here) and serves
`generate`, `abort`, `metrics`, `cache_contents` and `ready` to the ingress through a DeploymentHandle,
and `export_resume` to its peers (`cairn.cluster.replica_peer_fetch`: with the routing config's `fetch` on, a
request first pulls the resume point the router says another replica holds).
Rules it keeps:
- It resolves its model (a directory or a Hugging Face id, `workers.ModelSource`) on its own
  node: from that node's Hugging Face cache, or downloaded into it.
- Its worker id is its Serve replica id (`cairn.cluster.routing.router.replica_worker_id`), the name
  the router ranks it by and the index holds its cache under.
- It loads the `EngineSpec` the deployment was built for, or refuses to start: every replica
  must hash, page and resume the same way, since the router scores them as one.
- What its cache holds reaches the index through a non-blocking `EventPublisher`, fed by a
  drain loop every `DRAIN_INTERVAL_S`; the index actor is reached through an `IndexHandle`, found
  (or created) before the replica takes requests and found again if it dies. Reporting never
  takes the replica down.
- Its load reaches the router through `record_routing_stats` (`cairn.cluster.routing.cost.routing_stats`),
  and its engine metrics reach Ray's metrics export, tagged with this replica, from the same
  drain loop (`cairn.cluster.metrics_export`): the cluster-wide view.
- Its engine runs the `EngineOptions` the deployment was built with, as given (`cairn.cluster.app`
  decides them once, warm-up included: kernels compiled before the replica takes requests).
- With `tensor_parallel_size` N > 1 in its engine options it is rank 0 of its engine, placed in
  the first bundle of its placement group (N bundles, one device each, `STRICT_PACK`: see
  `cairn.cluster.app`), and starts ranks 1..N-1 as Ray actors in the other bundles
  (`cairn.cluster.tp_ranks`). An engine that lost a rank fails `check_health`, and Serve replaces
  the replica.
- Shutting down (Serve scaling it down or replacing it), it first finishes what is in flight:
  Serve stops routing to it and waits for its ongoing requests, up to the deployment's
  `graceful_shutdown_timeout_s`, before calling `__del__`; then the index forgets it
  (`EventPublisher.close(drop_worker=True)`), so no router scores a replica that is gone.
It touches the engine only through `EngineFront`'s public methods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from cairn.cache_service.publisher import EventPublisher
from cairn.cluster.api.api_metrics import engine_families
from cairn.cluster.metrics_export import ENGINE_EXPORT_INTERVAL_S, RayMetricsMirror
from cairn.cluster.replica_peer_fetch import ReplicaPeerFetch
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.cluster.routing.cost import routing_stats
from cairn.cluster.routing.index_handle import IndexHandle
from cairn.cluster.routing.router import replica_worker_id
from cairn.cluster.tp_ranks import RayRankWorkers
from cairn.workers import EngineOptions, EngineSpec
from cairn.workers.engine_metrics import EngineMetrics
from cairn.workers.request import ExportRequest, GenerateRequest

log = logging.getLogger(__name__)
DRAIN_INTERVAL_S = 0.05


class EngineReplica:
    """One engine per replica, its cache events published to the index."""

    async def __init__(self, model: str, engine_options: EngineOptions, routing: dict[str, Any],
                       spec: EngineSpec):
        from cairn.workers import EngineFront, ModelSource

        cfg = RoutingConfig.model_validate(routing)
        self.worker_id = replica_worker_id(serve.get_replica_context().replica_id)
        model_dir = ModelSource.parse(model).local_dir()
        self.engine = EngineFront.from_pretrained(model_dir, engine_options, worker_id=self.worker_id,
                                                  start_ranks=RayRankWorkers.start)
        if self.engine.spec != spec:  # e.g. another copy of the model on this node
            raise RuntimeError(f"this replica's engine is {self.engine.spec}, but the deployment was built for "
                               f"{spec}: every replica must load the same checkpoint with the same options")
        self.max_num_seqs = self.engine.max_num_seqs
        # The process lives for this engine: what exists now (model, tokenizer, Ray's own) lives as
        # long, so the cyclic collector need not walk it again on every full collection, which
        # would stall steps by milliseconds (benchmarks/overhead.py measures the step's CPU time).
        gc.collect()
        gc.freeze()
        self.index = IndexHandle(cfg)
        await self.index.get()  # found, or created, before the first request
        self.publisher = EventPublisher(self.worker_id, self.index, snapshot=self.engine.snapshot_events)
        self.fetch = ReplicaPeerFetch(self.worker_id, self.engine, cfg.fetch_timeout_s)
        self._metrics, self._metrics_at = EngineMetrics(), time.time()
        self._mirror, self._exported_at = RayMetricsMirror(), 0.0
        self._drain = asyncio.get_running_loop().create_task(self._drain_loop())

    async def _drain_loop(self) -> None:
        """Moves cache events from the engine to the publisher, refreshes load numbers and
        exports them to Ray's metrics."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                batch = await self.engine.drain_events()
                self.publisher.publish(batch)
                self._metrics, self._metrics_at = await self.engine.metrics(), time.time()
                if loop.time() - self._exported_at >= ENGINE_EXPORT_INTERVAL_S:
                    self._exported_at = loop.time()
                    self._mirror.export(engine_families(self._metrics))
            except Exception:  # never let reporting take the replica down
                log.exception("cache event drain failed on %s", self.worker_id)
            await asyncio.sleep(DRAIN_INTERVAL_S)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        async for out in self.engine.stream(request, self.fetch):  # fetch: what another replica holds deeper
            yield out

    async def export_resume(self, ask: ExportRequest):
        """A peer asks for pages and a checkpoint this replica holds (`cairn.cluster.replica_peer_fetch`)."""
        return await self.fetch.export(ask)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    def check_health(self) -> None:
        """Serve's health check: an engine that lost a tensor-parallel rank fails it, so Serve
        replaces this replica (its requests already ended with a retryable error)."""
        self.engine.check_health()

    async def ready(self) -> bool:
        """The ingress's readiness probe (GET /ready): this replica exists and answers."""
        return True

    async def metrics(self) -> EngineMetrics:
        return dataclasses.replace(await self.engine.metrics(), worker_id=self.worker_id)

    async def cache_contents(self) -> tuple[str, frozenset[bytes], frozenset[bytes]]:
        """(worker id, page hashes, state page hashes) resident now: what the index should hold
        for this replica once its events are in (`handle.broadcast("cache_contents")`)."""
        pages, states = await self.engine.cache_contents()
        return self.worker_id, pages, states

    def record_routing_stats(self) -> dict[str, float]:
        return routing_stats(self._metrics, self.max_num_seqs, self._metrics_at)

    async def __del__(self) -> None:
        self._drain.cancel()
        await self.publisher.close(drop_worker=True)
        await self.engine.close()
