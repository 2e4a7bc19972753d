"""The cache-affinity routers of this process: one registry, shared by the routers and the ingress.

A router (`cairn.cluster.routing.router.CacheAffinityRouter`) runs inside the process that calls the
engine deployment, the ingress, on a loop of Serve's choosing. It registers its ranker here when it
starts on that loop (when Serve creates it there, else at its first request), with its index
mirror if it keeps one; the ingress, in the same process, reports each request's first output
(`prefill_done`), reads the routers' counters for /metrics (`router_counts`) and, for operators
and tests, what each router's mirror holds (`mirror_summaries`).

Why a module of its own: Serve ships the router class by value. `RequestRouterConfig` imports the
class path's module, registers it with `cloudpickle.register_pickle_by_value`, pickles the class
and, in the caller's process, unpickles it (ray/serve/config.py, `_serialize_request_router_cls`
and `get_request_router_class`). The class and the functions of that module are rebuilt there
with globals of their own, so state kept at module level in cairn/cluster/routing/router.py would be a
copy the ingress never sees. This module is imported by reference (not registered, not under a
registered package): the router reaches it through its functions, never through a module-level
object (an instance would be pickled by value too). Plain Python, thread-safe.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, NamedTuple


class _Registered(NamedTuple):
    loop: asyncio.AbstractEventLoop  # the router's loop, where its ranker and its mirror are used
    mirror: Any                      # its cairn.cache_service.feed.IndexMirror, or None (remote mode)
    deployment: str                  # the deployment it routes to


_ROUTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ranker -> _Registered
_LOCK = threading.Lock()
SUMMARY_TIMEOUT_S = 30.0  # a router's loop that does not run a summary within this is reported as such


def register_router(ranker: Any, loop: asyncio.AbstractEventLoop, mirror: Any = None, deployment: str = "") -> None:
    """Called by a router on its loop: first outputs are reported to `ranker` there, and `mirror`
    (its index mirror, if it keeps one) is read there. A ranker leaves the registry when it is
    garbage collected."""
    with _LOCK:
        _ROUTERS[ranker] = _Registered(loop, mirror, deployment)


def router_counts() -> dict[str, float]:
    """The counters of this process's routers, summed, as `router_<name>_total` metrics (requests
    ranked and routed, index fallbacks by reason), and their gauges (the index mirror's size and
    age) as `router_<name>` (ages: the largest), for the ingress's /metrics."""
    with _LOCK:
        rankers = list(_ROUTERS)
    totals: dict[str, float] = {}
    for ranker in rankers:
        for name, n in ranker.counts.items():
            totals[f"router_{name}_total"] = totals.get(f"router_{name}_total", 0) + n
        for name, value in ranker.gauges().items():
            key = f"router_{name}"
            totals[key] = max(totals.get(key, value), value) if name.endswith("_age_seconds") else \
                totals.get(key, 0) + value
    return totals


def prefill_done(engine_request_id: str) -> None:
    """Thread-safe: the request produced its first output, so the routers of this process stop
    counting its prefill tokens as load on its replica (`AffinityRanker.on_prefill_done`, run on
    each router's own loop)."""
    with _LOCK:
        routers = list(_ROUTERS.items())
    for ranker, registered in routers:
        try:
            registered.loop.call_soon_threadsafe(ranker.on_prefill_done, engine_request_id)
        except RuntimeError:  # its loop is closed: the router is gone
            pass


async def mirror_summaries() -> list[dict[str, Any]]:
    """For each router of this process that keeps an index mirror: the deployment it routes to,
    the index actor it mirrors, its ranker's `counts` (requests ranked, index fallbacks by reason)
    and its mirror's `IndexMirror.summary()` (or `error`), read on the router's own loop, where
    the mirror changes (a snapshot is never seen half-swapped; see the summary for a chunk being
    applied). Reads every entry of every mirror: for operators and tests, not for the request
    path."""
    with _LOCK:
        routers = [(ranker, r) for ranker, r in _ROUTERS.items() if r.mirror is not None]

    async def on_its_loop(summary: Any) -> Any:
        return summary()

    out = []
    for ranker, registered in routers:
        entry: dict[str, Any] = dict(deployment=registered.deployment, index=ranker.config.index_actor_name,
                                     counts=dict(ranker.counts))
        try:
            running = asyncio.run_coroutine_threadsafe(on_its_loop(registered.mirror.summary), registered.loop)
            entry.update(await asyncio.wait_for(asyncio.wrap_future(running), SUMMARY_TIMEOUT_S))
        except RuntimeError as e:  # its loop is closed: the router is gone
            entry["error"] = repr(e)
        except asyncio.TimeoutError:
            entry["error"] = f"its loop did not run the summary within {SUMMARY_TIMEOUT_S} s"
        out.append(entry)
    return out
