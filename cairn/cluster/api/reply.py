"""The answer to a started request, streamed or whole: `Reply`, what both endpoints share past `Serving.start`.

An endpoint starts its engine requests (`Serving.start`) and hands the rest here with what is
its own: the models of its body and of its chunks, and how a choice becomes a part of them.

`stream`: server-sent events (`sse.SSEResponse`). First the endpoint's opening parts of each
choice, in choice order; then, for each delta a choice adds (`Serving.drive`), the parts the
endpoint makes of it; each part is a chunk of its own, every chunk carrying the completion's id,
one `created` (the time the stream was made) and the model. Then a usage chunk (no choices) when
`stream_options.include_usage` asks for it, and `[DONE]`. A fault after the stream started is
an error event and then `[DONE]`: a request's own limit (a 408 past its deadline) as itself,
anything else naming only the request id (the fault itself is logged). Whatever happens, the
client leaving included, the engine requests are closed and the request is counted into the
metrics once.

`whole`: every choice runs to its end and one JSON body carries them and the usage. A client
that leaves first gets a bare 499: its engine requests are aborted, not left to run for no one,
and the request is still counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.responses import Response

from cairn.cluster.api.api_errors import CLIENT_CLOSED_REQUEST, APIError, fault
from cairn.cluster.api.choice import Choice, Delta
from cairn.cluster.api.fanout import Fanout
from cairn.cluster.api.protocol import SamplingFields
from cairn.cluster.api.responses import DONE, ChatCompletionChunk, Completion, Usage
from cairn.cluster.api.serving import Prepared, Serving
from cairn.cluster.api.sse import SSEResponse
from cairn.cluster.api.tenants import Caller

log = logging.getLogger("cairn.cluster.api")


class Reply:
    def __init__(self, serving: Serving, req: SamplingFields, request_id: str, prompts: list[Prepared],
                 choices: list[Choice], fan: Fanout, first: tuple[int, Any], arrived: float, caller: Caller,
                 id_prefix: str):
        self.serving, self.req, self.request_id, self.prompts, self.choices = serving, req, request_id, prompts, choices
        self.fan, self.first, self.arrived, self.caller = fan, first, arrived, caller
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"

    def stream(self, chunk_model: Callable[..., ChatCompletionChunk | Completion],
               opening: Callable[[Choice], Iterable[BaseModel]],
               parts: Callable[[Choice, Delta], Iterable[BaseModel]]) -> SSEResponse:
        """The streamed answer: each of `opening(choice)`, then each of `parts(choice, delta)` as
        deltas come, one chunk (a `chunk_model`) each."""
        s = self.serving
        created = int(time.time())

        def chunk(choices: list[BaseModel], usage: Usage | None = None) -> str:
            return chunk_model(id=self.id, created=created, model=s.model_name, choices=choices, usage=usage).sse()

        async def events() -> AsyncGenerator[str, None]:
            for c in self.choices:
                for part in opening(c):
                    yield chunk([part])
            async for c, d in self._drive():
                for part in parts(c, d):
                    yield chunk([part])

        include_usage = self.req.stream_options is not None and self.req.stream_options.include_usage
        return SSEResponse(self._framed(events(), (lambda usage: chunk([], usage)) if include_usage else None),
                           s.stream_stall_timeout_s)

    def _drive(self):
        """The choices' deltas as they come (`Serving.drive`)."""
        return self.serving.drive(self.fan, self.first, self.choices, self.arrived, self.caller)

    def _record(self):
        """The request counted (`Serving.record`): its (prompt, completion, cached) tokens."""
        return self.serving.record(self.prompts, self.choices, self.arrived, self.caller)

    async def _framed(self, events: AsyncGenerator[str, None],
                      usage_chunk: Callable[[Usage], str] | None) -> AsyncGenerator[str, None]:
        """`events`, then `usage_chunk(usage)` if given, then [DONE]; a fault as an error event,
        then [DONE]; the engine requests closed and the request counted once, however it ends."""
        counted = False
        try:
            async for event in events:
                yield event
            usage = Usage.of(*self._record())
            counted = True
            if usage_chunk is not None:
                yield usage_chunk(usage)
            yield DONE
        except APIError as e:  # the request's own limit (a 408 past its deadline)
            yield f"data: {e.response().body.decode()}\n\n"
            yield DONE
        except Exception as e:
            log.exception("request %s failed while streaming", self.request_id)
            yield f"data: {fault(self.request_id, e).response().body.decode()}\n\n"
            yield DONE
        finally:
            await events.aclose()
            await self.fan.close()
            if not counted:
                self._record()

    async def whole(self, client_gone: Callable[[], Awaitable[None]], body_model: Callable[..., BaseModel],
                    part: Callable[[Choice], BaseModel]) -> Response:
        """The answer as one body (a `body_model`) of `part(choice)` for every choice, or a 499
        if the client went away first."""
        s = self.serving
        if not await self._collect(client_gone):
            self._record()
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        usage = Usage.of(*self._record())
        body = body_model(id=self.id, model=s.model_name, usage=usage, choices=[part(c) for c in self.choices])
        return JSONResponse(body.model_dump(mode="json"))

    async def _collect(self, client_gone: Callable[[], Awaitable[None]]) -> bool:
        """Runs every choice to its end. False if the client went away first: its engine
        requests are then aborted."""
        async def consume() -> None:
            async for _ in self._drive():
                pass

        work, gone = asyncio.ensure_future(consume()), asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
            await self.fan.close()
        if work.cancelled():
            return False
        work.result()  # raises what the engine raised
        return True
