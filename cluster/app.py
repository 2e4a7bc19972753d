"""The Ray Serve application: an HTTP ingress and a deployment of engine replicas.

- `Engine` deployment: one `AsyncEngine` per replica (`num_gpus: 1` on GPU nodes, fractional
  CPUs here). It reports what its cache holds to the index actor under its Serve replica id
  (`cluster.routing.router.replica_worker_id`), through a non-blocking `EventPublisher` fed by a
  drain loop (the actor reached through an `IndexHandle`), and its load through
  `record_routing_stats`. Its request router comes from `RoutingConfig` (cache affinity by
  default, `cluster.routing`).
- `Ingress` deployment: the FastAPI app of `cluster.api` over a `HandleEngineClient`, which
  renders, tokenizes and hashes once, then calls `Engine.generate` through a DeploymentHandle
  with a `GenerateRequest` (the router reads its page hashes). First outputs and /metrics go
  through this process's router registry (`cluster.routing.registry`).

Which replica served a request: every HTTP response of the ingress that reached an engine carries
the header `x-cairn-replica` with the worker id (the Serve replica id, as in the cache index) of
the replica that produced it (several, comma-separated, for `n > 1` choices that landed apart).
Tests and benchmarks use it to check affinity; it is not part of the OpenAI API.

Each engine replica admits up to `max_ongoing_requests` requests (default: the engine's
`max_num_seqs`, since the engine batches that many; Serve's own default of 5 would cap a replica
far below what its engine runs and make Serve, not the router, decide where load goes). Each
ingress replica admits `ingress_max_ongoing_requests` HTTP requests (default 1024): a streamed
completion holds its slot for its whole life, and with Serve's default of 5 a sixth concurrent
client would wait at the proxy for one of them to finish.

`build_application(model_dir, replicas, ...)` returns the bound application; `app_builder(args)`
is the same for `serve run` / `serve deploy` (configs/serve.yaml).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.api.engine_client import GenerateRequest
from cluster.routing.config import RoutingConfig
from cluster.routing.registry import prefill_done, router_counts
from workers.spec import EngineSpec

log = logging.getLogger(__name__)
DRAIN_INTERVAL_S = 0.05
REPLICA_HEADER = "x-cairn-replica"
# the worker ids that served the HTTP request being handled (set per request by ReplicaHeader;
# a list, so the tasks the request spawns append to the same one)
_served_by: ContextVar[list[str] | None] = ContextVar("cairn_served_by", default=None)


class EngineReplica:
    """One engine per replica, its cache events published to the index."""

    async def __init__(self, model_dir: str, engine_options: dict[str, Any], routing: dict[str, Any],
                       spec: EngineSpec):
        from cache_service.publisher import EventPublisher
        from cluster.routing.index_handle import IndexHandle
        from cluster.routing.router import replica_worker_id
        from workers import AsyncEngine

        cfg = RoutingConfig.model_validate(routing)
        self.worker_id = replica_worker_id(serve.get_replica_context().replica_id)
        self.engine = AsyncEngine.from_pretrained(model_dir, worker_id=self.worker_id, **engine_options)
        if self.engine.spec != spec:  # e.g. another copy of the model on this node
            raise RuntimeError(f"this replica's engine is {self.engine.spec}, but the deployment was built for "
                               f"{spec}: every replica must load the same checkpoint with the same options")
        self.max_num_seqs = self.engine.max_num_seqs
        self.index = IndexHandle(cfg)
        await self.index.get()  # found, or created, before the first request
        self.publisher = EventPublisher(self.worker_id, self.index, snapshot=self.engine.snapshot_events)
        self._metrics: dict[str, float] = {}
        self._drain = asyncio.get_running_loop().create_task(self._drain_loop())

    async def _drain_loop(self) -> None:
        """Moves cache events from the engine to the publisher, and refreshes load numbers."""
        while True:
            try:
                batch = await self.engine.drain_events()
                self.publisher.publish(batch)
                self._metrics = await self.engine.metrics()
            except Exception:  # never let reporting take the replica down
                log.exception("cache event drain failed on %s", self.worker_id)
            await asyncio.sleep(DRAIN_INTERVAL_S)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        async for out in self.engine.generate(
                request.prompt_token_ids, request.params, request.request_id, hash_root=request.hash_root,
                page_hashes=request.page_hashes, checkpoint_hints=request.checkpoint_hints):
            yield out

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def metrics(self) -> dict[str, float]:
        return dict(await self.engine.metrics(), worker_id=self.worker_id)  # type: ignore[arg-type]

    async def cache_contents(self) -> tuple[str, frozenset[bytes], frozenset[bytes]]:
        """(worker id, page hashes, state page hashes) resident now: what the index should hold
        for this replica once its events are in (`handle.broadcast("cache_contents")`)."""
        pages, states = await self.engine.cache_contents()
        return self.worker_id, pages, states

    def record_routing_stats(self) -> dict[str, float]:
        from cluster.routing.cost import routing_stats

        return routing_stats(self._metrics, self.max_num_seqs)

    async def __del__(self) -> None:
        self._drain.cancel()
        await self.publisher.close(drop_worker=True)
        await self.engine.close()


class HandleEngineClient:
    """The `EngineClient` the ingress uses: engine replicas behind a DeploymentHandle."""

    def __init__(self, handle: DeploymentHandle, spec: EngineSpec):
        self.handle, self.spec = handle, spec  # every replica checked it loads this spec
        self._streams: dict[str, Any] = {}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        stream = self.handle.options(stream=True).generate.remote(request)
        self._streams[request.request_id] = stream
        finished, first = False, True
        served = _served_by.get()
        try:
            async for out in stream:
                if first:  # the prompt is computed; its replica is who served it (REPLICA_HEADER)
                    first = False
                    prefill_done(request.request_id)
                    if served is not None:
                        served.append(out.worker_id)
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
        """One replica's engine metrics, and this process's router counters."""
        return {**await self.handle.metrics.remote(), **router_counts()}

    def num_waiting(self) -> int:
        return len(self._streams)


class Ingress:
    """The HTTP front: `cluster.api.build_app` over the engine deployment's handle."""

    def __init__(self, engine: DeploymentHandle, model_dir: str, spec: EngineSpec,
                 served_model_name: str | None = None, api_key: str | None = None):
        self.model_dir, self.served_model_name, self.api_key = Path(model_dir), served_model_name, api_key
        self.client = HandleEngineClient(engine, spec)

    def __serve_build_asgi_app__(self):
        from cluster.api import build_app

        # Serve's proxy sets X-Request-Id on the way in (the app adopts it) and echoes it itself
        app = build_app(self.client, self.model_dir, self.served_model_name, self.api_key, echo_request_id=False)
        app.add_middleware(ReplicaHeader)
        return app


class ReplicaHeader:
    """ASGI middleware: adds `x-cairn-replica: <worker id>[,<worker id>...]` to a response whose
    request reached engine replicas (the ids come from `HandleEngineClient.generate`)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        served: list[str] = []
        token = _served_by.set(served)

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start" and served:
                value = ",".join(dict.fromkeys(served)).encode("latin-1")
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), value)]}
            await send(message)
        try:
            await self.app(scope, receive, send_with_header)
        finally:
            _served_by.reset(token)


def build_application(model_dir: str | Path | None = None, replicas: int = 2, *,
                      engine_options: dict[str, Any] | None = None, routing: RoutingConfig | None = None,
                      num_cpus: float = 0.5, num_gpus: float = 0, ingress_replicas: int = 1,
                      served_model_name: str | None = None, api_key: str | None = None,
                      autoscaling: dict[str, Any] | None = None, max_ongoing_requests: int | None = None,
                      ingress_max_ongoing_requests: int = 1024, health_check_period_s: float | None = None):
    """The bound Serve application. `model_dir` None serves the tiny demo model.
    `max_ongoing_requests` per engine replica defaults to the engine's max_num_seqs;
    `health_check_period_s` (Serve's default: 10) is how often the controller checks a replica,
    hence how soon it replaces one that died."""
    from workers import EngineOptions, EngineSpec, demo_model_dir

    model_dir = str(model_dir or demo_model_dir("tiny"))
    options = dict(engine_options or {})
    spec = EngineSpec.from_model_dir(model_dir, EngineOptions.from_kwargs(**options))
    routing = (routing or RoutingConfig()).for_engines(spec)
    placement: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus)
    extra: dict[str, Any] = {}
    if health_check_period_s is not None:
        extra["health_check_period_s"] = health_check_period_s
    engine = serve.deployment(
        EngineReplica, name="Engine", ray_actor_options=placement,
        request_router_config=routing.request_router_config(),
        max_ongoing_requests=max_ongoing_requests or options.get("max_num_seqs", EngineOptions.max_num_seqs),
        **extra,
        **({"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": replicas}),
    ).bind(model_dir, options, routing.model_dump(), spec)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", num_replicas=ingress_replicas,
                               max_ongoing_requests=ingress_max_ongoing_requests,
                               ray_actor_options=dict(num_cpus=min(num_cpus, 0.25)))
    return ingress.bind(engine, model_dir, spec, served_model_name, api_key)


def app_builder(args: dict[str, Any]):
    """`import_path: cluster.app:app_builder` for `serve run` / `serve deploy`. Keys: model_dir
    (null: the demo model), replicas, engine_options, routing (a dict, or a path to a routing YAML:
    absolute, relative to the working directory, or to this repository), num_cpus, num_gpus,
    ingress_replicas, served_model_name, api_key, autoscaling, max_ongoing_requests,
    ingress_max_ongoing_requests, health_check_period_s. Unknown keys are an error."""
    args = dict(args or {})
    routing = args.pop("routing", None)
    if isinstance(routing, str):
        path = Path(routing)
        if not path.is_absolute() and not path.exists():  # the repository's configs/, from anywhere
            path = Path(__file__).resolve().parent.parent / routing
        routing = RoutingConfig.from_yaml(path)
    elif isinstance(routing, dict):
        routing = RoutingConfig.model_validate(routing)
    return build_application(args.pop("model_dir", None), args.pop("replicas", 2), routing=routing, **args)
