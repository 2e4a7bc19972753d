"""The ingress deployment: the HTTP API of `cluster.api` over the engine deployment.

- `Ingress`: the FastAPI app of `cluster.api` over a `HandleEngineClient`, which renders,
  tokenizes and hashes once, then calls `EngineReplica.generate` through a DeploymentHandle with
  a `GenerateRequest` (the router, running in this process, reads its page hashes).
- `HandleEngineClient`: the `EngineClient` over that handle. When a request's first output
  arrives its prompt is computed: it tells this process's routers (`cluster.routing.registry
  .prefill_done`), which stop counting its prefill as load. Its /metrics adds the routers'
  counters (`router_counts`) to one replica's engine metrics.
- `ReplicaHeader`: which replica served a request. Every HTTP response that reached an engine
  carries the header `x-cairn-replica` with the worker id (the Serve replica id, as in the cache
  index) of the replica that produced it (several, comma-separated, for `n > 1` choices that
  landed apart). Tests and benchmarks use it to check affinity; it is not part of the OpenAI API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ray.serve.handle import DeploymentHandle

from cluster.api.engine_client import GenerateRequest
from cluster.routing.registry import prefill_done, router_counts
from workers import EngineSpec

REPLICA_HEADER = "x-cairn-replica"
# the worker ids that served the HTTP request being handled (set per request by ReplicaHeader;
# a list, so the tasks the request spawns append to the same one)
_served_by: ContextVar[list[str] | None] = ContextVar("cairn_served_by", default=None)


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
