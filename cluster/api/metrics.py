"""What GET /metrics reports, in Prometheus' text exposition format (version 0.0.4).

Counted by the API: requests by endpoint and status, errors by status, time to first token
and end-to-end latency (histograms, seconds), prompt / cached / generated tokens, and the
prefix hit ratio (cached over prompt tokens). The engine's own counters and gauges (pages held
and cached, checkpoints stored, state bytes, ...) are appended as `cairn_engine_*`, and the
request router's (keys `router_*`: requests ranked, routed, index fallbacks) as `cairn_router_*`;
a key `name:kind` becomes `name{kind="..."}`, and text values (a replica's worker_id) become
labels of `cairn_engine_info`. Kept per app, so two apps in one process never mix.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}" if labels else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if isinstance(v, float) and not float(v).is_integer() else str(int(v))


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{edge}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


class APIMetrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.ttft = Histogram()
        self.e2e = Histogram()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generated_tokens = 0

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def observe_finished(self, prompt_tokens: int, cached_tokens: int, generated_tokens: int,
                         e2e_seconds: float) -> None:
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.generated_tokens += generated_tokens
        self.e2e.observe(e2e_seconds)

    def render(self, engine_metrics: dict[str, float]) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[str]) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        family("cairn_requests_total", "counter", "HTTP requests by endpoint and status code.",
               [f"cairn_requests_total{_labels(endpoint=e, status=str(s))} {n}"
                for (e, s), n in sorted(self.requests.items())])
        errors: dict[int, int] = defaultdict(int)
        for (_, status), n in self.requests.items():
            if status >= 400:
                errors[status] += n
        family("cairn_request_errors_total", "counter", "HTTP requests answered with an error, by status code.",
               [f"cairn_request_errors_total{_labels(status=str(s))} {n}" for s, n in sorted(errors.items())])
        family("cairn_time_to_first_token_seconds", "histogram", "Seconds from request arrival to the first token.",
               self.ttft.lines("cairn_time_to_first_token_seconds"))
        family("cairn_e2e_request_latency_seconds", "histogram", "Seconds from request arrival to its last token.",
               self.e2e.lines("cairn_e2e_request_latency_seconds"))
        for name, value, text in (
                ("cairn_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
                ("cairn_cached_tokens_total", self.cached_tokens, "Prompt tokens served from the prefix cache."),
                ("cairn_generated_tokens_total", self.generated_tokens, "Tokens generated.")):
            family(name, "counter", text, [f"{name} {value}"])
        ratio = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        family("cairn_prefix_hit_ratio", "gauge", "Cached over prompt tokens since start.",
               [f"cairn_prefix_hit_ratio {ratio!r}"])
        info = {k: str(v) for k, v in sorted(engine_metrics.items()) if not isinstance(v, (int, float))}
        if info:  # text values (the replica's worker_id): labels of one info gauge
            family("cairn_engine_info", "gauge", "Engine identity (text values of workers.Engine.metrics).",
                   [f"cairn_engine_info{_labels(**info)} 1"])
        grouped: dict[str, list[str]] = defaultdict(list)
        for key, value in sorted(engine_metrics.items()):
            if key in info:
                continue
            base, _, kind = key.partition(":")
            prefix = "cairn_" if base.startswith("router_") else "cairn_engine_"
            name = prefix + re.sub(r"[^a-zA-Z0-9_]", "_", base)
            grouped[name].append(f"{name}{_labels(kind=kind) if kind else ''} {_num(value)}")
        for name, samples in grouped.items():
            source = "Router counter (cluster.routing.ranker.AffinityRanker.counts)" \
                if name.startswith("cairn_router_") else "Engine metric (workers.Engine.metrics)"
            family(name, "counter" if name.endswith("_total") else "gauge", f"{source}.", samples)
        return "\n".join(lines) + "\n"
