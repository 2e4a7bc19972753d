"""What an engine reports about itself, as one typed snapshot (`Engine.metrics()`).

`EngineMetrics` holds gauges (what is in use now), counters (names ending `_total`: what
happened since start) and labelled counter families (a dict per family, by its `kind` label).
`samples()` lists it as (name, kind label or None, value), the form exports read: the API's
/metrics writes `cairn_engine_<name>` (`cluster.api.metrics.engine_families`), the cluster
copies the same into Ray's metrics. The router reads it typed (`cluster.routing.cost.routing_stats`):
occupancy, queues, and what the engine measured of its host copies and prefill (`None` until it
has: the router then prices a host copy with its configured rates).

A replica stamps its own `worker_id` on it before it leaves the process. Plain data, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields

LABELLED = ("fetch_fallbacks_total", "tier_hit_tokens_total", "checkpoints_admitted_total", "checkpoint_hits_total")
MEASURED = ("host_copy_bytes_per_s", "prefill_tokens_per_s")


@dataclass
class EngineMetrics:
    # requests and tokens
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
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
    # labelled families, by kind
    fetch_fallbacks_total: dict[str, int] = field(default_factory=dict)  # why a fetch did not happen
    tier_hit_tokens_total: dict[str, int] = field(default_factory=dict)  # cached tokens by tier: device, host
    checkpoints_admitted_total: dict[str, int] = field(default_factory=dict)  # by checkpoint kind
    checkpoint_hits_total: dict[str, int] = field(default_factory=dict)  # by checkpoint kind
    # measured rates (None: not yet measured)
    host_copy_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    worker_id: str | None = None  # stamped by the replica that reports it

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
