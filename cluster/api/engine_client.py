"""What the HTTP app needs from an engine, as a small async interface.

The app talks to an `EngineClient` only, so the same app runs over one in-process engine
(`LocalEngineClient`, for tests and `cairn serve --replicas 1`) and over a Ray deployment
handle (the cluster supplies its own client). A `GenerateRequest` is everything the ingress
decided once: token ids, sampling, and the prefix-cache inputs (page hashes computed with the
engine's hash root, checkpoint hints at message starts, the cache salt). It also carries the
prompt text and messages, which text-matching routers read.

Contract of `generate`: an async iterator of `RequestOutput`s ending with a finished one. It
raises `ValueError` before the first output for a request the engine refuses (the client's
fault: a 400) and `workers.EngineError` for an internal fault. Closing the iterator early
aborts the request and frees its pages and state slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers import AsyncEngine, RequestOutput, SamplingParams


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None                      # the prompt text, for text-matching routers
    messages: list[dict[str, Any]] | None = None   # the chat messages it was rendered from
    cache_salt: str | None = None
    page_hashes: list[bytes] | None = None         # one per whole page, from EngineClient.hash_root
    checkpoint_hints: list[int] = field(default_factory=list)  # token positions of message starts


class EngineClient(Protocol):
    max_model_len: int  # prompt + output tokens
    page_size: int      # tokens per KV page (what page_hashes are computed over)

    def hash_root(self, cache_salt: str | None) -> bytes:
        """The root of the engine's page-hash chains under this salt."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def metrics(self) -> dict[str, float]:
        """Engine counters and gauges (see `workers.Engine.metrics`)."""
        ...

    def num_waiting(self) -> int:
        """Requests accepted but not yet producing tokens (the queue the API bounds)."""
        ...


class LocalEngineClient:
    """An `EngineClient` over an `AsyncEngine` in this process."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        core = engine.engine
        self.max_model_len: int = core.max_model_len
        self.page_size: int = core.options.page_size
        self._waiting: set[str] = set()

    def hash_root(self, cache_salt: str | None) -> bytes:
        return self.engine.engine.hash_root(cache_salt)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        stream = self.engine.generate(request.prompt_token_ids, request.params, rid,
                                      cache_salt=request.cache_salt, page_hashes=request.page_hashes,
                                      checkpoint_hints=request.checkpoint_hints)
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
