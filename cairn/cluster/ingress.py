"""The ingress deployment: the HTTP API of `cairn.cluster.api` over the engine deployment.

- `Ingress`: the FastAPI app of `cairn.cluster.api` over a `HandleEngineClient`, which renders,
  tokenizes and hashes once, then calls `EngineReplica.generate` through a DeploymentHandle with
  a `GenerateRequest` (the router, running in this process, reads its page hashes).
- `HandleEngineClient`: the `EngineClient` over that handle, whose router (and with it its index
  mirror) the ingress starts in its constructor, before its first request. When a request's
  first output arrives its prompt is computed: it tells this process's routers (`cairn.cluster.routing.router_registry
  .prefill_done`), which stop counting its prefill as load. A replica lost under a request (its
  process or its node gone: Ray's `RayActorError`) fails the request as `workers.EngineBroken`,
  which the API answers as it answers any broken engine: 503 `engine_unavailable`, retry (Serve
  routes the retry to a live replica). Its /metrics adds the routers' counters (`router_counts`)
  to one replica's engine metrics.
  Every engine call gets a Serve request id of its own (`engine_call_context`): Serve's router
  keys the calls it is assigning by that id, and the calls of one HTTP request (its n choices,
  its prompts) would otherwise share the HTTP request's, so all but the first were never
  assigned and the request hung. The calls are still cancelled with their HTTP request: the
  API closes its engine streams when the client leaves (`cairn.cluster.api.fanout`).
- `ReplicaHeader`: which replica served a request. Every HTTP response that reached an engine
  carries the header `x-cairn-replica` with the worker id (the Serve replica id, as in the cache
  index) of the replica that produced it (several, comma-separated, for `n > 1` choices that
  landed apart). Tests and benchmarks use it to check affinity; it is not part of the OpenAI API.
- `Ingress.routing_state()`: a method for operators and tests, never on the request path (it is
  no HTTP route; call it through a DeploymentHandle, e.g. `broadcast("routing_state")` for every
  ingress replica): this replica's node and what each cache-affinity router of its process
  mirrors of the index, so every ingress's mirror can be compared with the others and with the
  index actor (`CacheIndexActor.digest`), and the request timeout it enforces.
- The operator's end-to-end limit (Serve's `http_options.request_timeout_s`, read from Serve's
  controller when the replica starts) is enforced by the app too (`APIOptions.request_timeout_s`):
  Serve's proxy obeys a client's `x-request-timeout-seconds` header, which would lift it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from cairn.cluster.api.api_options import APIOptions
from cairn.cluster.api.tenants import Tenants
from cairn.cluster.metrics_export import INGRESS_EXPORT_INTERVAL_S, RayMetricsMirror
from cairn.cluster.routing.router_registry import mirror_summaries, prefill_done, router_counts
from cairn.workers import EngineSpec, ModelSource
from cairn.workers.engine_errors import EngineBroken
from cairn.workers.engine_metrics import EngineMetrics
from cairn.workers.request import GenerateRequest

log = logging.getLogger(__name__)
READY_TIMEOUT_S = 2.0  # how long GET /ready waits for an engine replica to answer
REPLICA_HEADER = "x-cairn-replica"
# the worker ids that served the HTTP request being handled (set per request by ReplicaHeader;
# a list, so the tasks the request spawns append to the same one)
_served_by: ContextVar[list[str] | None] = ContextVar("cairn_served_by", default=None)


@contextmanager
def engine_call_context() -> Iterator[None]:
    """Within it, a handle call gets a Serve internal request id of its own, derived from the
    current request's. Serve's request router keys a call waiting for a replica by that id
    (`RequestRouter._pending_requests_by_id`, Ray 2.60): two calls under one id while both wait,
    and the second is never assigned."""
    from ray.serve import context

    current = context._get_serve_request_context()
    own = f"{current._internal_request_id or 'cairn'}:{uuid.uuid4().hex[:12]}"
    token = context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=own))
    try:
        yield
    finally:
        context._serve_request_context.reset(token)


class HandleEngineClient:
    """The `EngineClient` the ingress uses: engine replicas behind a DeploymentHandle."""

    def __init__(self, handle: DeploymentHandle, spec: EngineSpec):
        self.handle, self.spec = handle, spec  # every replica checked it loads this spec
        self._streams: dict[str, Any] = {}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        with engine_call_context():  # the request's metadata is read inside remote(), at once
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
        except RayActorError as e:  # ActorDiedError, ActorUnavailableError: the replica is gone
            raise EngineBroken(f"engine replica lost under request {request.request_id}: {e}") from e
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

    async def metrics(self) -> EngineMetrics:
        """One replica's engine metrics (this process's router counters are the app's
        `APIMetrics.router_sources`)."""
        return await self.handle.metrics.remote()

    def num_waiting(self) -> int:
        return len(self._streams)

    async def ready(self) -> bool:
        """An engine replica answered within `READY_TIMEOUT_S`: one exists and takes calls. The
        ingress answers HTTP as soon as it is up, before the engine replicas behind it are (a
        model still loading), so /v1/models alone says nothing of them."""
        try:
            with engine_call_context():
                return bool(await asyncio.wait_for(self.handle.ready.remote(), READY_TIMEOUT_S))
        except Exception:  # no replica yet (the call waits in Serve's queue), or one failing
            return False


class Ingress:
    """The HTTP front: `cairn.cluster.api.build_app` over the engine deployment's handle. `model` (a
    directory or a Hugging Face id, resolved on this replica's node for its tokenizer and chat
    template) names the model for clients unless `api.served_model_name` does; `api` is the
    app's `cairn.cluster.api.api_options.APIOptions` as a dict. Keys arrive as digests (`api_key_digests`,
    `metrics_key_digest`: `cairn.cluster.api.tenants`), never as keys, since Serve logs a deployment's
    arguments; `api_keys_file` (read on this replica's node) adds tenants; none of them:
    CAIRN_API_KEY in the replica's environment, else no keys."""

    async def __init__(self, engine: DeploymentHandle, model: str, spec: EngineSpec, api: dict[str, Any] | None = None,
                       *, api_key_digests: list[str] | None = None, api_keys_file: str | None = None,
                       metrics_key_digest: str | None = None):
        source = ModelSource.parse(model)
        options = APIOptions.model_validate(api or {})
        self.model_dir = source.local_dir()
        # Serve's proxy sets X-Request-Id on the way in (the app adopts it) and echoes it itself; the
        # request timeout is Serve's own (the app enforces it too, as a 408)
        self.options = options.model_copy(update=dict(
            served_model_name=options.served_model_name or source.served_name, echo_request_id=False,
            request_timeout_s=await serve_request_timeout()))
        self.tenants = Tenants.load(keys_file=api_keys_file, api_key_digests=api_key_digests or ())
        self.metrics_key_digest = metrics_key_digest
        # options() starts the handle's router now (Serve would start it at the first call): its
        # index mirror follows the index from before this replica takes traffic, where a router
        # started by a request would route this replica's first requests by load alone
        self.client = HandleEngineClient(engine.options(), spec)
        self._api_metrics: Any = None
        self._mirror = RayMetricsMirror()
        self._export = asyncio.get_running_loop().create_task(self._export_loop())

    def __serve_build_asgi_app__(self):
        from cairn.cluster.api import build_app

        app = build_app(self.client, self.model_dir, self.options, tenants=self.tenants,
                        metrics_key_digest=self.metrics_key_digest)
        self._api_metrics = app.state.metrics
        self._api_metrics.router_sources.append(router_counts)  # this process's routers, on /metrics
        app.add_middleware(ReplicaHeader)
        return app

    async def routing_state(self) -> dict[str, Any]:
        """This ingress replica's `replica` id and `node` id, and `routers`: for each router of
        this process that keeps an index mirror (the engine handle's, started in the
        constructor), the deployment it routes to, the index it mirrors, its counters and where
        its mirror stands (`cairn.cluster.routing.router_registry.mirror_summaries`: epoch, cursor, workers,
        pages, digest, age). Reads every mirror entry, on the routers' loops: for operators and
        tests, never on the request path."""
        return dict(replica=serve.get_replica_context().replica_id.to_full_id_str(),
                    node=ray.get_runtime_context().get_node_id(), routers=await mirror_summaries(),
                    request_timeout_s=self.options.request_timeout_s)

    async def _export_loop(self) -> None:
        """Copies this replica's API metrics and router counters to Ray's metrics export."""
        while True:
            await asyncio.sleep(INGRESS_EXPORT_INTERVAL_S)
            try:
                if self._api_metrics is not None:
                    self._mirror.export(list(self._api_metrics.registry.collect()))  # the routers' included
            except Exception:  # never let reporting take the replica down
                log.exception("metrics export failed")

    async def __del__(self) -> None:
        self._export.cancel()


async def serve_request_timeout() -> float | None:
    """The operator's end-to-end limit on a request (Serve's `http_options.request_timeout_s`),
    which this ingress enforces itself: Serve's proxy lets a client's `x-request-timeout-seconds`
    header lift it."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:  # not under Serve (a test building the ingress by hand): no proxy, no limit
        return None
    timeout = (await controller.get_http_config.remote()).request_timeout_s
    return timeout if timeout is not None and timeout > 0 else None


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
