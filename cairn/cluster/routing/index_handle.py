"""The cache index actor as every user in the cluster reaches it: `IndexHandle`.

The engine replica's event publisher (`cairn.cache_service.publisher.EventPublisher`) and the router
(`cairn.cluster.routing.router`: remote scoring, the mirror's change feed, dropping a dead replica)
both hold one. Its rules:
- Finding the actor (`cairn.cache_service.actor.index_actor`: the cluster's named, detached actor,
  created by whoever asks first) is blocking Ray work: it runs in a thread (`asyncio.to_thread`),
  never on the event loop. Nothing here blocks a loop; `current()` never waits.
- One lookup at a time, shared by every caller waiting for it. A failed lookup is logged and
  tried again no sooner than `retry_s` later; meanwhile calls raise `IndexUnavailable` at once.
- A restarting actor (Ray restarts it, `max_restarts=-1`) keeps its handle. An actor that died
  for good (`ActorDiedError`: killed with no restart) is forgotten and its successor looked up at
  once, which creates it if no one has yet; the call that met the dead actor still fails, and its
  caller treats that as it treats any failure (the publisher resends, the router falls back).
- A successor that dies before it ever answered (its creation failed: say its Redis is down) is
  not replaced at once: the next lookup waits `retry_s`, doubling with each such death up to
  MAX_RETRY_S. Replacing it at once would start an actor process a second, from every replica
  and router, for as long as the cause lasts.
- Without a connected Ray (a unit test) there is no index, unless `actor` or `find` is given:
  nothing here starts Ray.
A handle serves one event loop: the loop of its first lookup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError

from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.cluster.routing.ranker import IndexUnavailable

logger = logging.getLogger(__name__)


class IndexHandle:
    RETRY_S = 5.0
    MAX_RETRY_S = 60.0

    def __init__(self, config: RoutingConfig, *, actor: Any = None, find: Callable[[], Any] | None = None,
                 retry_s: float = RETRY_S):
        """`config` names the actor (and what to create it with); `actor`: one already found;
        `find`: a blocking lookup to use instead of `index_actor` (tests)."""
        self.config, self._actor, self._find, self._retry_s = config, actor, find, retry_s
        self._lookup: asyncio.Task | None = None
        self._retry_at = float("-inf")
        self._error: Exception | None = None  # why the last lookup failed
        self._answered = actor is not None  # the actor held answered a call (one given is vouched for)
        self._stillborn = 0  # actors in a row that died before answering

    def current(self) -> Any | None:
        """The actor handle, or None while it is not found; then a lookup starts in the
        background (when called on a running loop and no retry is pending). Never waits."""
        if self._actor is None:
            self._start_lookup()
        return self._actor

    async def get(self) -> Any:
        """The actor handle, waiting for the lookup under way (or one started now);
        IndexUnavailable if that lookup fails, or a failed one is not due to be retried yet."""
        if self._actor is None:
            lookup = self._start_lookup()
            if lookup is not None:
                await asyncio.shield(lookup)  # a caller that stops waiting leaves it running
        if self._actor is None:
            raise IndexUnavailable(f"cache index actor {self.config.index_actor_name} not found"
                                   + (f": {self._error}" if self._error else ""))
        return self._actor

    async def call(self, method: str, *args: Any) -> Any:
        """Awaits the actor's `method(*args)` (Ray's `actor.method.remote`). After ActorDiedError
        the actor is forgotten, its successor looked up, and the error raised."""
        actor = await self.get()
        try:
            answer = await getattr(actor, method).remote(*args)
        except ActorDiedError as e:
            self.lost(actor, e)
            raise
        if actor is self._actor:
            self._answered, self._stillborn = True, 0
        return answer

    def call_nowait(self, method: str, *args: Any) -> bool:
        """Sends the call without awaiting its answer; False if no actor is known (nothing sent)."""
        actor = self.current()
        if actor is None:
            return False
        getattr(actor, method).remote(*args)
        return True

    def lost(self, actor: Any, why: Exception | None = None) -> None:
        """`actor` died for good: forget it, unless a successor took its place already, and look
        the successor up: now, or after the delay if it died before it ever answered."""
        if self._actor is not actor:
            return
        self._actor, self._retry_at = None, float("-inf")
        if not self._answered:
            self._stillborn += 1
            delay = min(self.MAX_RETRY_S, self._retry_s * 2 ** (self._stillborn - 1))
            self._error, self._retry_at = why, time.monotonic() + delay
            logger.warning("cache index actor %s died before it answered (%d in a row; %s); looking again in "
                           "%.0f s", self.config.index_actor_name, self._stillborn, _first_line(why), delay)
        self._start_lookup()

    def _start_lookup(self) -> asyncio.Task | None:
        if self._lookup is None and self._actor is None and time.monotonic() >= self._retry_at \
                and (self._find is not None or ray.is_initialized()):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop to run it on (a synchronous caller): the next caller starts it
                return None
            self._lookup = loop.create_task(self._look_up())
        return self._lookup

    async def _look_up(self) -> None:
        try:
            self._actor = await asyncio.to_thread(self._find or self._find_in_ray)
            self._error, self._answered = None, False
        except Exception as e:
            self._error, self._retry_at = e, time.monotonic() + self._retry_s
            logger.warning("cache index actor %s not found (%s); trying again in %.0f s",
                           self.config.index_actor_name, e, self._retry_s)
        finally:
            self._lookup = None

    def _find_in_ray(self) -> Any:
        from cairn.cache_service.actor import index_actor

        cfg = self.config
        return index_actor(cfg.index_actor_name, cfg.index_actor_namespace, cfg.redis_url, cfg.namespace,
                           cfg.index_max_pages)


def _first_line(error: Exception | None) -> str:
    return str(error).strip().splitlines()[0] if error is not None and str(error).strip() else repr(error)
