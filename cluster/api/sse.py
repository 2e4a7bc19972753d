"""Server-sent events that always end their source: `SSEResponse`.

Starlette stops reading a streaming body when the client goes away (the task is cancelled,
or a send fails) but leaves the async generator suspended until garbage collection. Closing it
here, whatever happened, runs its `finally` at once, and that is where an engine request is
aborted and its pages freed.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
