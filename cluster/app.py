"""The Ray Serve application: an HTTP ingress and a deployment of engine replicas.

- `Engine` deployment: one `AsyncEngine` per replica (`num_gpus: 1` on GPU nodes, fractional
  CPUs here). It reports what its cache holds to the index actor under its Serve replica id
  (`cluster.router.replica_worker_id`), through a non-blocking `EventPublisher` fed by a drain
  loop, and its load through `record_routing_stats`. Its request router comes from
  `RoutingConfig` (cache affinity by default).
- `Ingress` deployment: the FastAPI app of `cluster.api` over a `HandleEngineClient`, which
  renders, tokenizes and hashes once, then calls `Engine.generate` through a DeploymentHandle
  with a `GenerateRequest` (the router reads its page hashes).

`build_application(model_dir, replicas, ...)` returns the bound application; `app_builder(args)`
is the same for `serve run` / `serve deploy` (configs/serve.yaml).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from cache_service.hashing import model_fingerprint, root_hash
from cluster.engine_client import GenerateRequest
from cluster.routing_config import RoutingConfig

log = logging.getLogger(__name__)
DRAIN_INTERVAL_S = 0.05


class EngineReplica:
    """One engine per replica, its cache events published to the index."""

    async def __init__(self, model_dir: str, engine_options: dict[str, Any], routing: dict[str, Any]):
        from cache_service.actor import EventPublisher, index_actor
        from cluster.router import replica_worker_id
        from workers import AsyncEngine

        cfg = RoutingConfig.model_validate(routing)
        self.worker_id = replica_worker_id(serve.get_replica_context().replica_id)
        self.engine = AsyncEngine.from_pretrained(model_dir, worker_id=self.worker_id, **engine_options)
        self.max_num_seqs = self.engine.engine.options.max_num_seqs
        index = await asyncio.to_thread(index_actor, cfg.index_actor_name, cfg.index_actor_namespace,
                                        cfg.redis_url, cfg.namespace)
        self.publisher = EventPublisher(self.worker_id, index,
                                        snapshot=lambda: self.engine.call(lambda e: e.snapshot_events()))
        self._metrics: dict[str, float] = {}
        self._drain = asyncio.get_running_loop().create_task(self._drain_loop())

    async def _drain_loop(self) -> None:
        """Moves cache events from the engine to the publisher, and refreshes load numbers."""
        while True:
            try:
                batch = await self.engine.call(lambda e: e.drain_events())
                self.publisher.publish(batch)
                self._metrics = await self.engine.metrics()
            except Exception:  # never let reporting take the replica down
                log.exception("cache event drain failed on %s", self.worker_id)
            await asyncio.sleep(DRAIN_INTERVAL_S)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        async for out in self.engine.generate(
                request.prompt_token_ids, request.params, request.request_id, cache_salt=request.cache_salt,
                page_hashes=request.page_hashes, checkpoint_hints=request.checkpoint_hints):
            yield out

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def metrics(self) -> dict[str, float]:
        return dict(await self.engine.metrics(), worker_id=self.worker_id)  # type: ignore[arg-type]

    def record_routing_stats(self) -> dict[str, float]:
        from cluster.router import routing_stats

        return routing_stats(self._metrics, self.max_num_seqs)

    async def __del__(self) -> None:
        self._drain.cancel()
        await self.publisher.close(drop_worker=True)
        await self.engine.close()


class HandleEngineClient:
    """The `EngineClient` the ingress uses: engine replicas behind a DeploymentHandle."""

    def __init__(self, handle: DeploymentHandle, model_dir: Path, page_size: int, max_model_len: int):
        self.handle = handle
        self.page_size, self.max_model_len = page_size, max_model_len
        self._fingerprint = model_fingerprint(model_dir)  # what every replica's engine hashes under
        self._streams: dict[str, Any] = {}

    def hash_root(self, cache_salt: str | None) -> bytes:
        return root_hash(self._fingerprint, self.page_size, cache_salt)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        stream = self.handle.options(stream=True).generate.remote(request)
        self._streams[request.request_id] = stream
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield out
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                stream.cancel()  # the replica's generator is closed: the engine aborts the request

    async def abort(self, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        stream.cancel()
        return True

    async def metrics(self) -> dict[str, float]:
        return await self.handle.metrics.remote()

    def num_waiting(self) -> int:
        return len(self._streams)


class Ingress:
    """The HTTP front: `cluster.api.build_app` over the engine deployment's handle."""

    def __init__(self, engine: DeploymentHandle, model_dir: str, page_size: int, max_model_len: int | None,
                 served_model_name: str | None = None, api_key: str | None = None):
        from workers.model import ModelConfig

        cfg = ModelConfig.from_file(Path(model_dir) / "config.json")
        limit = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.model_dir, self.served_model_name, self.api_key = Path(model_dir), served_model_name, api_key
        self.client = HandleEngineClient(engine, self.model_dir, page_size, limit)

    def __serve_build_asgi_app__(self):
        from cluster.api import build_app

        return build_app(self.client, self.model_dir, self.served_model_name, self.api_key)


def build_application(model_dir: str | Path | None = None, replicas: int = 2, *,
                      engine_options: dict[str, Any] | None = None, routing: RoutingConfig | None = None,
                      num_cpus: float = 0.5, num_gpus: float = 0, ingress_replicas: int = 1,
                      served_model_name: str | None = None, api_key: str | None = None,
                      autoscaling: dict[str, Any] | None = None):
    """The bound Serve application. `model_dir` None serves the tiny demo model."""
    from workers.demo import demo_model_dir

    model_dir = str(model_dir or demo_model_dir("tiny"))
    routing = routing or RoutingConfig()
    options = dict(engine_options or {})
    options.setdefault("page_size", routing.page_size)
    if options["page_size"] != routing.page_size:
        raise ValueError(f"engine page_size {options['page_size']} differs from routing page_size "
                         f"{routing.page_size}: the router would score the wrong pages")
    placement: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus)
    engine = serve.deployment(
        EngineReplica, name="Engine", ray_actor_options=placement,
        request_router_config=routing.request_router_config(),
        **({"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}),
    ).bind(model_dir, options, routing.model_dump())
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", num_replicas=ingress_replicas,
                               ray_actor_options=dict(num_cpus=min(num_cpus, 0.25)))
    return ingress.bind(engine, model_dir, options["page_size"], options.get("max_model_len"),
                        served_model_name, api_key)


def app_builder(args: dict[str, Any]):
    """`import_path: cluster.app:app_builder` for `serve run` / `serve deploy`. Keys: model_dir,
    replicas, engine_options, routing (a dict or a path to a routing YAML), num_cpus, num_gpus,
    ingress_replicas, served_model_name, api_key, autoscaling."""
    args = dict(args or {})
    routing = args.pop("routing", None)
    if isinstance(routing, str):
        routing = RoutingConfig.from_yaml(routing)
    elif isinstance(routing, dict):
        routing = RoutingConfig.model_validate(routing)
    return build_application(args.pop("model_dir", None), args.pop("replicas", 2), routing=routing, **args)
