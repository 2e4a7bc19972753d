"""The threads that do requests' pre-engine work (render the template, tokenize), shared fairly.

Rendering and tokenizing take CPU time linear in a request's size (bounded by `APILimits`), so
they run off the event loop, in this pool's own threads: never the process's default executor,
which others share. The rules:

- At most `threads` jobs hold a thread at once, a request one job at a time. A tenant (with
  keys; without them everyone is one tenant, who may hold them all) holds at most `per_tenant`
  (half the threads by default), so another tenant's request always finds one soon. A thread
  that comes free goes to the waiting tenant below its share holding the fewest, to its
  longest waiting request.
- A request that waited `wait_s` for a thread gets a 503 with Retry-After: the server is busy,
  the request is fine, retry it.
- A request whose client leaves stops waiting at once (a 499 for the logs). A job already
  running is told to stop (its `stop` event is set) and ends at its next check, between two
  renders or before tokenizing (`Abandoned`); its thread counts as taken until the job has
  ended, so abandoned work never runs beside `threads` other jobs.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from cairn.cluster.api.api_errors import APIError, client_closed

T = TypeVar("T")
_arrivals = itertools.count()


class Abandoned(Exception):
    """Raised inside a job whose client has left."""


def check(stop: threading.Event | None) -> None:
    """A job's check between its steps: ends the job if its client has left."""
    if stop is not None and stop.is_set():
        raise Abandoned


class PrepPool:
    def __init__(self, threads: int, wait_s: float, per_tenant: int | None = None):
        self.threads, self.wait_s = threads, wait_s
        self.per_tenant = per_tenant or max(1, threads // 2)
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cairn-prepare")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generation = 0
        self._free, self._held, self._waiting = threads, {}, {}

    def _cap(self, tenant: str | None) -> int:
        return self.threads if tenant is None else self.per_tenant

    async def run(self, job: Callable[[threading.Event], T], client_gone: Callable[[], Awaitable[None]],
                  tenant: str | None = None) -> T:
        """`job(stop)` on a pool thread; its result, or what it raised. Raises a 499 APIError
        when the client leaves first, a 503 when no thread came free within `wait_s`. `tenant`
        (None: no keys) holds at most its share of the threads."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop (a test client's): the old one's jobs are over
            self._loop, self._generation = loop, self._generation + 1
            self._free, self._held, self._waiting = self.threads, {}, {}
        gone = asyncio.ensure_future(client_gone())
        gone.add_done_callback(_retrieve)
        stop = threading.Event()
        try:
            await self._take_thread(tenant, gone)
            give = functools.partial(self._give, self._generation, tenant)
            done = asyncio.wrap_future(self._executor.submit(_run, job, stop, loop, give))
            done.add_done_callback(_retrieve)  # an abandoned job's Abandoned is nobody's news
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
            if done.done():
                return done.result()
            raise client_closed()
        finally:
            stop.set()  # a no-op for a finished job; ends one whose client left
            gone.cancel()

    async def _take_thread(self, tenant: str | None, gone: asyncio.Future) -> None:
        if self._free > 0 and self._held.get(tenant, 0) < self._cap(tenant):  # waiters, if any, are at their caps
            self._grant(tenant)
            return
        take = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append((next(_arrivals), take))
        try:
            await asyncio.wait({take, gone}, timeout=self.wait_s, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled from outside: give back what may have been taken
            self._give_back(tenant, take)
            raise
        if gone.done() or not take.done():
            self._give_back(tenant, take)
            if gone.done():
                raise client_closed()
            raise APIError(503, f"the server is busy: no thread came free to prepare this request within "
                                f"{self.wait_s:g} s; retry later", code="server_busy", headers={"Retry-After": "1"})

    def _grant(self, tenant: str | None) -> None:
        self._free -= 1
        self._held[tenant] = self._held.get(tenant, 0) + 1

    def _give(self, generation: int, tenant: str | None) -> None:
        """A thread comes free (on the loop): it goes to the waiting tenant below its cap that
        holds the fewest threads, to its longest waiting request."""
        if generation != self._generation:
            return
        self._free += 1
        self._held[tenant] -= 1
        while self._free > 0:
            best = None
            for who, queue in self._waiting.items():
                while queue and queue[0][1].done():  # given up waiting
                    queue.popleft()
                if queue and self._held.get(who, 0) < self._cap(who):
                    key = (self._held.get(who, 0), queue[0][0])
                    if best is None or key < best[0]:
                        best = (key, who)
            if best is None:
                return
            who = best[1]
            _, take = self._waiting[who].popleft()
            self._grant(who)
            take.set_result(None)

    def _give_back(self, tenant: str | None, take: asyncio.Future) -> None:
        """A waiter that stops waiting: a thread it was handed goes back; else it leaves the queue."""
        if take.done() and not take.cancelled():
            self._give(self._generation, tenant)
        else:
            take.cancel()


def _run(job: Callable[[threading.Event], T], stop: threading.Event, loop: asyncio.AbstractEventLoop,
         give: Callable[[], None]) -> T:
    try:
        return job(stop)
    finally:
        try:
            loop.call_soon_threadsafe(give)
        except RuntimeError:  # the loop has closed: nobody waits for this thread any more
            pass


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
