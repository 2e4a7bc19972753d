"""What GET /metrics reports: Prometheus text, written by prometheus_client from a registry of
this app's own (never the process-wide one), so two apps in one process never mix.

Counted by the API (`APIMetrics`): requests by endpoint and status, errors by status, time to
first token, inter-token latency and end-to-end latency (histograms, seconds), prompt / cached /
generated tokens, and the prefix hit ratio (cached over prompt tokens); per tenant (labelled by
tenant id, never by key): requests admitted, requests refused by the limit they were over,
tokens by kind, and the seconds each engine request waited in its engine's queue. Inter-token latency is
timed by `TimedClient`, which wraps the app's engine client: the gap between two outputs of one
engine request, per token they carry.

The engine's own counters and gauges (`cairn.workers.engine_metrics.EngineMetrics`: pages held and cached,
checkpoints stored, state bytes, queues...) are written as `cairn_engine_*`, and the request
routers' counters (`router_sources`, keys `router_*`: the ingress adds its routers') as
`cairn_router_*`, by `engine_families`: a labelled family becomes `name{kind="..."}`, a name
ending in `_total` a counter, any other a gauge, and the replica's worker_id the label of
`cairn_engine_info`. The cluster exports the same families to Ray's metrics
(`cairn.cluster.metrics_export`), one series per replica.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from cairn.workers.engine_metrics import EngineMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


class APIMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("cairn_requests", "HTTP requests by endpoint and status code.",
                                ("endpoint", "status"), registry=r)
        self.errors = Counter("cairn_request_errors", "HTTP requests answered with an error, by status code.",
                              ("status",), registry=r)
        self.ttft = Histogram("cairn_time_to_first_token_seconds", "Seconds from request arrival to the first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("cairn_inter_token_latency_seconds",
                                     "Seconds between two output tokens of one engine request.",
                                     buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("cairn_e2e_request_latency_seconds", "Seconds from request arrival to its last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("cairn_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("cairn_cached_tokens", "Prompt tokens served from the prefix cache.", registry=r)
        self.generated_tokens = Counter("cairn_generated_tokens", "Tokens generated.", registry=r)
        Gauge("cairn_prefix_hit_ratio", "Cached over prompt tokens since start.",
              registry=r).set_function(self.hit_ratio)
        # by tenant id (cairn.cluster.api.tenants; "default" without keys), never by key
        self.tenant_requests = Counter("cairn_tenant_requests", "Requests admitted to the engines, by tenant.",
                                       ("tenant",), registry=r)
        self.tenant_rejections = Counter("cairn_tenant_rejections", "Requests refused before the engines, by "
                                         "tenant and the limit they were over.", ("tenant", "limit"), registry=r)
        self.tenant_tokens = Counter("cairn_tenant_tokens", "Tokens of finished requests, by tenant and kind "
                                     "(prompt, cached, generated).", ("tenant", "kind"), registry=r)
        self.tenant_queue = Histogram("cairn_tenant_queue_seconds", "Seconds an engine request waited in its "
                                      "engine's queue before it first ran, by tenant.", ("tenant",),
                                      buckets=LATENCY_BUCKETS, registry=r)
        self._engine: EngineMetrics | None = None
        self.router_sources: list[Callable[[], Mapping[str, float]]] = []  # the ingress's routers' counters
        self._tokens = [0, 0]  # prompt, cached: the hit ratio's (a counter's value is not public)
        r.register(_EngineCollector(self))

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.errors.labels(str(status)).inc()

    def tenant_admitted(self, tenant: str) -> None:
        self.tenant_requests.labels(tenant).inc()

    def tenant_rejected(self, tenant: str, limit: str) -> None:
        self.tenant_rejections.labels(tenant, limit).inc()

    def tenant_queued(self, tenant: str, seconds: float) -> None:
        self.tenant_queue.labels(tenant).observe(seconds)

    def observe_finished(self, prompt_tokens: int, cached_tokens: int, generated_tokens: int,
                         e2e_seconds: float, tenant: str = "default") -> None:
        for kind, tokens in (("prompt", prompt_tokens), ("cached", cached_tokens), ("generated", generated_tokens)):
            self.tenant_tokens.labels(tenant, kind).inc(tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._tokens[0] += prompt_tokens
        self._tokens[1] += cached_tokens
        self.generated_tokens.inc(generated_tokens)
        self.e2e.observe(e2e_seconds)

    def hit_ratio(self) -> float:
        prompt, cached = self._tokens
        return cached / prompt if prompt else 0.0

    def render(self, engine_metrics: EngineMetrics | None) -> bytes:
        """The whole exposition, with `engine_metrics` (an `EngineClient.metrics()`) as
        `cairn_engine_*` and the routers' counters as `cairn_router_*`."""
        self._engine = engine_metrics
        try:
            return generate_latest(self.registry)
        finally:
            self._engine = None


def engine_families(engine: EngineMetrics | None = None, router: Mapping[str, float] | None = None) -> list[Metric]:
    """An engine's metrics and routers' counters as Prometheus families (module doc)."""
    families: dict[str, Metric] = {}
    if engine is not None and engine.worker_id is not None:
        families["info"] = GaugeMetricFamily("cairn_engine_info", "Engine identity (cairn.workers.engine_metrics.EngineMetrics).",
                                             labels=["worker_id"])
        families["info"].add_metric([engine.worker_id], 1)
    samples = list(engine.samples()) if engine is not None else []
    samples += [(key, None, value) for key, value in sorted((router or {}).items())]
    for key, kind, value in samples:
        prefix = "cairn_" if key.startswith("router_") else "cairn_engine_"
        name = prefix + re.sub(r"[^a-zA-Z0-9_]", "_", key)
        family = families.get(name)
        if family is None:
            source = "Router counter (cairn.cluster.routing.ranker.AffinityRanker.counts)" \
                if name.startswith("cairn_router_") else "Engine metric (cairn.workers.engine_metrics.EngineMetrics)"
            labels = ["kind"] if kind is not None else []
            family = families[name] = CounterMetricFamily(name, f"{source}.", labels=labels) \
                if name.endswith("_total") else GaugeMetricFamily(name, f"{source}.", labels=labels)
        family.add_metric([kind] if kind is not None else [], float(value))
    return list(families.values())


class _EngineCollector:
    def __init__(self, metrics: APIMetrics):
        self.metrics = metrics

    def collect(self) -> list[Metric]:
        router: dict[str, float] = {}
        for source in self.metrics.router_sources:
            router.update(source())
        return engine_families(self.metrics._engine, router)


class TimedClient:
    """An `EngineClient` that times inter-token latency into `metrics` and passes all else on."""

    def __init__(self, client: Any, metrics: APIMetrics):
        self._client, self._metrics = client, metrics
        self.spec = client.spec

    async def generate(self, request: Any) -> AsyncIterator[Any]:
        stream, last = self._client.generate(request), None
        try:
            async for out in stream:
                now, n = time.monotonic(), len(out.new_token_ids)
                if last is not None and n:
                    for _ in range(n):
                        self._metrics.inter_token.observe((now - last) / n)
                last = now
                yield out
        finally:
            await stream.aclose()  # now, not when collected: closing is what aborts the request

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
