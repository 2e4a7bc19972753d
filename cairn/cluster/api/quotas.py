"""What each tenant may hold of the server at once, and per minute: `TenantLimits`, `TenantQuotas`.

A shared endpoint serves tenants (`cairn.cluster.api.tenants`) who must not starve each other. Per
tenant, an ingress counts the engine requests it has accepted (one per choice and prompt) from
the moment they are admitted until their stream ends, and refuses a request that would take the
tenant past a limit, with a 429 in OpenAI's shape (`rate_limit_exceeded`, `param` null) and
`Retry-After`. The limits (`TenantLimits`; server-wide defaults, and per tenant beside its keys):
- `max_requests`: engine requests queued or running at once;
- `max_waiting`: of those, engine requests not yet producing tokens;
- `requests_per_minute`: HTTP requests admitted, a token bucket of that size refilled evenly;
- `tokens_per_minute`: prompt tokens (charged at admission, once per prompt) plus generated
  tokens (charged as the request ends), a token bucket that generated tokens may overdraw; a
  request is admitted while the bucket holds its prompt tokens.
A request that could never pass (more engine requests or prompt tokens than the limit itself)
is refused with no `Retry-After`: retrying does not help. Without keys there are no quotas
(`build_app`): everyone is one tenant, bounded by the server's queue alone.

Counts are this ingress replica's own: behind several ingress replicas a tenant may hold each
one's limit. The engine shares its sequence slots among tenants itself (`cairn.workers.scheduler`);
quotas bound what reaches it. Each outcome is counted in `APIMetrics` by tenant id, never key.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cairn.cluster.api.api_errors import APIError


class TenantLimits(BaseModel):
    """One tenant's limits (module doc); None: unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_requests: int | None = Field(128, ge=1, description=(
        "engine requests (choices times prompts) queued or running at once; half the server's queue, "
        "so no tenant fills it alone"))
    max_waiting: int | None = Field(64, ge=1, description=(
        "of those, engine requests not yet producing tokens"))
    requests_per_minute: int | None = Field(None, ge=1, description="HTTP requests admitted per minute")
    tokens_per_minute: int | None = Field(None, ge=1, description=(
        "prompt plus generated tokens per minute"))

    def merged(self, values: Mapping[str, Any]) -> "TenantLimits":
        return TenantLimits.model_validate({**self.model_dump(), **values})


LIMIT_FIELDS = tuple(TenantLimits.model_fields)


class _Bucket:
    """A token bucket of `size` refilled at `size` per minute; `level` may go below zero."""

    def __init__(self, size: int, now: float):
        self.size, self.level, self.at = size, float(size), now

    def refill(self, now: float) -> None:
        self.level = min(self.size, self.level + (now - self.at) * self.size / 60.0)
        self.at = now

    def wait_s(self, cost: float) -> float:
        """Seconds until the bucket holds `cost`."""
        return max(0.0, (cost - self.level) * 60.0 / self.size)


@dataclass
class _Tenant:
    limits: TenantLimits
    requests: int = 0  # engine requests admitted and not ended
    waiting: int = 0   # of those, not yet producing tokens
    buckets: dict[str, _Bucket] = field(default_factory=dict)


class TenantQuotas:
    """Per-tenant accounting of one ingress (module doc). `metrics` is an `APIMetrics` (or None)."""

    def __init__(self, defaults: TenantLimits | None = None, per_tenant: Mapping[str, TenantLimits] | None = None,
                 metrics: Any = None, clock: Callable[[], float] = time.monotonic):
        self.defaults, self.per_tenant = defaults or TenantLimits(), dict(per_tenant or {})
        self.metrics, self._clock = metrics, clock
        self._tenants: dict[str, _Tenant] = {}

    def limits_of(self, tenant: str) -> TenantLimits:
        return self.per_tenant.get(tenant, self.defaults)

    def _tenant(self, tenant: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(self.limits_of(tenant))
        return t

    def admit(self, tenant: str, engine_requests: int, prompt_tokens: int) -> "Admission":
        """Takes room for one HTTP request of `engine_requests` engine requests and
        `prompt_tokens` prompt tokens, or raises the 429 that says which limit it is over."""
        t, now = self._tenant(tenant), self._clock()
        lim = t.limits
        held = {"max_requests": t.requests, "max_waiting": t.waiting}
        costs = {"requests_per_minute": 1, "tokens_per_minute": prompt_tokens}
        for name in held:  # first what no retry can pass
            limit = getattr(lim, name)
            if limit is not None and engine_requests > limit:
                self._refuse(tenant, name, f"this request makes {engine_requests} engine requests (choices times "
                                           f"prompts); tenant {tenant} may hold at most {limit} ({name})", None)
        for name, cost in costs.items():
            size = getattr(lim, name)
            if size is not None and cost > size:
                self._refuse(tenant, name, f"this request needs {cost} of tenant {tenant}'s {size} {name}", None)
        for name, count in held.items():
            limit = getattr(lim, name)
            if limit is not None and count + engine_requests > limit:
                self._refuse(tenant, name, f"tenant {tenant} has {count} requests {_held(name)} and may hold at "
                                           f"most {limit} ({name}); retry when some have finished", 1.0)
        for name, cost in costs.items():
            size = getattr(lim, name)
            if size is None:
                continue
            bucket = t.buckets.get(name)
            if bucket is None:
                bucket = t.buckets[name] = _Bucket(size, now)
            bucket.refill(now)
            if bucket.level < cost:
                self._refuse(tenant, name, f"tenant {tenant} is over its {size} {name}; retry later",
                             bucket.wait_s(cost))
        for name, cost in costs.items():
            if name in t.buckets:
                t.buckets[name].level -= cost
        t.requests += engine_requests
        t.waiting += engine_requests
        if self.metrics is not None:
            self.metrics.tenant_admitted(tenant)
        return Admission(self, tenant, engine_requests)

    def _refuse(self, tenant: str, limit: str, message: str, retry_s: float | None) -> None:
        if self.metrics is not None:
            self.metrics.tenant_rejected(tenant, limit)
        headers = {"Retry-After": str(max(1, math.ceil(retry_s)))} if retry_s is not None else None
        raise APIError(429, message, code="rate_limit_exceeded", headers=headers)

    def charge_tokens(self, tenant: str, tokens: int) -> None:
        """Generated tokens against the tenant's tokens_per_minute (the bucket may overdraw)."""
        bucket = self._tenant(tenant).buckets.get("tokens_per_minute")
        if bucket is not None:
            bucket.refill(self._clock())
            bucket.level -= tokens

    def held(self, tenant: str) -> tuple[int, int]:
        """(engine requests held, of them waiting) by the tenant now."""
        t = self._tenants.get(tenant)
        return (t.requests, t.waiting) if t is not None else (0, 0)


def _held(name: str) -> str:
    return "waiting for the engine" if name == "max_waiting" else "in flight"


class Admission:
    """The room one HTTP request took: each of its engine requests leaves `waiting` at its first
    output (`started`) and the tenant's count when it ends (`ended`); both are safe to repeat,
    and `close` ends whatever has not ended (a stream closed before it started)."""

    def __init__(self, quotas: TenantQuotas, tenant: str, count: int):
        self.quotas, self.tenant = quotas, tenant
        self._started, self._ended = [False] * count, [False] * count

    def started(self, index: int) -> None:
        if not self._started[index] and not self._ended[index]:
            self._started[index] = True
            self.quotas._tenants[self.tenant].waiting -= 1

    def ended(self, index: int) -> None:
        if self._ended[index]:
            return
        self.started(index)
        self._ended[index] = True
        self.quotas._tenants[self.tenant].requests -= 1

    def close(self) -> None:
        for i in range(len(self._ended)):
            self.ended(i)
