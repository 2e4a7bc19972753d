"""The threads that do requests' pre-engine work (render the template, tokenize), shared fairly.

Rendering and tokenizing take CPU time linear in a request's size (bounded by `APILimits`), so
they run off the event loop, in this pool's own threads: never the process's default executor,
which others share. The rules:

- At most `threads` jobs hold a thread at once, a request one job at a time; requests wait for
  a thread in arrival order.
- A request that waited `wait_s` for a thread gets a 503 with Retry-After: the server is busy,
  the request is fine, retry it.
- A request whose client leaves stops waiting at once (a 499 for the logs). A job already
  running is told to stop (its `stop` event is set) and ends at its next check, between two
  renders or before tokenizing (`Abandoned`); its thread counts as taken until the job has
  ended, so abandoned work never runs beside `threads` other jobs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from cluster.api.errors import APIError, client_closed

T = TypeVar("T")


class Abandoned(Exception):
    """Raised inside a job whose client has left."""


def check(stop: threading.Event | None) -> None:
    """A job's check between its steps: ends the job if its client has left."""
    if stop is not None and stop.is_set():
        raise Abandoned


class PrepPool:
    def __init__(self, threads: int, wait_s: float):
        self.threads, self.wait_s = threads, wait_s
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cairn-prepare")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free = asyncio.Semaphore(threads)  # free threads, counted in the loop that serves

    async def run(self, job: Callable[[threading.Event], T], client_gone: Callable[[], Awaitable[None]]) -> T:
        """`job(stop)` on a pool thread; its result, or what it raised. Raises a 499 APIError
        when the client leaves first, a 503 when no thread came free within `wait_s`."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (a test client's): the old one's jobs are over
            self._loop, self._free = loop, asyncio.Semaphore(self.threads)
        free = self._free
        gone = asyncio.ensure_future(client_gone())
        gone.add_done_callback(_retrieve)
        stop = threading.Event()
        try:
            await self._take_thread(free, gone)
            done = asyncio.wrap_future(self._executor.submit(_run, job, stop, loop, free))
            done.add_done_callback(_retrieve)  # an abandoned job's Abandoned is nobody's news
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
            if done.done():
                return done.result()
            raise client_closed()
        finally:
            stop.set()  # a no-op for a finished job; ends one whose client left
            gone.cancel()

    async def _take_thread(self, free: asyncio.Semaphore, gone: asyncio.Future) -> None:
        take = asyncio.ensure_future(free.acquire())
        try:
            await asyncio.wait({take, gone}, timeout=self.wait_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled from outside: give back what may have been taken
            _give_back(take, free)
            raise
        if gone.done() or not take.done():
            _give_back(take, free)
            if gone.done():
                raise client_closed()
            raise APIError(503, f"the server is busy: no thread came free to prepare this request within "
                                f"{self.wait_s:g} s; retry later", code="server_busy", headers={"Retry-After": "1"})


def _run(job: Callable[[threading.Event], T], stop: threading.Event, loop: asyncio.AbstractEventLoop,
         free: asyncio.Semaphore) -> T:
    try:
        return job(stop)
    finally:
        try:
            loop.call_soon_threadsafe(free.release)
        except RuntimeError:  # the loop has closed: nobody waits for this thread any more
            pass


def _give_back(take: asyncio.Future, free: asyncio.Semaphore) -> None:
    """A thread that was taken goes back; a wait for one is cancelled (the semaphore then passes
    on a thread it had just handed over)."""
    if not take.done():
        take.cancel()
    elif not take.cancelled() and take.exception() is None:
        free.release()


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
