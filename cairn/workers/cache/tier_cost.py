"""Whether bringing cache back from the host beats recomputing it: the rule, with measured rates
(and the engine's step time, which a peer fetching from this engine waits for).

A resume point on the host costs a copy (bytes / the host-to-device bandwidth); every token it
does not skip costs a prefill (tokens / the prefill rate). The prefix cache weighs each resume
point it could use by `seconds(copy_bytes, recompute_tokens)` and takes the cheapest, so a
host-resident checkpoint is used only when copying it (and the pages under it) is cheaper than
computing what it saves.

Both rates are measured, not configured: the runner times its host copies (`observe_copy`), the
engine times its steps that prefill (`observe_prefill`); each is an exponential moving average.
The engine also times every step that ran (`observe_step`): not part of this rule, but reported
beside the rates, since the router prices a peer fetch's wait for the holder's step with it
(`cairn.cluster.routing.cost.fetch_tokens`).
Before a rate is known, the rule assumes copying wins (a copy is cheaper than a prefill on every
machine cairn runs on, by orders of magnitude at real model sizes). Plain Python.
"""

from __future__ import annotations


class TierCost:
    ALPHA = 0.2  # weight of the newest measurement

    def __init__(self, bandwidth: float | None = None, prefill_rate: float | None = None):
        """bandwidth: host <-> device bytes/s; prefill_rate: prefill tokens/s (None: unknown)."""
        self.bandwidth, self.prefill_rate = bandwidth, prefill_rate
        self.step_seconds: float | None = None  # a step's wall time

    @staticmethod
    def _average(old: float | None, new: float) -> float:
        return new if old is None else old + TierCost.ALPHA * (new - old)

    def observe_copy(self, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0 and seconds > 0:
            self.bandwidth = self._average(self.bandwidth, num_bytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_rate = self._average(self.prefill_rate, tokens / seconds)

    def observe_step(self, seconds: float) -> None:
        if seconds > 0:
            self.step_seconds = self._average(self.step_seconds, seconds)

    def seconds(self, copy_bytes: int, recompute_tokens: int) -> float:
        """Estimated seconds to resume a prompt by copying `copy_bytes` from the host and
        recomputing `recompute_tokens`. Unknown rates: a copy costs nothing, a token a second."""
        copy = copy_bytes / self.bandwidth if copy_bytes and self.bandwidth else 0.0
        return copy + recompute_tokens / (self.prefill_rate or 1.0)
