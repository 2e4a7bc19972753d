"""What the HTTP app needs from an engine, as a small async interface.

The app talks to an `EngineClient` only, so the same app runs over one in-process engine
(`LocalEngineClient`, for tests and `cairn serve --replicas 1`) and over a Ray deployment
handle (the cluster supplies its own client). A client exposes the engines' `EngineSpec`
(page size, max model length, hash roots), the one value every engine behind it shares.
A `GenerateRequest` is everything the ingress decided once: token ids, sampling, and the
prefix-cache inputs (the hash root salted with the request's cache_salt, the page hashes under
it, checkpoint hints at message starts). It also carries the prompt text and messages, which
text-matching routers read.

Contract of `generate`: an async iterator of `RequestOutput`s ending with a finished one. It
raises `workers.RequestRejected` before the first output for a request the engine refuses (the
client's fault: a 400) and `workers.EngineError` for an internal fault. Closing the iterator
early aborts the request and frees its pages and state slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers import AsyncEngine, EngineSpec, RequestOutput, SamplingParams


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None                      # the prompt text, for text-matching routers
    messages: list[dict[str, Any]] | None = None   # the chat messages it was rendered from
    hash_root: bytes | None = None                 # spec.hash_root(cache_salt); None: unsalted
    page_hashes: list[bytes] | None = None         # one per whole page, under hash_root
    checkpoint_hints: list[int] = field(default_factory=list)  # token positions of message starts
    fetch_from: tuple[str, int] | None = None      # set by the router (fetch on): the deepest holder, its resume pages
    tenant: str | None = None                      # who asked (None: no keys), for the engine's fair scheduling


class EngineClient(Protocol):
    spec: EngineSpec  # what every engine behind this client shares


    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def metrics(self) -> dict[str, float]:
        """Engine counters and gauges (see `workers.Engine.metrics`)."""
        ...

    def num_waiting(self) -> int:
        """Requests accepted but not yet producing tokens (the queue the API bounds)."""
        ...

    async def ready(self) -> bool:
        """Whether an engine behind this client takes requests now (GET /ready)."""
        ...


class LocalEngineClient:
    """An `EngineClient` over an `AsyncEngine` in this process."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.spec = engine.spec
        self._waiting: set[str] = set()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        stream = self.engine.generate(request.prompt_token_ids, request.params, rid,
                                      hash_root=request.hash_root, page_hashes=request.page_hashes,
                                      checkpoint_hints=request.checkpoint_hints, tenant=request.tenant)
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

    async def metrics(self) -> dict[str, float]:
        return await self.engine.metrics()

    def num_waiting(self) -> int:
        return len(self._waiting)

    async def ready(self) -> bool:
        return True  # the engine was built before the app: it takes requests, or fails them as broken
