"""The engine streams of one HTTP request (n choices, several prompts) read as one.

`Fanout(client, requests)` starts every request at once and yields `(index, RequestOutput)`
in arrival order until each stream has finished. An error from any stream is raised to the
reader (a `workers.RequestRejected` first of all: the engine refused the request). `close(i)` ends one
stream early (a stop string matched); `close()` ends them all (client gone, response done).
Closing a stream that has not finished aborts its engine request, so its pages and state slot
go back to the pools; closing is safe to repeat. With an `admission` (`cairn.cluster.api.quotas`), each
engine request is counted as started at its first output and as ended when its stream ends,
however it ends, closed before it ran included.

Each stream holds at most `BUFFERED` outputs the reader has not taken: past that it stops reading
its engine stream until the reader catches up, so a reader that falls behind (a client that does
not read its response) is held in a bounded buffer here and, in-process, pauses its engine
requests (`cairn.workers.engine_front`) instead of filling memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from cairn.cluster.api.engine_client import EngineClient
from cairn.cluster.api.quotas import Admission
from cairn.workers import RequestOutput
from cairn.workers.request import GenerateRequest

_DONE = object()


class Fanout:
    BUFFERED = 16  # outputs of one stream the reader has not taken

    def __init__(self, client: EngineClient, requests: Sequence[GenerateRequest], admission: Admission | None = None):
        self._client, self._admission = client, admission
        self._queue: asyncio.Queue = asyncio.Queue()
        self._room = [asyncio.Semaphore(self.BUFFERED) for _ in requests]
        self._open = len(requests)
        self._tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(requests)]

    async def _pump(self, index: int, request: GenerateRequest) -> None:
        stream, admission, room = self._client.generate(request), self._admission, self._room[index]
        try:
            async for out in stream:
                if admission is not None:
                    admission.started(index)
                await room.acquire()  # given back when the reader takes it
                self._queue.put_nowait((index, out))
        except Exception as e:  # handed to the reader, who decides what the client sees
            self._queue.put_nowait((index, e))
        finally:
            await stream.aclose()
            if admission is not None:
                admission.ended(index)
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
                self._room[index].release()
                return index, item
        raise StopAsyncIteration

    async def close(self, index: int | None = None) -> None:
        tasks = self._tasks if index is None else [self._tasks[index]]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._admission is not None:  # a task cancelled before it ran never reached its finally
            for i in range(len(self._tasks)) if index is None else [index]:
                self._admission.ended(i)
