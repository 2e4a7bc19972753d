"""How a request wants its tokens chosen and when it stops.

Contract: a `SamplingParams` that exists is valid — construction checks every field and raises
`RequestRejected` (a `ValueError`) whose `param` is the field and whose message gives its allowed
range, so a bad value never reaches a step.
`temperature == 0` (or `top_k == 1`) means greedy. `top_k` of 0 or -1 disables top-k.
`logprobs = k` returns, for each generated token, its log-probability under the model's raw
distribution (before temperature/top-p/top-k) and the k most likely alternatives.
A `seed` makes sampling reproducible, also across preemption and batching: the random draw for
output token i depends only on (seed, i).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.errors import RequestRejected

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise RequestRejected(f"{name} must be {allowed}, got {getattr(self, name)!r}", name)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN

        check(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1")
        check(is_num(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature", "in [0, 2]")
        check(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(is_int(self.top_k) and self.top_k >= -1, "top_k", "-1, 0 (disabled) or a positive integer")
        check(self.seed is None or (is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
              "seed", f"None or an integer in [0, {MAX_SEED}]")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        stops = self.stop_token_ids
        check(isinstance(stops, (list, tuple)) and all(is_int(t) and t >= 0 for t in stops),
              "stop_token_ids", "a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
