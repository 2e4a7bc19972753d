"""What the HTTP app needs from an engine, as a small async interface.

The app talks to an `EngineClient` only, so the same app runs over one in-process engine
(`LocalEngineClient`, for tests and `cairn serve --replicas 1`) and over a Ray deployment
handle (the cluster supplies its own client). A client exposes the engines' `EngineSpec`
(page size, max model length, hash roots), the one value every engine behind it shares.
Requests are `cairn.workers.request.GenerateRequest`s, the one request object from the ingress to
the engine.

Contract of `generate`: an async iterator of `RequestOutput`s ending with a finished one. It
raises `workers.RequestRejected` before the first output for a request the engine refuses (the
client's fault: a 400) and `workers.EngineError` for an internal fault. Closing the iterator
early aborts the request and frees its pages and state slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from cairn.workers import EngineFront, EngineSpec, RequestOutput
from cairn.workers.engine_metrics import EngineMetrics
from cairn.workers.request import GenerateRequest


class EngineClient(Protocol):
    spec: EngineSpec  # what every engine behind this client shares


    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def metrics(self) -> EngineMetrics:
        """Engine counters and gauges (`cairn.workers.engine_metrics.EngineMetrics`)."""
        ...

    def num_waiting(self) -> int:
        """Requests accepted but not yet producing tokens (the queue the API bounds)."""
        ...

    async def ready(self) -> bool:
        """Whether an engine behind this client takes requests now (GET /ready)."""
        ...


class LocalEngineClient:
    """An `EngineClient` over an `EngineFront` in this process."""

    def __init__(self, engine: EngineFront):
        self.engine = engine
        self.spec = engine.spec
        self._waiting: set[str] = set()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        stream = self.engine.stream(request)
        self._waiting.add(rid)
        try:
            async for out in stream:
                self._waiting.discard(rid)
                yield out
        finally:
            self._waiting.discard(rid)
            await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def metrics(self) -> EngineMetrics:
        return await self.engine.metrics()

    def num_waiting(self) -> int:
        return len(self._waiting)

    async def ready(self) -> bool:
        return True  # the engine was built before the app: it takes requests, or fails them as broken
