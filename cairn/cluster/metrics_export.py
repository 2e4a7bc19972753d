"""The cluster-wide metrics: every replica's numbers in Ray's metrics export, not one replica's.

An ingress's GET /metrics answers from whichever ingress replica Serve's proxy picked, with one
engine replica's numbers; a cluster needs every replica's. So each replica copies its own into
Ray's metrics (`ray.serve.metrics` gauges, which Serve tags with `deployment`, `replica` and
`application`), and Ray's metrics agent on each node serves them to Prometheus, prefixed `ray_`,
on the node's metrics export port (`ray start --metrics-export-port`, or `ray.nodes()`'s
`MetricsExportPort`). Nothing here scrapes anything:
- an engine replica's drain loop copies `workers.Engine.metrics()` every
  `ENGINE_EXPORT_INTERVAL_S` (`ray_cairn_engine_*`, as `cairn.cluster.api.api_metrics.engine_families`
  names them for /metrics);
- an ingress replica copies its API metrics (requests, time to first token, inter-token and
  end-to-end latency, tokens: `ray_cairn_*`) and its routers' counters (`ray_cairn_router_*`)
  every `INGRESS_EXPORT_INTERVAL_S`. A histogram is copied bucket by bucket as gauges with an
  `le` tag, so `histogram_quantile` reads it as it reads a native one.
Every series is a gauge holding the replica's current value (a counter's total, too): PromQL's
`rate()` and `increase()` treat a gauge that only grows as a counter and restart with a replica.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

ENGINE_EXPORT_INTERVAL_S = 1.0
INGRESS_EXPORT_INTERVAL_S = 2.0
RAY_PREFIX = "ray_"  # what Ray's export puts before every name


class RayMetricsMirror:
    """Sets one Ray gauge per sample name (and label names) to each sample's value."""

    def __init__(self) -> None:
        self._gauges: dict[tuple[str, tuple[str, ...]], object] = {}

    def export(self, families: Iterable[Metric]) -> None:
        from ray.serve.metrics import Gauge

        for family in families:
            for sample in family.samples:
                if sample.name.endswith("_created"):  # prometheus_client's counter start times
                    continue
                tags = tuple(sorted(sample.labels))
                gauge = self._gauges.get((sample.name, tags))
                if gauge is None:
                    gauge = self._gauges[(sample.name, tags)] = Gauge(
                        sample.name, description=family.documentation or sample.name, tag_keys=tags)
                gauge.set(sample.value, tags=dict(sample.labels))  # type: ignore[attr-defined]
