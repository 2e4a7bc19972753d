"""Engine options: one immutable value, built once and handed whole to the engine, its ranks and
the arena's sizing.

Every field is checked at construction; a bad value raises `EngineOptionError` (a `ValueError`)
whose `option` is the field and whose message names it and its allowed range. Sizes say their
unit: tokens, pages, slots or bytes. Code that needs other values makes a new one
(`dataclasses.replace`: the deploy's and the engine's dtype, the arena sized from a device's
free memory).

`from_config(config)` is the one way from a plain mapping (a Serve config's `engine_options`) to
a value: a key that is no option fails there, named. Across processes the value itself travels
(pickled: frozen, plain fields), never a mapping.

`dtype="auto"`: the engine's device and processor choose (`cairn.workers.precision`).
`SERVED`: what a server's engine runs unless told otherwise (`cairn serve`, in process or as
replicas): every field's default, warm-up on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from cairn.workers.precision import DTYPE_NAMES

MAX_SPECULATIVE_TOKENS = 4  # the most tokens the MTP head drafts a step (cairn.workers.speculative)
# `cache_policy`'s values: where checkpoints go and which kinds earn their keep
# (cairn.workers.cache.checkpoint_policy, whose `POLICY_KINDS` names each one's kinds)
CACHE_POLICIES = ("cairn", "exact", "all", "interval", "end_branch")


class EngineOptionError(ValueError):
    """An engine option that does not exist or is out of its range. `option`: its name."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option, self.message = option, message

    def __reduce__(self):  # keeps `option` across processes (Ray)
        return type(self), (self.option, self.message)


@dataclass(frozen=True)
class EngineOptions:
    page_size: int = 16                       # tokens per KV page
    num_pages: int | None = None              # cap on KV pages; alone, it also sizes the arena (cairn.workers.cache.arena)
    cache_memory_bytes: int | None = None     # the arena: pages, running states, checkpoints (256 MiB default)
    max_checkpoints: int | None = None        # cap on checkpoints; None = as many as the arena pays
    cache_policy: str = "cairn"               # cairn | exact | all | interval | end_branch
    tail_guard: int = 4                       # tokens before a prompt's end the tail checkpoint keeps clear
    checkpoint_interval_pages: int = 32       # pages between `interval` checkpoints
    max_num_seqs: int = 64                    # sequences running at once (each holds a state slot)
    max_num_batched_tokens: int = 2048        # tokens computed in one step (decodes + prefill chunks; vLLM's server default)
    max_image_tokens_per_step: int | None = None  # image tokens one step encodes (cairn.workers.image_budget); None: max_num_batched_tokens
    max_model_len: int | None = None          # prompt + output tokens; None = model's max positions
    dtype: str = "auto"                       # float32 | bfloat16 | float16 | auto (cairn.workers.precision)
    device: str = "auto"                      # cpu | cuda | cuda:N | auto (cuda when present)
    seed: int = 0                             # randomness of requests that carry no seed
    memory_utilization: float | None = None   # CUDA: size the arena from what the device has left (cairn.workers.cache.device_budget)
    tensor_parallel_size: int = 1             # devices (ranks) one engine spans (cairn.workers.execution.tp_runner)
    collective_timeout_s: float = 60.0        # the longest a rank waits on the others in a step
    host_cache_bytes: int = 0                 # host tier: what the device evicts is kept here (0: off; cairn.workers.cache.host_tier)
    enforce_eager: bool | None = None         # no decode graphs (None: graphs on CUDA, eager on CPU; cairn.workers.execution.decode_graphs)
    warm_up: bool = False                     # compile every kernel shape at load (Engine.warm_up); servers turn it on
    async_scheduling: bool = False            # plan and launch a decode step before the last one's tokens are read (Engine.step)
    num_speculative_tokens: int = 0           # tokens the checkpoint's MTP head drafts a step, 0-4 (0: off; cairn.workers.speculative)
    speculative_exact: bool = False           # verify drafts through the decode kernels, row by row: output exactly k = 0's
    speculative_adaptive: bool = True         # draft only while verify steps give more tokens/s than plain ones (measured)
    speculative_max_num_seqs: int | None = None  # N: a step verifies at most k x N drafted tokens (None: max_num_seqs), each a state slot

    @property
    def verifying_seqs(self) -> int:
        """N sequences' worth of drafts one step verifies at most: k x N spare state slots, one a
        drafted token (cairn.workers.cache.arena); past them, a sequence decodes without drafts
        that step."""
        return min(self.speculative_max_num_seqs or self.max_num_seqs, self.max_num_seqs)

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if allow_none and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineOptionError(name, f"{name} must be a positive integer{' or None' if allow_none else ''}, "
                                              f"got {v!r}")

        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "checkpoint_interval_pages",
                     "tensor_parallel_size"):
            positive(name)
        for name in ("num_pages", "cache_memory_bytes", "speculative_max_num_seqs", "max_image_tokens_per_step"):
            positive(name, allow_none=True)
        if isinstance(self.host_cache_bytes, bool) or not isinstance(self.host_cache_bytes, int) or \
                self.host_cache_bytes < 0:
            raise EngineOptionError("host_cache_bytes", f"host_cache_bytes must be an integer >= 0 (0: no host tier), "
                                                        f"got {self.host_cache_bytes!r}")
        if self.max_checkpoints is not None and (not isinstance(self.max_checkpoints, int) or self.max_checkpoints < 0):
            raise EngineOptionError("max_checkpoints", f"max_checkpoints must be an integer >= 0 or None, "
                                                       f"got {self.max_checkpoints!r}")
        if isinstance(self.tail_guard, bool) or not isinstance(self.tail_guard, int) or self.tail_guard < 0:
            raise EngineOptionError("tail_guard", f"tail_guard must be an integer >= 0, got {self.tail_guard!r}")
        positive("max_model_len", allow_none=True)
        share = self.memory_utilization
        if share is not None:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise EngineOptionError("memory_utilization",
                                        f"memory_utilization must be a fraction in (0, 1], got {share!r}")
            if self.cache_memory_bytes is not None or self.num_pages is not None:
                raise EngineOptionError("memory_utilization", "memory_utilization sizes the arena itself: give it, "
                                        "or cache_memory_bytes / num_pages, not both")
        timeout = self.collective_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise EngineOptionError("collective_timeout_s",
                                    f"collective_timeout_s must be a positive number of seconds, got {timeout!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise EngineOptionError("num_speculative_tokens", f"num_speculative_tokens must be an integer from 0 "
                                                              f"(off) to {MAX_SPECULATIVE_TOKENS}, got {k!r}")
        for name in ("warm_up", "async_scheduling", "speculative_exact", "speculative_adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise EngineOptionError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.enforce_eager not in (None, True, False):
            raise EngineOptionError("enforce_eager", f"enforce_eager must be true, false or None (graphs on CUDA "
                                                     f"only), got {self.enforce_eager!r}")
        if not isinstance(self.cache_policy, str) or self.cache_policy not in CACHE_POLICIES:
            raise EngineOptionError("cache_policy", f"cache_policy must be one of {sorted(CACHE_POLICIES)}, "
                                                    f"got {self.cache_policy!r}")
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise EngineOptionError("dtype", f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise EngineOptionError("device", f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, object], base: EngineOptions | None = None) -> EngineOptions:
        """The options `config` (option name -> value, as YAML or JSON gives them) sets, the others
        `base`'s (default: every field's default); checked as any construction is."""
        if not isinstance(config, Mapping):
            raise EngineOptionError("engine_options", f"engine_options must map option names to values, "
                                                      f"got {config!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known, key=str)
        if unknown:
            raise EngineOptionError(str(unknown[0]), f"unknown engine option(s) {unknown}; "
                                                     f"expected some of {sorted(known)}")
        return replace(base or cls(), **config)


SERVED = EngineOptions(warm_up=True)  # a server's engine where nothing else is said: compiled before its first request
