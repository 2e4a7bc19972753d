"""How a request wants its tokens chosen and when it stops.

Contract: a `SamplingParams` that exists is valid — construction checks every field and raises
`SamplingParamError` (a `RequestRejected`, so a `ValueError`) whose `field` is the field and whose
`reason` gives its allowed range, so a bad value never reaches a step.
Each field's default is defined here once, by the dataclass; `DEFAULTS` reads them, and the API
(a field a request leaves out keeps it), its schema, `cairn serve --help`, `cairn generate --help`
and docs/serving.md (a test compares) state them from there.
`temperature == 0` (or `top_k == 1`) means greedy. `top_k` of 0 or -1 disables top-k; `min_p`
keeps the tokens whose probability is at least `min_p` times the most likely one's.
Penalties and biases change the logits before temperature and the filters, with vLLM's and
OpenAI's semantics: `presence_penalty` subtracts its value from every token already in the
output, `frequency_penalty` its value times how often it is there (both in [-2, 2]);
`repetition_penalty` divides the positive logits (multiplies the negative ones) of every token in
the prompt or the output (in (0, 2]; 1 = off); `logit_bias` adds a value in [-100, 100] to a token
id's logit (the engine checks the ids against its vocabulary); `min_tokens` masks the EOS and stop
ids until that many tokens are out (at most `max_tokens`). Greedy rows take the argmax of the
changed logits.
`logprobs = k` returns, for each generated token, its log-probability under the model's raw
distribution (before temperature/top-p/top-k) and the k most likely alternatives.
`grammar` (a `cairn.workers.grammar.Grammar`) constrains the output to a grammar: structured outputs
and forced tool calls; greedy and sampled rows alike choose among the tokens it allows.
A `seed` makes sampling reproducible, also across preemption and batching: the random draw for
output token i depends only on (seed, i).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from cairn.workers.engine_errors import SamplingParamError

if TYPE_CHECKING:  # imported when a grammar is checked: this module stays free of numpy (`cairn --help`)
    from cairn.workers.grammar import Grammar

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0
MAX_PENALTY = 2.0


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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # (token id, bias), ids distinct
    min_tokens: int = 0
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise SamplingParamError(name, f"must be {allowed}, got {getattr(self, name)!r}")

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
        check(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            check(is_num(getattr(self, name)) and -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY, name,
                  f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        check(is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= MAX_PENALTY,
              "repetition_penalty", f"in (0, {MAX_PENALTY:g}]")
        bias = self.logit_bias
        bias = tuple(bias.items()) if isinstance(bias, dict) else bias
        check(isinstance(bias, (list, tuple)) and all(
            isinstance(e, (list, tuple)) and len(e) == 2 and is_int(e[0]) and e[0] >= 0 and is_num(e[1])
            and -MAX_LOGIT_BIAS <= e[1] <= MAX_LOGIT_BIAS for e in bias)
            and len({e[0] for e in bias}) == len(bias),
            "logit_bias", f"distinct non-negative token ids with biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              "an integer in [0, max_tokens]")
        if self.grammar is not None:
            from cairn.workers.grammar import Grammar

            check(isinstance(self.grammar, Grammar), "grammar", "None or a cairn.workers.grammar.Grammar")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether the logits depend on the tokens seen so far (a row of token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


# field -> its default (a factory's value for the tuples): the one definition, read by every layer
DEFAULTS: dict[str, Any] = {f.name: f.default_factory() if f.default is MISSING else f.default
                            for f in fields(SamplingParams)}
