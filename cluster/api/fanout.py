"""The engine streams of one HTTP request (n choices, several prompts) read as one.

`Fanout(client, requests)` starts every request at once and yields `(index, RequestOutput)`
in arrival order until each stream has finished. An error from any stream is raised to the
reader (a `workers.RequestRejected` first of all: the engine refused the request). `close(i)` ends one
stream early (a stop string matched); `close()` ends them all (client gone, response done).
Closing a stream that has not finished aborts its engine request, so its pages and state slot
go back to the pools; closing is safe to repeat.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from cluster.api.engine_client import EngineClient, GenerateRequest
from workers import RequestOutput

_DONE = object()


class Fanout:
    def __init__(self, client: EngineClient, requests: Sequence[GenerateRequest]):
        self._client = client
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(requests)
        self._tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(requests)]

    async def _pump(self, index: int, request: GenerateRequest) -> None:
        stream = self._client.generate(request)
        try:
            async for out in stream:
                self._queue.put_nowait((index, out))
        except Exception as e:  # handed to the reader, who decides what the client sees
            self._queue.put_nowait((index, e))
        finally:
            await stream.aclose()
            self._queue.put_nowait((index, _DONE))

    def __aiter__(self) -> "Fanout":
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while self._open:
            index, item = await self._queue.get()
            if item is _DONE:
                self._open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    async def close(self, index: int | None = None) -> None:
        tasks = self._tasks if index is None else [self._tasks[index]]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
