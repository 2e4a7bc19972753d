"""Server-sent events that always end their source, and never wait forever on their client: `SSEResponse`.

Starlette stops reading a streaming body when the client goes away (the task is cancelled,
or a send fails) but leaves the async generator suspended until garbage collection. Closing it
here, whatever happened, runs its `finally` at once, and that is where an engine request is
aborted and its pages freed.

A client that stops reading but keeps its connection open fills the socket's buffers, and then
a send waits. A send that has waited `stall_timeout_s` (`HTTPLimits.stream_stall_timeout_s`)
ends the stream: the events are closed (their engine requests aborted, their sequences freed)
and the response is left unfinished, so the server closes the connection. Where the app's
sends do not wait (behind Ray Serve's proxy, which buffers every message), this never fires.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import anyio._backends._asyncio  # noqa: F401  (see below)
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

# Starlette streams through anyio's task groups, and anyio imports its asyncio backend when the
# first one is made: about 170 ms of imports on the event loop, which the first streamed request
# of a server paid in its time to first token. Imported with this module instead, at startup.

log = logging.getLogger("cairn.cluster.api")


class StreamStalled(Exception):
    """The client took no output for the stall timeout."""


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], stall_timeout_s: float | None = None):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events, self.stall_timeout_s = events, stall_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.stall_timeout_s

        async def timed_send(message: Message) -> None:
            try:
                async with asyncio.timeout(limit):
                    await send(message)
            except TimeoutError:
                raise StreamStalled from None

        try:
            await super().__call__(scope, receive, send if limit is None else timed_send)
        except* StreamStalled:
            log.warning("a streamed response's client took no output for %g s: the stream is ended", limit)
        finally:
            await self._events.aclose()
