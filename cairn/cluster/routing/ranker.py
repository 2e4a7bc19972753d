"""The router's state and decisions, without Ray: `AffinityRanker`.

Per request it reads the cache index's scores (through a `ScoreFn` the adapter supplies: a
local mirror's answer, or an awaited actor call bounded by `index_timeout_ms`), merges in the
predicted holders (`cairn.cluster.routing.predicted`) and ranks replicas by cost
(`cairn.cluster.routing.cost`). Rules it keeps:
- Routing never fails because of the index. An index that is unavailable (not found yet, a stale
  mirror: `IndexUnavailable`), slow (timeout) or failing (error) is a fallback, counted by
  reason: the request is ranked by load and by what this router remembers sending where.
  After `BREAKER_FAILURES` slow or failing answers in a row the index is skipped for
  `BREAKER_COOLDOWN_S`, so a dead index costs no routing latency.
- A request counts as in flight on the replica it ranked first from the moment it is ranked
  until Serve reports where it went (`on_routed`; at most `TENTATIVE_TTL_S`): a burst ranked at
  once, each awaiting the index, sees the others instead of all taking the same "least loaded"
  replica.
- What it routed where stands in for the index until the index hears of it (predicted holders):
  the pages, and for a hybrid model the states the request leaves past where it resumes there
  (its message starts and its end, inside a page too), never a state merely where a later prompt
  parts from it.
  Recorded when the request is routed and again when it completes: a request that ran longer
  than `predicted_holder_ttl_s` leaves its prompt-end state as it ends, and its conversation's
  next turn, sent at once, arrives before the index has heard of that state.
- A hybrid model's replica may resume inside the page after its hit run, where an earlier prompt
  ended (`sub_states`): every position of that page is named and asked of the index
  (`ProbeFn`: `CacheIndex.states_at`) and of the predicted holders, and the replica is scored
  there. A probe that fails costs that depth alone.
- A replica's report of its load is a snapshot (`taken_at`): requests this router routed there
  before it and saw finish after it leave the reported count (`cost.reported_load`), so a
  conversation's next turn is not priced away from its home by its own finished turn.
- A request's prefill tokens count as load on its replica until its first output
  (`on_prefill_done`, called through `cairn.cluster.routing.router_registry.prefill_done` by the ingress).
- `counts` (and the adapter's `gauges`) are what the ingress's /metrics exports as
  `cairn_router_*`.
Every number is in tokens or requests; the clocks (monotonic, and the wall clock reports are
stamped by) and the random source are injectable.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from cairn.cache_service.hashing import branch_root, sub_state_keys
from cairn.cache_service.scoring import ZERO, WorkerScore, last_resumable_page
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.cluster.routing.cost import (ReplicaLoad, Score, deepest_holder, fetch_hint, prefill_tokens, rank_replicas,
                                  reported_load, resume_pages)
from cairn.cluster.routing.predicted import PredictedHolders
from cairn.workers.request import FetchHint, GenerateRequest

logger = logging.getLogger(__name__)

# the index's scores for a prompt's page hashes: awaited (remote, with the timeout) or local. A
# score is a WorkerScore or its fields as a tuple (the actor's answer; an older actor's
# (hit_pages, state_pages) pairs are all on the device)
IndexAnswer = Mapping[str, Score | tuple]
ScoreFn = Callable[[list[bytes]], Awaitable[IndexAnswer] | IndexAnswer]
# the index's sub-page states at keys (`CacheIndex.states_at`): worker -> [(key index, on host)]
StatesAnswer = Mapping[str, list]
ProbeFn = Callable[[list[bytes]], Awaitable[StatesAnswer] | StatesAnswer]


@dataclass(frozen=True)
class Ranking:
    order: list[str]  # replica ids, best first
    fetch: FetchHint | None = None  # the deepest holder (routing config `fetch`), for whichever takes it


@dataclass
class InFlight:
    """A request this router routed, until it completes."""
    prefill: int  # its prompt tokens left to compute there (0 once its first output came)
    routed_at: float  # wall clock
    leaves: tuple  # what it leaves there: the predicted holders' record (`PredictedHolders.record`'s arguments)


class IndexUnavailable(RuntimeError):
    """The index cannot answer now, and nothing slow stands behind that: no handle to its actor
    (not found yet, or a failed lookup waits to be retried), or the router's mirror is stale."""


class AffinityRanker:
    """One router's in-flight accounting, predicted holders, index reading (timeout, breaker,
    fallback) and the counters the adapter exports; the rules are the module doc's."""

    BREAKER_FAILURES, BREAKER_COOLDOWN_S = 3, 1.0
    MIN_PREDICTED_HASHES = 10_000  # the fresh predictions work even with fallback_memory_pages 0
    TENTATIVE_TTL_S = 5.0  # a ranked request Serve never reports as routed (cancelled) stops counting
    FINISHED_KEPT = 1024  # finished requests remembered per replica, to read its reports against

    def __init__(self, config: RoutingConfig, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, on_fallback: Callable[[str], None] | None = None,
                 wall_clock: Callable[[], float] = time.time):
        if None in (config.page_size, config.recurrent, config.page_bytes, config.state_bytes):
            raise ValueError("the routing config lacks the engines' page_size, recurrent, page_bytes and "
                             "state_bytes: use RoutingConfig.for_engines(spec) (build_application does)")
        self.config, self._clock, self._rng, self._on_fallback = config, clock, rng or random.Random(), on_fallback
        self._wall = wall_clock
        self.predicted = PredictedHolders(max(config.predicted_holder_ttl_s, config.fallback_memory_s), clock,
                                          max(config.fallback_memory_pages, self.MIN_PREDICTED_HASHES))
        self.loads: dict[str, ReplicaLoad] = {}
        self._in_flight: dict[tuple[str, str], InFlight] = {}  # (replica, request id) -> it
        self._engine_ids: dict[str, tuple[str, str]] = {}  # the request's own id -> (replica, request id)
        self._finished: dict[str, deque[tuple[float, float]]] = {}  # replica -> (routed, finished) wall clock
        self._prefill: OrderedDict[str, dict[str, int]] = OrderedDict()  # request id -> replica -> tokens
        self._resume: OrderedDict[str, dict[str, int]] = OrderedDict()  # request id -> replica -> resume pages
        # ranked, not yet routed: request id -> (replica ranked first, its prefill tokens, expiry)
        self._tentative: OrderedDict[str, tuple[str, int, float]] = OrderedDict()
        self._failures, self._skip_index_until = 0, float("-inf")
        self.counts = dict(ranked=0, routed=0, index_fallbacks=0, index_timeouts=0, index_errors=0, index_skipped=0,
                           index_unavailable=0, index_probe_failures=0)
        self.gauges: Callable[[], dict[str, float]] = lambda: {}  # set by the adapter (its mirror's)

    async def rank(self, request_id: str, request: GenerateRequest, replicas: Mapping[str, Mapping[str, Any] | None],
                   score: ScoreFn, probe: ProbeFn | None = None) -> Ranking:
        """Replica ids best first, for the request, and (routing config `fetch`) the replica
        resuming it deepest, which whichever replica takes it may pull from; `replicas` maps each
        candidate to its reported routing stats; `probe` (a hybrid model) asks the index for
        sub-page states (`sub_states`). The request is read, never written."""
        cfg, self.counts["ranked"] = self.config, self.counts["ranked"] + 1
        hashes = list(request.page_hashes or ())
        n = request.num_prompt_tokens
        self._tentative.pop(request_id, None)  # ranked again (a retry): its earlier pick no longer stands
        scores = await self._scores(hashes, score) if hashes else {}
        if scores and cfg.recurrent:
            scores = await self.sub_states(request, scores, probe)
        loads = {r: reported_load(self._own_load(r), stats, self._finished_since(r, stats))
                 for r, stats in replicas.items()}
        order = rank_replicas(list(replicas), scores, loads, cfg, n, self._rng)
        fetch = None  # whichever replica takes it may pull from there
        if cfg.fetch:
            deepest = deepest_holder({r: s for r, s in scores.items() if r in replicas}, cfg)
            fetch = fetch_hint(deepest, cfg) if deepest is not None else None
        prefill = {r: prefill_tokens(scores.get(r, ZERO), n, cfg) for r in replicas}
        resumes = {r: max(resume_pages(scores.get(r, ZERO), cfg), fetch.depth if fetch and fetch.holder != r else 0)
                   for r in replicas}
        self._prefill[request_id] = prefill
        self._resume[request_id] = resumes
        while len(self._prefill) > 4096:  # requests cancelled before routing leave entries behind
            self._prefill.popitem(last=False)
        while len(self._resume) > 4096:
            self._resume.popitem(last=False)
        if order:
            self._tentative[request_id] = (order[0], prefill[order[0]], self._clock() + self.TENTATIVE_TTL_S)
        return Ranking(order, fetch)

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

    def _finished_since(self, replica: str, stats: Mapping[str, Any] | None) -> int:
        """This router's requests the replica's report counts that have finished since: routed
        there before the report was taken, finished after."""
        try:
            taken = float((stats or {})["taken_at"])
        except (KeyError, TypeError, ValueError):
            return 0
        count = 0
        for routed, done in reversed(self._finished.get(replica, ())):  # newest first, in finishing order
            if done <= taken:
                break
            count += routed <= taken
        return count

    async def _scores(self, hashes: list[bytes], score: ScoreFn) -> dict[str, Score]:
        """The index's scores merged with the fresh predicted holders (routed within
        `predicted_holder_ttl_s`); if the index cannot answer, everything the router remembers
        sending (`fallback_memory_s`) stands in for it."""
        scores = await self._index_scores(hashes, score)
        cfg, recurrent = self.config, self.config.recurrent
        max_age = cfg.predicted_holder_ttl_s if scores is not None else \
            max(cfg.predicted_holder_ttl_s, cfg.fallback_memory_s)
        scores = scores or {}
        for replica, (pages, states) in self.predicted.pages(hashes, max_age, recurrent).items():  # on the device
            scores[replica] = max(scores.get(replica, ZERO), WorkerScore(pages, states),
                                  key=lambda s: (resume_pages(s, cfg), s.device_pages))
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
            scores = {w: s if isinstance(s, WorkerScore) else WorkerScore(*s) for w, s in answer.items()}
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

    def on_routed(self, request_id: str, replica: str, request: GenerateRequest) -> None:
        self._tentative.pop(request_id, None)
        prefill = self._prefill.pop(request_id, {}).get(replica, request.num_prompt_tokens)
        resumed = self._resume.pop(request_id, {}).get(replica, 0)
        if (replica, request_id) in self._in_flight:
            return
        self.counts["routed"] += 1
        leaves = (list(request.page_hashes or ()), self._states_left(request, resumed) if self.config.recurrent else None,
                  self._prompt_end(request) if self.config.recurrent else [])
        self._in_flight[(replica, request_id)] = InFlight(prefill, self._wall(), leaves)
        self._engine_ids[request.request_id] = (replica, request_id)
        load = self.loads.setdefault(replica, ReplicaLoad())
        load.requests += 1
        load.tokens += prefill
        self.predicted.record(replica, *leaves)

    async def sub_states(self, request: GenerateRequest, scores: dict[str, Score], probe: ProbeFn | None
                         ) -> dict[str, Score]:
        """`scores` with each replica's deepest sub-page state (`WorkerScore.sub_tokens`): a state
        inside the page after its hit run, where an earlier prompt ended (a reply that ended inside
        that page keeps its head: `cairn.workers.cache.partial_pages`). Every position of that
        page is named (`sub_state_keys`, one short hash a token) and asked of the index (`probe`)
        and of what this router sent where (fresh predicted holders: the prompts' ends). An index
        that cannot answer costs the sub-page depth, nothing else."""
        cfg, ps, n = self.config, self.config.page_size, request.num_prompt_tokens
        hashes, root, tokens = request.page_hashes or [], request.hash_root, request.cache_tokens
        if root is None:
            return scores
        keys: list[bytes] = []
        at: list[tuple[int, int]] = []  # (floor pages, tokens into the page after it) of each key
        for j in sorted({s.hit_pages for s in scores.values() if 1 <= s.hit_pages <= len(hashes)}):
            span = tokens[j * ps:min((j + 1) * ps - 1, n - 1)]  # a state at n - 1 at most is usable
            keys += sub_state_keys(branch_root(hashes[j - 1], root), span)
            at += [(j, t) for t in range(1, len(span) + 1)]
        if not keys:
            return scores
        found: dict[str, list[tuple[int, bool]]] = {}
        for replica, held in self.predicted.subs(keys, cfg.predicted_holder_ttl_s).items():
            found.setdefault(replica, []).extend((i, False) for i in held)
        if probe is not None and self._clock() >= self._skip_index_until:
            try:
                answer = probe(keys)
                if inspect.isawaitable(answer):
                    answer = await asyncio.wait_for(answer, cfg.index_timeout_ms / 1000)
                for replica, held in answer.items():
                    found.setdefault(replica, []).extend((int(i), bool(h)) for i, h in held)
            except Exception as e:  # the pages' scores stand: a sub-page depth is a refinement
                logger.debug("index sub-page probe failed: %r", e)
                self.counts["index_probe_failures"] += 1
        out = dict(scores)
        for replica, held in found.items():
            s = out.get(replica)
            usable = [(at[i][0] * ps + at[i][1], on_host) for i, on_host in held
                      if 0 <= i < len(at) and s is not None and s.hit_pages >= at[i][0]]
            if usable:
                depth, on_host = max(usable, key=lambda u: (u[0], not u[1]))
                if depth > s.sub_tokens:
                    out[replica] = replace(s, sub_tokens=depth, sub_on_host=on_host)
        return out

    def _prompt_end(self, request: GenerateRequest) -> list[bytes]:
        """The index key of the state a hybrid engine leaves at the request's end, when that lies
        inside a page (its `prompt_end` checkpoint): what its next turn resumes from."""
        ps, n, hashes = self.config.page_size, request.num_prompt_tokens, request.page_hashes or []
        j, t = divmod(n, ps)
        if not t or not j or request.hash_root is None or len(hashes) < j:
            return []
        return sub_state_keys(branch_root(hashes[j - 1], request.hash_root), request.cache_tokens[j * ps:n])[-1:]

    def _states_left(self, request: GenerateRequest, resumed_pages: int) -> list[int]:
        """Depths (pages) where a hybrid model's engine leaves states computing `request` from
        `resumed_pages` on: its message starts (the checkpoint hints, rounded down to a page) and
        the last boundary before its end, past where it resumed."""
        ps, n = self.config.page_size, request.num_prompt_tokens
        depths = {h // ps for h in request.checkpoint_hints} | {last_resumable_page(n, ps)}
        return [j for j in depths if j > resumed_pages]

    def on_completed(self, request_id: str, replica: str) -> None:
        done = self._in_flight.pop((replica, request_id), None)
        if done is not None:
            load = self.loads[replica]
            load.requests -= 1
            load.tokens -= done.prefill
            self._finished.setdefault(replica, deque(maxlen=self.FINISHED_KEPT)).append((done.routed_at, self._wall()))
            self.predicted.record(replica, *done.leaves)  # fresh as it ends
        if len(self._engine_ids) > len(self._in_flight) + 4096:  # drop ids of completed requests
            self._engine_ids = {e: k for e, k in self._engine_ids.items() if k in self._in_flight}

    def on_prefill_done(self, engine_request_id: str) -> None:
        """The request (by its own id, the routed argument's `request_id`) produced its first
        output: its prompt is computed, so it no longer adds prefill tokens to its replica's load."""
        key = self._engine_ids.pop(engine_request_id, None)
        running = self._in_flight.get(key) if key is not None else None
        if running is not None and running.prefill:
            self.loads[key[0]].tokens -= running.prefill
            running.prefill = 0

    def forget(self, replica: str) -> None:
        self.loads.pop(replica, None)
        self.predicted.forget(replica)
        for request_id in [k for k, (r, _, _) in self._tentative.items() if r == replica]:
            del self._tentative[request_id]
        self._finished.pop(replica, None)
        for key in [k for k in self._in_flight if k[0] == replica]:
            del self._in_flight[key]
