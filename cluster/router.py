"""Cache-affinity routing: send each request to the replica where it recomputes the least.

Per request the router reads the cache index's scores and ranks replicas by cost in tokens
(design rule 4). How it reads them is `index_mode`:
- mirror (default): from its own copy of the index (cache_service.feed.IndexMirror), which a
  background task keeps following the index actor's change feed (a long poll, never on the
  request path). Scoring costs no round trip; a mirror not heard from for `index_staleness_s`
  counts as unavailable.
- remote: it awaits the actor's `score` per request (never a blocking ray.get; at most
  `index_timeout_ms`).
Cost:
    cost = prefill tokens left after the resume point + load_weight * load tokens
- resume point: `cache_service.scoring.resume_at_token` of the replica's score (for a hybrid
  model its deepest state checkpoint under the page hit: pages without a usable state count for
  nothing; for an attention-only model the page hit itself);
- load tokens: the prefill tokens left of requests this router has in flight there (a request's
  prefill counts until the ingress sees its first output: `cluster.app.prefill_done`), plus
  `request_load_tokens` per in-flight request (the larger of this router's count and the
  replica's reported running + waiting), plus `occupancy_load_tokens` times the fraction of its
  pages or state slots in use (reported through record_routing_stats, see `routing_stats`).
A replica with `spill_limit` more in-flight requests than the least-loaded one ranks after all
others, so a hot prefix spills over instead of piling onto one replica. Ties break at random.
A request counts as in flight on the replica it ranked first from the moment it is ranked until
Serve reports where it went (`on_request_routed`; at most `TENTATIVE_TTL_S`): a burst of
requests ranked at once, each awaiting the index, sees the others instead of all taking the
same "least loaded" replica.
Right after routing, the chosen replica is the predicted holder of the prompt's pages (and a
state at their end) for `predicted_holder_ttl_s`, so a burst sharing a new prefix sticks
together before the replica's events reach the index. Index down, slow or not yet found: the
request is ranked by load and by what this router remembers sending where (the last
`fallback_memory_s`, at most `fallback_memory_pages` hashes), so a conversation's next turn
still finds its replica; `cairn_router_index_fallbacks_total` counts it, and routing never
fails because of the index. The memory is a guess (it cannot see evictions), which is why it
stands in only while the index is unavailable.

The ranking (`rank_replicas`, `PredictedHolders`, `AffinityRanker`) is plain Python, tested
without Ray; `CacheAffinityRouter` is the thin Ray Serve adapter. Replica identity everywhere
(events, index, routing) is `replica_worker_id(replica_id)`, the full Serve replica id string,
which the router (RunningReplica.replica_id) and the replica (serve.get_replica_context()
.replica_id) both produce.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cache_service.feed import IndexMirror
from cache_service.scoring import resume_at_token
from cluster.routing_config import RoutingConfig

logger = logging.getLogger(__name__)

Score = tuple[int, int]  # (hit_pages, state_pages), as the index actor answers
# the index's scores for a prompt's page hashes: awaited (remote, with the timeout) or local
ScoreFn = Callable[[list[bytes]], Awaitable[Mapping[str, Score]] | Mapping[str, Score]]


class RoutingRequest(Protocol):
    """What the router reads from the engine deployment call's first argument.
    page_hashes: one per whole prompt page (cache_service.hashing), None or [] for none.
    num_prompt_tokens: prompt length in tokens (else len(prompt_token_ids) is used).
    prompt / messages: the text, read only by the ray_prefix policy."""
    page_hashes: list[bytes] | None
    num_prompt_tokens: int
    prompt: str | None
    messages: list | None


def replica_worker_id(replica_id: ReplicaID) -> str:
    """The worker id a replica reports events under and the index scores by."""
    return replica_id.to_full_id_str()


def routing_stats(engine_metrics: Mapping[str, float], max_num_seqs: int) -> dict[str, float]:
    """What an engine replica's record_routing_stats() returns, from `Engine.metrics()`: pages
    held by running requests and state slots in use (one per running sequence), with totals."""
    m = engine_metrics
    return dict(running_requests=m.get("running_requests", 0), waiting_requests=m.get("waiting_requests", 0),
                pages_in_use=m.get("pages_held", 0), pages_total=m.get("pages_total", 0),
                states_in_use=m.get("running_requests", 0), states_total=max_num_seqs)


@dataclass
class ReplicaLoad:
    requests: int = 0           # in flight from this router
    tokens: int = 0             # prefill tokens those requests cost there
    reported_requests: int = 0  # running + waiting, as the replica last reported
    occupancy: float = 0.0      # fraction of its pages or state slots in use, as reported


def reported_load(own: ReplicaLoad | None, stats: Mapping[str, Any] | None) -> ReplicaLoad:
    own, stats = own or ReplicaLoad(), stats or {}

    def fraction(used: str, total: str) -> float:
        try:
            return min(1.0, max(0.0, float(stats.get(used, 0)) / float(stats[total])))
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return 0.0
    try:
        reported = int(stats.get("running_requests", 0)) + int(stats.get("waiting_requests", 0))
    except (TypeError, ValueError):
        reported = 0
    return ReplicaLoad(own.requests, own.tokens, reported,
                       max(fraction("pages_in_use", "pages_total"), fraction("states_in_use", "states_total")))


def load_tokens(load: ReplicaLoad, config: RoutingConfig) -> float:
    requests = max(load.requests, load.reported_requests)
    return load.tokens + config.request_load_tokens * requests + config.occupancy_load_tokens * load.occupancy


def rank_replicas(replicas: Sequence[str], scores: Mapping[str, Score], loads: Mapping[str, ReplicaLoad],
                  config: RoutingConfig, num_prompt_tokens: int, rng: random.Random | None = None) -> list[str]:
    """Replica ids, cheapest first; spilled replicas (see module doc) after all others."""
    rng = rng or random
    empty = ReplicaLoad()
    busy = {r: max(loads.get(r, empty).requests, loads.get(r, empty).reported_requests) for r in replicas}
    least = min(busy.values(), default=0)

    def key(r: str) -> tuple[bool, float, float]:
        resume = resume_at_token(*scores.get(r, (0, 0)), num_prompt_tokens, config.page_size, config.hybrid_model)
        cost = num_prompt_tokens - resume + config.load_weight * load_tokens(loads.get(r, empty), config)
        return busy[r] - least >= config.spill_limit, cost, rng.random()
    return sorted(replicas, key=key)


class PredictedHolders:
    """What this router sent where: each replica recently sent a prompt is taken to hold its pages
    (and a state at their end). A hash names its whole prefix, so a replica's predicted depth for a
    prompt is the deepest of its hashes recorded for that replica. Records are kept for
    `keep_s` (at most `max_hashes` hashes in all, oldest dropped first); `pages` reads only those
    younger than the age it is given: the fresh ones (the index has not heard of them yet) or,
    when the index cannot answer, everything remembered. One flat dict per replica (hash -> time
    last recorded), so a large memory is a handful of objects for the garbage collector."""

    def __init__(self, keep_s: float, clock: Callable[[], float] = time.monotonic, max_hashes: int = 1_000_000):
        self.keep_s, self._clock, self._max = keep_s, clock, max_hashes
        self._at: dict[str, dict[bytes, float]] = {}  # replica -> hash -> when last recorded
        self._log: deque[tuple[float, str, list[bytes]]] = deque()
        self._size, self._last = 0, float("-inf")

    def record(self, replica: str, page_hashes: Sequence[bytes]) -> None:
        if self.keep_s <= 0 or not page_hashes or self._max <= 0:
            return
        at = self._last = max(self._clock(), math.nextafter(self._last, math.inf))  # distinct: a record's identity
        held = self._at.setdefault(replica, {})
        for h in page_hashes:
            held[h] = at
        self._log.append((at, replica, list(page_hashes)))
        self._size += len(page_hashes)
        self._purge()

    def pages(self, page_hashes: Sequence[bytes], max_age_s: float) -> dict[str, int]:
        """replica -> predicted hit pages for this prompt from records younger than `max_age_s`
        (absent: none). A record holds every page of its prompt and a newer one overwrites the
        time, so a replica's fresh pages along a prompt are a prefix of it: its depth is found
        by bisection, O(replicas x log pages)."""
        self._purge()
        if not page_hashes:
            return {}
        since, out = self._clock() - max_age_s, {}
        for replica, held in self._at.items():
            at = held.get(page_hashes[0])
            if at is None or at <= since:
                continue
            lo, hi = 1, len(page_hashes)  # fresh at depth lo; not beyond hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                at = held.get(page_hashes[mid - 1])
                if at is not None and at > since:
                    lo = mid
                else:
                    hi = mid - 1
            out[replica] = lo
        return out

    def forget(self, replica: str) -> None:
        self._at.pop(replica, None)  # its log entries are skipped as they age out

    def _purge(self) -> None:
        since = self._clock() - self.keep_s
        while self._log and (self._log[0][0] <= since or self._size > self._max):
            at, replica, hashes = self._log.popleft()
            self._size -= len(hashes)
            held = self._at.get(replica)
            if held is None:
                continue
            for h in hashes:
                if held.get(h) == at:
                    del held[h]
            if not held:
                del self._at[replica]


def prompt_tokens(request: Any, page_size: int) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if isinstance(n, int):
        return n
    ids = getattr(request, "prompt_token_ids", None)
    if ids is not None:
        return len(ids)
    return len(getattr(request, "page_hashes", None) or ()) * page_size


class IndexUnavailable(RuntimeError):
    """The router has no handle to the index actor (yet), or its mirror of the index is stale."""


class AffinityRanker:
    """The router's state and decisions, without Ray: in-flight accounting, predicted holders,
    the index call with its timeout and fallback, and the counters the adapter exports.
    After `BREAKER_FAILURES` index failures in a row the index is skipped for
    `BREAKER_COOLDOWN_S` (then tried again), so a dead index costs no routing latency."""

    BREAKER_FAILURES, BREAKER_COOLDOWN_S = 3, 1.0
    MIN_PREDICTED_HASHES = 10_000  # the fresh predictions work even with fallback_memory_pages 0
    TENTATIVE_TTL_S = 5.0  # a ranked request Serve never reports as routed (cancelled) stops counting

    def __init__(self, config: RoutingConfig, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, on_fallback: Callable[[str], None] | None = None):
        if config.page_size is None or config.hybrid_model is None:
            raise ValueError("the routing config lacks the engines' page_size and hybrid_model: "
                             "use RoutingConfig.for_engines(spec) (build_application does)")
        self.config, self._clock, self._rng, self._on_fallback = config, clock, rng or random.Random(), on_fallback
        self.predicted = PredictedHolders(max(config.predicted_holder_ttl_s, config.fallback_memory_s), clock,
                                          max(config.fallback_memory_pages, self.MIN_PREDICTED_HASHES))
        self.loads: dict[str, ReplicaLoad] = {}
        self._in_flight: dict[tuple[str, str], int] = {}  # (replica, request id) -> prefill tokens left
        self._engine_ids: dict[str, tuple[str, str]] = {}  # the request's own id -> (replica, request id)
        self._prefill: OrderedDict[str, dict[str, int]] = OrderedDict()  # request id -> replica -> tokens
        # ranked, not yet routed: request id -> (replica ranked first, its prefill tokens, expiry)
        self._tentative: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._failures, self._skip_index_until = 0, float("-inf")
        self.counts = dict(ranked=0, routed=0, index_fallbacks=0, index_timeouts=0, index_errors=0, index_skipped=0,
                           index_unavailable=0)
        self.gauges: Callable[[], dict[str, float]] = lambda: {}  # set by the adapter (its mirror's)

    async def rank(self, request_id: str, request: Any, replicas: Mapping[str, Mapping[str, Any] | None],
                   score: ScoreFn) -> list[str]:
        """Replica ids best first, for the request; `replicas` maps each candidate to its
        reported routing stats."""
        cfg, self.counts["ranked"] = self.config, self.counts["ranked"] + 1
        hashes = list(getattr(request, "page_hashes", None) or ())
        n = prompt_tokens(request, cfg.page_size)
        self._tentative.pop(request_id, None)  # ranked again (a retry): its earlier pick no longer stands
        scores = await self._scores(hashes, score) if hashes else {}
        loads = {r: reported_load(self._own_load(r), stats) for r, stats in replicas.items()}
        order = rank_replicas(list(replicas), scores, loads, cfg, n, self._rng)
        prefill = {r: n - resume_at_token(*scores.get(r, (0, 0)), n, cfg.page_size, cfg.hybrid_model)
                   for r in replicas}
        self._prefill[request_id] = prefill
        while len(self._prefill) > 4096:  # requests cancelled before routing leave entries behind
            self._prefill.popitem(last=False)
        if order:
            self._tentative[request_id] = (order[0], prefill[order[0]], self._clock() + self.TENTATIVE_TTL_S)
        return order

    def _own_load(self, replica: str) -> ReplicaLoad | None:
        """This router's in-flight load on the replica, requests ranked there first but not yet
        routed included."""
        now = self._clock()
        while self._tentative and next(iter(self._tentative.values()))[2] <= now:
            self._tentative.popitem(last=False)
        base = self.loads.get(replica)
        pending = [tokens for r, tokens, _ in self._tentative.values() if r == replica]
        if not pending:
            return base
        base = base or ReplicaLoad()
        return ReplicaLoad(base.requests + len(pending), base.tokens + sum(pending))

    async def _scores(self, hashes: list[bytes], score: ScoreFn) -> dict[str, Score]:
        """The index's scores merged with the fresh predicted holders (routed within
        `predicted_holder_ttl_s`); if the index cannot answer, everything the router remembers
        sending (`fallback_memory_s`) stands in for it."""
        scores = await self._index_scores(hashes, score)
        cfg, hybrid = self.config, self.config.hybrid_model
        max_age = cfg.predicted_holder_ttl_s if scores is not None else \
            max(cfg.predicted_holder_ttl_s, cfg.fallback_memory_s)
        scores = scores or {}
        for replica, pages in self.predicted.pages(hashes, max_age).items():
            scores[replica] = max(scores.get(replica, (0, 0)), (pages, pages), key=lambda s: s[1] if hybrid else s[0])
        return scores

    async def _index_scores(self, hashes: list[bytes], score: ScoreFn) -> dict[str, Score] | None:
        """The index's scores; None when it cannot answer (skipped, timed out, failed)."""
        if self._clock() < self._skip_index_until:
            self._fallback("skipped")
            return None
        try:
            answer = score(hashes)
            if inspect.isawaitable(answer):
                answer = await asyncio.wait_for(answer, self.config.index_timeout_ms / 1000)
            scores = dict(answer)
        except Exception as e:  # timeout, index unavailable, actor restarting, Redis down, ...
            if isinstance(e, IndexUnavailable):  # not found yet, or a stale mirror: nothing slow to skip
                self._fallback("unavailable")
                return None
            timeout = isinstance(e, asyncio.TimeoutError)
            self._fallback("timeout" if timeout else "error")
            if not timeout:
                logger.debug("index score failed, routing by load: %r", e)
            self._failures += 1
            if self._failures >= self.BREAKER_FAILURES:
                self._skip_index_until = self._clock() + self.BREAKER_COOLDOWN_S
                self._failures = self.BREAKER_FAILURES - 1  # one more failure after the cooldown reopens it
            return None
        self._failures = 0
        return scores

    def _fallback(self, reason: str) -> None:
        self.counts["index_fallbacks"] += 1
        self.counts[{"timeout": "index_timeouts", "error": "index_errors", "skipped": "index_skipped",
                     "unavailable": "index_unavailable"}[reason]] += 1
        if self._on_fallback is not None:
            self._on_fallback(reason)

    def on_routed(self, request_id: str, replica: str, request: Any) -> None:
        self._tentative.pop(request_id, None)
        prefill = self._prefill.pop(request_id, {}).get(replica, prompt_tokens(request, self.config.page_size))
        if (replica, request_id) in self._in_flight:
            return
        self.counts["routed"] += 1
        self._in_flight[(replica, request_id)] = prefill
        engine_id = getattr(request, "request_id", None)
        if isinstance(engine_id, str):
            self._engine_ids[engine_id] = (replica, request_id)
        load = self.loads.setdefault(replica, ReplicaLoad())
        load.requests += 1
        load.tokens += prefill
        self.predicted.record(replica, getattr(request, "page_hashes", None) or ())

    def on_completed(self, request_id: str, replica: str) -> None:
        prefill = self._in_flight.pop((replica, request_id), None)
        if prefill is not None:
            load = self.loads[replica]
            load.requests -= 1
            load.tokens -= prefill
        if len(self._engine_ids) > len(self._in_flight) + 4096:  # drop ids of completed requests
            self._engine_ids = {e: k for e, k in self._engine_ids.items() if k in self._in_flight}

    def on_prefill_done(self, engine_request_id: str) -> None:
        """The request (by its own id, the routed argument's `request_id`) produced its first
        output: its prompt is computed, so it no longer adds prefill tokens to its replica's load."""
        key = self._engine_ids.pop(engine_request_id, None)
        prefill = self._in_flight.get(key) if key is not None else None
        if prefill:
            self._in_flight[key] = 0
            self.loads[key[0]].tokens -= prefill

    def forget(self, replica: str) -> None:
        self.loads.pop(replica, None)
        self.predicted.forget(replica)
        for request_id in [k for k, (r, _, _) in self._tentative.items() if r == replica]:
            del self._tentative[request_id]
        for key in [k for k in self._in_flight if k[0] == replica]:
            del self._in_flight[key]


class CacheAffinityRouter(RequestRouter):
    """Ray Serve adapter around `AffinityRanker`; configured through request_router_kwargs
    (`RoutingConfig.router_kwargs()`)."""

    def initialize_state(self, **kwargs: Any) -> None:
        from ray.util import metrics

        self._config = RoutingConfig.model_validate(kwargs)
        self._fallbacks = metrics.Counter(
            "cairn_router_index_fallbacks_total",
            description="Requests routed by load alone because the cache index timed out or failed.",
            tag_keys=("deployment", "reason"))
        self._fallbacks.set_default_tags({"deployment": self._deployment_id.name})
        self.ranker = AffinityRanker(self._config,
                                     on_fallback=lambda reason: self._fallbacks.inc(1, tags={"reason": reason}))
        self._index: Any = None
        self._index_lookup: asyncio.Task | None = None
        self._index_retry_at = 0.0
        self.mirror = IndexMirror(self._config.index_max_pages) if self._config.index_mode == "mirror" else None
        self._mirror_sync: asyncio.Task | None = None
        self._feed_missing = False
        if self.mirror is not None:
            self.ranker.gauges = self.mirror.gauges
        try:  # start looking for the index now if Serve calls this on the router's loop
            asyncio.get_running_loop()
            self._index_handle()
        except RuntimeError:
            pass

    def _index_handle(self) -> Any:
        """The actor handle, or None while a background lookup (off this loop) finds or creates it.
        Never starts Ray: without a connected Ray (a unit test) there is no index."""
        import ray

        if self._index is None and self._index_lookup is None and time.monotonic() >= self._index_retry_at \
                and ray.is_initialized():
            self._index_lookup = asyncio.get_running_loop().create_task(self._find_index())
        if self.mirror is not None and self._mirror_sync is None and ray.is_initialized():
            self._mirror_sync = asyncio.get_running_loop().create_task(self._sync_mirror())
        return self._index

    async def _find_index(self) -> None:
        from cache_service.actor import index_actor

        cfg = self._config
        try:
            self._index = await asyncio.to_thread(
                index_actor, cfg.index_actor_name, cfg.index_actor_namespace, cfg.redis_url, cfg.namespace,
                cfg.index_max_pages)
        except Exception as e:
            logger.warning("cache index actor %s not available (%s); routing by load", cfg.index_actor_name, e)
            self._index_retry_at = time.monotonic() + 5.0
        finally:
            self._index_lookup = None

    def _score(self, page_hashes: list[bytes]) -> Mapping[str, Score] | Awaitable[Mapping[str, Score]]:
        index = self._index_handle()
        if self.mirror is not None and not self._feed_missing:
            if not self.mirror.fresh(self._config.index_staleness_s):
                raise IndexUnavailable(f"mirror of {self._config.index_actor_name} is stale")
            if not self.mirror.known_workers():  # a restarted index before any replica resynced
                raise IndexUnavailable(f"mirror of {self._config.index_actor_name} knows no replica yet")
            return {w: (s.hit_pages, s.state_pages) for w, s in self.mirror.score(page_hashes).items() if s.hit_pages}
        if index is None:
            raise IndexUnavailable(self._config.index_actor_name)
        return self._remote_score(index, page_hashes)

    async def _remote_score(self, index: Any, page_hashes: list[bytes]) -> Mapping[str, Score]:
        from ray.exceptions import ActorDiedError

        try:
            return await index.score.remote(page_hashes)
        except ActorDiedError:
            self._lost(index)
            raise

    def _lost(self, index: Any) -> None:
        """The actor was killed for good (no restart): look it up again, which creates a new,
        empty one that the replicas' event streams refill (their next batch is a gap: a resync)."""
        if self._index is index:
            self._index = None

    MIRROR_WAIT_S = 1.0         # the feed's long poll (at most): it answers at once when something changed
    MIRROR_INTERVAL_S = 0.02    # at least this between reads, so a busy index is read in chunks
    SNAPSHOT_TIMEOUT_S = 120.0  # a snapshot of a large index takes a while to build, send and load
    WARN_EVERY_S = 30.0

    async def _sync_mirror(self) -> None:
        """Keeps `mirror` following the index actor's change feed, for the router's lifetime.
        Failures are logged (a warning at most every WARN_EVERY_S); an index actor without a
        change feed (started by an older cairn) turns this router to remote mode."""
        from ray.exceptions import ActorDiedError

        mirror, cfg = self.mirror, self._config
        wait_s = min(self.MIRROR_WAIT_S, cfg.index_staleness_s / 2)  # answers arrive well within staleness
        failures, warned_at = 0, float("-inf")
        while True:
            index = self._index
            if index is None:
                await asyncio.sleep(0.1)
                self._index_handle()
                continue
            try:
                timeout = wait_s + cfg.index_staleness_s if mirror.epoch is not None else self.SNAPSHOT_TIMEOUT_S
                chunk = await asyncio.wait_for(index.feed.remote(mirror.epoch, mirror.cursor, wait_s), timeout)
                await mirror.apply(chunk)
                failures = 0
                await asyncio.sleep(self.MIRROR_INTERVAL_S)
            except asyncio.CancelledError:
                raise
            except ActorDiedError:
                self._lost(index)
                await asyncio.sleep(0.1)
            except AttributeError:  # the actor has no `feed` method
                logger.warning("cache index actor %s has no change feed (an older cairn started it): routing "
                               "asks it per request (index_mode remote) from now on", cfg.index_actor_name)
                self._feed_missing = True
                return
            except Exception as e:  # restarting, slow, unreachable: the mirror ages, then counts as stale
                failures += 1
                if time.monotonic() - warned_at >= self.WARN_EVERY_S:
                    warned_at = time.monotonic()
                    logger.warning("reading the cache index's change feed failed (%d in a row, last: %r); "
                                   "requests route by load and memory while the mirror is stale", failures, e)
                await asyncio.sleep(0.2)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when every rank is full
        if not getattr(self, "_registered", False):
            # Serve pickles this module by value into the router's process, so the process-wide
            # registry the ingress reports first outputs to lives in cluster.app (by reference)
            from cluster.app import register_router

            register_router(self.ranker, asyncio.get_running_loop())
            self._registered = True
        if not candidate_replicas:
            return []
        by_id = {replica_worker_id(r.replica_id): r for r in candidate_replicas}
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        request_id = pending_request.metadata.internal_request_id if pending_request is not None else ""
        order = await self.ranker.rank(request_id, request, {w: r.routing_stats for w, r in by_id.items()}, self._score)
        return [[by_id[w]] for w in order]  # singleton ranks: Serve tries them strictly in order

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = pending_request.args[0] if pending_request.args else None
        self.ranker.on_routed(pending_request.metadata.internal_request_id, replica_worker_id(replica_id), request)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.ranker.on_completed(internal_request_id, replica_worker_id(replica_id))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        worker = replica_worker_id(replica_id)
        self.ranker.forget(worker)
        if self._index is not None:
            self._index.drop_worker.remote(worker)  # fire and forget: its cache died with it

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self._replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.ranker.forget(replica_worker_id(replica_id))


def _ray_prefix_router() -> type:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

    class RayPrefixRouter(PrefixCacheAffinityRouter):
        """Ray Serve LLM's PrefixCacheAffinityRouter, reading `.messages` only when it is set
        (Ray's stops at a `messages` attribute that is None, as a completions request has) and
        routing a request without text by its power-of-two fallback instead of failing."""

        def _extract_text_from_request(self, pending_request: PendingRequest) -> str | None:
            for arg in pending_request.args:
                messages, prompt = getattr(arg, "messages", None), getattr(arg, "prompt", None)
                text = self._normalize_prompt_to_string(messages if messages else prompt)
                if text:
                    return text
            return None

    RayPrefixRouter.__module__, RayPrefixRouter.__qualname__ = __name__, "RayPrefixRouter"
    return RayPrefixRouter


def __getattr__(name: str) -> Any:  # PEP 562: ray.llm is imported only when ray_prefix is chosen
    if name == "RayPrefixRouter":
        globals()[name] = cls = _ray_prefix_router()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
