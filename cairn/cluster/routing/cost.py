"""What a replica costs a request, in tokens, and the ranking that follows from it. Plain Python.

    cost = prefill tokens left after the resume point + host copy tokens + load_weight * load tokens

- resume point: `cairn.cache_service.scoring.score_resume_token` of the replica's score (hit
  pages, state pages) from the cache index (design rule 4): for a hybrid model its deepest state
  checkpoint under the page hit, or a sub-page state deeper than that which the ranker found
  there (a prompt's end inside a page: `sub_tokens`), pages without a usable state counting for
  nothing; for an attention-only model the page hit itself.
- host copy tokens (`host_copy_tokens`): a hit in the replica's host memory is not free. What
  the resume point needs from there is copied back first: the pages from its `device_pages` up
  to the resume point's pages (`page_bytes` each) and the state it resumes from when that is on
  the host (`state_bytes`). The copy takes bytes / the replica's host-copy bandwidth seconds,
  which its prefill rate turns into tokens: one price, the engine's own (`cairn.workers.cache.tier_cost`,
  measured, reported in `routing_stats`), and the config's `host_bandwidth_bytes_per_s` and
  `prefill_tokens_per_s` only until the replica has measured. Pages past the resume point are
  not charged.
- move and fetch (`fetch` on): a replica that resumes less deep than the deepest holder may pull
  the holder's resume point (`cairn.cluster.replica_peer_fetch`): its cost is then the holder's
  prefill plus the fetch (`fetch_tokens`), when that is cheaper than its own resume point. The
  fetch is the transfer (the pages past its own device run and the state, over
  `fetch_bandwidth_bytes_per_s`) and the wait for it: the holder copies between two of its steps,
  so the request waits out the holder's step (`step_seconds`, as the holder measured it, the
  config's until then) and a round trip (`fetch_round_trip_s`); seconds, in tokens at the
  receiver's prefill rate. Priced by
  its bytes alone a fetch would look free, and any load gap would move a conversation off its
  replica to wait on that replica's step anyway.
- load tokens (`load_tokens`): the prefill tokens left of the requests this router has in flight
  there, plus `request_load_tokens` per in-flight request (the larger of this router's count and
  the replica's reported running + waiting), plus `occupancy_load_tokens` times the fraction of
  its pages or state slots in use. The reported numbers are what the replica's
  `record_routing_stats()` returns (`routing_stats`); missing or malformed numbers count as 0.
  A report is a snapshot taken at `taken_at` (the replica's wall clock) and read up to
  `routing_stats_period_s` later: requests this router sent there before then that have finished
  since (`finished`) are no longer running there, so they leave the reported count, and the
  occupancy shrinks in proportion. Without that, a conversation's next turn sees its own last
  turn still running at its home and is priced away from its cache.
`rank_replicas` sorts replicas by cost; a replica with `spill_limit` more in-flight requests than
the least-loaded one ranks after all others, so a hot prefix spills over instead of piling onto
one replica. Ties break at random. Every function here is pure: no I/O, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cairn.cache_service import scoring
from cairn.cache_service.scoring import ZERO, WorkerScore, score_resume_token
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.workers.engine_metrics import EngineMetrics
from cairn.workers.request import FetchHint

Score = WorkerScore  # what the index answers for a replica: its hit, state and how much is on the device


def routing_stats(m: EngineMetrics, max_num_seqs: int, taken_at: float) -> dict[str, float]:
    """What an engine replica's record_routing_stats() returns, from its `Engine.metrics()` read
    at `taken_at` (wall clock): pages held by running requests and state slots in use (one per
    running sequence), with totals, and the rates the engine measured (host copies, prefill, its
    step time) once it has."""
    out = dict(running_requests=m.running_requests, waiting_requests=m.waiting_requests,
               pages_in_use=m.pages_held, pages_total=m.pages_total,
               states_in_use=m.running_requests, states_total=max_num_seqs, taken_at=taken_at)
    for name in ("host_copy_bytes_per_s", "prefill_tokens_per_s", "step_seconds"):
        if getattr(m, name) is not None:
            out[name] = getattr(m, name)
    return out


@dataclass
class ReplicaLoad:
    requests: int = 0           # in flight from this router
    tokens: int = 0             # prefill tokens those requests cost there
    reported_requests: int = 0  # running + waiting, as the replica last reported
    occupancy: float = 0.0      # fraction of its pages or state slots in use, as reported
    host_copy_bytes_per_s: float | None = None  # its host-to-device copies, as it measured them
    prefill_tokens_per_s: float | None = None   # its prefill, as it measured it (None: not yet)
    step_seconds: float | None = None           # its step's wall time, as it measured it (None: not yet)


def reported_load(own: ReplicaLoad | None, stats: Mapping[str, Any] | None, finished: int = 0) -> ReplicaLoad:
    """This router's own load on a replica, with what the replica reported (`routing_stats`),
    less the `finished` requests of this router that the report still counts (module doc)."""
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
    left = max(0, reported - finished)
    still = left / reported if reported > 0 else 1.0  # what the finished requests held is free again

    def rate(name: str) -> float | None:  # a positive finite number, else unknown
        try:
            value = float(stats[name])
        except (KeyError, TypeError, ValueError):
            return None
        return value if 0 < value < float("inf") else None
    return ReplicaLoad(own.requests, own.tokens, left,
                       still * max(fraction("pages_in_use", "pages_total"), fraction("states_in_use", "states_total")),
                       rate("host_copy_bytes_per_s"), rate("prefill_tokens_per_s"), rate("step_seconds"))


def load_tokens(load: ReplicaLoad, config: RoutingConfig) -> float:
    requests = max(load.requests, load.reported_requests)
    return load.tokens + config.request_load_tokens * requests + config.occupancy_load_tokens * load.occupancy


def prefill_tokens(score: Score, num_prompt_tokens: int, config: RoutingConfig) -> int:
    """Prompt tokens the replica computes: those after its resume point."""
    return num_prompt_tokens - score_resume_token(score, num_prompt_tokens, config.page_size, config.recurrent)


def host_copy_tokens(score: Score, config: RoutingConfig, load: ReplicaLoad | None = None) -> float:
    """The time to copy back from host memory what the replica's resume point needs, in tokens:
    at the rates the replica measured (`load`), the config's until it has."""
    load = load or ReplicaLoad()
    if config.recurrent and score.sub_tokens > score.state_pages * config.page_size:  # from a sub-page state:
        copy_bytes = max(0, score.sub_tokens // config.page_size - score.device_pages) * config.page_bytes
        copy_bytes += config.state_bytes if score.sub_on_host else 0  # the pages under it, the state
    else:
        copy_bytes = max(0, resume_pages(score, config) - score.device_pages) * config.page_bytes
        if config.recurrent and score.state_on_host and score.state_pages:
            copy_bytes += config.state_bytes
    bandwidth = load.host_copy_bytes_per_s or config.host_bandwidth_bytes_per_s
    return copy_bytes / bandwidth * (load.prefill_tokens_per_s or config.prefill_tokens_per_s)


def resume_pages(score: Score, config: RoutingConfig) -> int:
    """How deep (pages) the replica resumes (`cairn.cache_service.scoring.resume_pages`)."""
    return scoring.resume_pages(score.hit_pages, score.state_pages, config.recurrent)


def deepest_holder(scores: Mapping[str, Score], config: RoutingConfig) -> tuple[str, Score] | None:
    """The replica resuming the request deepest, a sub-page state's depth counted (more device
    pages breaking ties); None if none resumes it at all."""
    def depth(score: Score) -> int:
        return score_resume_token(score, 1 << 62, config.page_size, config.recurrent)
    best = max(scores.items(), key=lambda item: (depth(item[1]), item[1].device_pages), default=None)
    return best if best is not None and depth(best[1]) > 0 else None


def fetch_hint(holder: tuple[str, Score], config: RoutingConfig) -> FetchHint:
    """What a replica pulling the holder's resume point asks for: pages, and a sub-page state
    inside the next page when that is where the holder resumes."""
    name, score = holder
    pages = resume_pages(score, config)
    if config.recurrent and score.sub_tokens > pages * config.page_size:
        return FetchHint(name, *divmod(score.sub_tokens, config.page_size))
    return FetchHint(name, pages)


def fetch_tokens(score: Score, holder: Score, config: RoutingConfig, load: ReplicaLoad | None = None,
                 holder_load: ReplicaLoad | None = None) -> float:
    """The time to move the holder's resume point to a replica scoring `score`, in tokens (at
    the prefill rate that replica measured, `load`, else the config's): the transfer of the pages
    past that replica's own device run and of the state, and the wait for the holder's step
    (`holder_load.step_seconds`, the config's until the holder has measured it) and a round trip."""
    pages = max(0, resume_pages(holder, config) - score.device_pages)
    moved = pages * config.page_bytes + (config.state_bytes if config.recurrent else 0)
    rate = (load.prefill_tokens_per_s if load is not None else None) or config.prefill_tokens_per_s
    wait = ((holder_load.step_seconds if holder_load is not None else None) or config.step_seconds) + \
        config.fetch_round_trip_s
    return (moved / config.fetch_bandwidth_bytes_per_s + wait) * rate


def replica_cost(score: Score, load: ReplicaLoad, config: RoutingConfig, num_prompt_tokens: int,
                 holder: Score | None = None, holder_load: ReplicaLoad | None = None) -> float:
    """The request's cost on the replica, in tokens (the module doc's formula). With fetch on and
    a deeper `holder` elsewhere (loaded `holder_load`), the replica may instead move and fetch:
    the holder's prefill plus the fetch, when that is cheaper."""
    work = prefill_tokens(score, num_prompt_tokens, config) + host_copy_tokens(score, config, load)
    if config.fetch and holder is not None and resume_pages(holder, config) > resume_pages(score, config):
        work = min(work, prefill_tokens(holder, num_prompt_tokens, config) +
                   fetch_tokens(score, holder, config, load, holder_load))
    return work + config.load_weight * load_tokens(load, config)


def rank_replicas(replicas: Sequence[str], scores: Mapping[str, Score], loads: Mapping[str, ReplicaLoad],
                  config: RoutingConfig, num_prompt_tokens: int, rng: random.Random | None = None) -> list[str]:
    """Replica ids, cheapest first; spilled replicas (see module doc) after all others."""
    rng = rng or random
    empty = ReplicaLoad()
    busy = {r: max(loads.get(r, empty).requests, loads.get(r, empty).reported_requests) for r in replicas}
    least = min(busy.values(), default=0)
    deepest = deepest_holder({r: s for r, s in scores.items() if r in busy}, config)
    holder, holder_load = (deepest[1], loads.get(deepest[0], empty)) if deepest is not None else (None, None)

    def key(r: str) -> tuple[bool, float, float]:
        cost = replica_cost(scores.get(r, ZERO), loads.get(r, empty), config, num_prompt_tokens, holder, holder_load)
        return busy[r] - least >= config.spill_limit, cost, rng.random()
    return sorted(replicas, key=key)
