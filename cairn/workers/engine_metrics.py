"""What an engine counts and reports about itself: its running totals (`EngineTotals`, kept by the
engine as it runs: `Engine.stats`) and one typed snapshot of all its numbers (`Engine.metrics()`).

`EngineTotals` holds the six totals since start: steps, and prompt, cached, computed and
generated tokens, and preemptions. `EngineMetrics` is those totals (it extends `EngineTotals`,
so they are declared once) with gauges (what is in use now), counters (names ending `_total`: what
happened since start) and labelled counter families (a dict per family, by its `kind` label).
`samples()` lists it as (name, kind label or None, value), the form exports read: the API's
/metrics writes `cairn_engine_<name>` (`cairn.cluster.api.api_metrics.engine_families`), the cluster
copies the same into Ray's metrics. The router reads it typed (`cairn.cluster.routing.cost.routing_stats`):
occupancy, queues, and what the engine measured of its host copies and prefill (`None` until it
has: the router then prices a host copy with its configured rates).

A replica stamps its own `worker_id` on it before it leaves the process. Plain data, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

LABELLED = ("fetch_fallbacks_total", "tier_hit_tokens_total", "checkpoints_admitted_total", "checkpoint_hits_total",
            "spec_accepted_tokens_by_position_total")
MEASURED = ("host_copy_bytes_per_s", "prefill_tokens_per_s", "step_seconds")


@dataclass
class EngineTotals:
    """An engine's totals since start, kept on its thread as it runs (`Engine.stats`)."""
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0


@dataclass
class EngineMetrics(EngineTotals):
    # requests (the totals above: steps, tokens, preemptions)
    running_requests: int = 0
    waiting_requests: int = 0
    # the device cache
    pages_total: int = 0
    pages_held: int = 0
    pages_cached: int = 0
    checkpoints_stored: int = 0
    state_bytes: int = 0
    cache_used_bytes: int = 0
    cache_budget_bytes: int = 0
    pages_evicted_total: int = 0
    checkpoints_stored_total: int = 0
    checkpoints_used_total: int = 0
    checkpoints_evicted_total: int = 0
    checkpoints_without_slot_total: int = 0
    checkpoints_to_host_total: int = 0
    promotions_overlapped_total: int = 0
    # the host tier
    host_cache_budget_bytes: int = 0
    host_cache_used_bytes: int = 0
    host_pages: int = 0
    host_checkpoints: int = 0
    pages_demoted_total: int = 0
    checkpoints_demoted_total: int = 0
    pages_promoted_total: int = 0
    checkpoints_from_host_total: int = 0
    host_pages_evicted_total: int = 0
    host_checkpoints_evicted_total: int = 0
    bytes_to_host_total: int = 0
    bytes_to_device_total: int = 0
    # peer fetch
    fetches_total: int = 0
    fetched_pages_total: int = 0
    fetched_bytes_total: int = 0
    exported_bytes_total: int = 0
    # kernels (cairn.kernels.common.compile_watch): every compile of this process, and those after
    # warm-up (each a step shape the warm-up missed: a bug)
    kernel_compiles_total: int = 0
    kernel_compiles_after_warm_up_total: int = 0
    # async scheduling (cairn.workers.engine): steps planned and launched before the last one's
    # tokens were read, and rows of those steps computed for sequences that had stopped
    steps_planned_ahead_total: int = 0
    rows_dropped_total: int = 0
    # speculative decoding (cairn.workers.speculative), as vLLM counts it: verify segments that
    # drafted, tokens drafted, drafted tokens accepted (in all, and by position: "0" the first);
    # mean acceptance length = 1 + accepted / drafts, acceptance rate = accepted / drafted
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_mean_acceptance_length: float | None = None
    # labelled families, by kind
    fetch_fallbacks_total: dict[str, int] = field(default_factory=dict)  # why a fetch did not happen
    tier_hit_tokens_total: dict[str, int] = field(default_factory=dict)  # cached tokens by tier: device, host
    checkpoints_admitted_total: dict[str, int] = field(default_factory=dict)  # by checkpoint kind
    checkpoint_hits_total: dict[str, int] = field(default_factory=dict)  # by checkpoint kind
    spec_accepted_tokens_by_position_total: dict[str, int] = field(default_factory=dict)  # by draft position
    # measured rates (None: not yet measured)
    host_copy_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    step_seconds: float | None = None  # a step's wall time (moving average): what a peer's fetch waits for
    worker_id: str | None = None  # stamped by the replica that reports it

    @classmethod
    def of(cls, engine: Any) -> EngineMetrics:
        """A `cairn.workers.engine.Engine`'s numbers now (on its thread, between steps)."""
        cache, stats, fetches = engine.cache, engine.cache.stats, engine.fetches
        layout, scheduler, cost, policy = engine.layout, engine.scheduler, engine.cache.tier_cost, engine.policy.summary()
        spec = engine.speculation
        return cls(
            **asdict(engine.stats), running_requests=len(scheduler.running),
            waiting_requests=len(scheduler.waiting),
            pages_total=layout.page_capacity, pages_held=cache.pages.num_held, pages_cached=cache.pages.num_cached,
            checkpoints_stored=cache.checkpoints.num_stored, state_bytes=cache.checkpoint_bytes,
            cache_used_bytes=cache.used_bytes, cache_budget_bytes=cache.budget_bytes,
            pages_evicted_total=stats.pages_evicted, checkpoints_stored_total=stats.checkpoints_stored,
            checkpoints_used_total=stats.checkpoints_used, checkpoints_evicted_total=stats.checkpoints_evicted,
            checkpoints_without_slot_total=stats.checkpoints_without_slot,
            checkpoints_to_host_total=stats.checkpoints_to_host,
            promotions_overlapped_total=scheduler.overlapped_promotions,
            host_cache_budget_bytes=layout.host_blocks * layout.block_bytes,
            host_cache_used_bytes=cache.host.used_blocks * layout.block_bytes,
            host_pages=len(cache.host.pages), host_checkpoints=len(cache.host.checkpoints),
            pages_demoted_total=stats.pages_demoted, checkpoints_demoted_total=stats.checkpoints_demoted,
            pages_promoted_total=stats.pages_promoted, checkpoints_from_host_total=stats.checkpoints_from_host,
            host_pages_evicted_total=cache.host.pages_evicted,
            host_checkpoints_evicted_total=cache.host.checkpoints_evicted,
            bytes_to_host_total=stats.bytes_to_host, bytes_to_device_total=stats.bytes_to_device,
            fetches_total=fetches.counts["fetches"], fetched_pages_total=fetches.counts["fetched_pages"],
            fetched_bytes_total=fetches.counts["fetched_bytes"], exported_bytes_total=fetches.counts["exported_bytes"],
            kernel_compiles_total=engine.kernel_compiles, kernel_compiles_after_warm_up_total=engine.late_compiles,
            steps_planned_ahead_total=engine.async_steps.overlapped_steps, rows_dropped_total=engine.async_steps.dropped_rows,
            spec_drafts_total=spec.drafts, spec_draft_tokens_total=spec.draft_tokens,
            spec_accepted_tokens_total=spec.accepted_tokens, spec_mean_acceptance_length=spec.mean_acceptance_length,
            spec_accepted_tokens_by_position_total={str(j): n for j, n in enumerate(spec.accepted_by_position)
                                                    if j < engine.options.num_speculative_tokens},
            fetch_fallbacks_total=dict(fetches.fallbacks),
            tier_hit_tokens_total={tier: scheduler.hit_tokens_by_tier.get(tier, 0) for tier in ("device", "host")},
            checkpoints_admitted_total={kind: rec["admitted"] for kind, rec in policy.items()},
            checkpoint_hits_total={kind: rec["hits"] for kind, rec in policy.items()},
            host_copy_bytes_per_s=cost.bandwidth, prefill_tokens_per_s=cost.prefill_rate,
            step_seconds=cost.step_seconds)

    def samples(self) -> Iterator[tuple[str, str | None, float]]:
        """Every number, as (name, kind label or None, value); unmeasured rates are left out."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "worker_id" or value is None:
                continue
            if f.name in LABELLED:
                for kind, n in sorted(value.items()):
                    yield f.name, kind, float(n)
            else:
                yield f.name, None, float(value)
