"""Engine options: the knobs `Engine.from_pretrained(dir, **options)` accepts.

Every field is checked at construction; a bad value raises `ValueError` naming the field and its
allowed range. Sizes say their unit: tokens, pages, slots or bytes.

`dtype="auto"` (`choose_dtype`): on CUDA, the checkpoint's dtype; on a CPU that computes bf16
natively (AVX512-BF16 or AMX), bfloat16 (faster than fp32 there: about 1.4x prefill and 1.5x
decode on the bench demo model); on any other CPU, float32. `$CAIRN_DTYPE`, when set, is what
auto picks instead (the test suite pins float32: its parity oracles are fp32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

DTYPE_NAMES = ("float32", "bfloat16", "float16")
AUTO_DTYPE_ENV = "CAIRN_DTYPE"


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX tiles)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def choose_dtype(requested: str, config_dtype: str, device_type: str) -> str:
    """The dtype an engine runs in: `requested` unless it is auto (see the module docstring);
    `device_type` is "cuda" or "cpu"."""
    if requested != "auto":
        return requested
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if forced:
        if forced not in DTYPE_NAMES:
            raise ValueError(f"${AUTO_DTYPE_ENV} must be one of {', '.join(DTYPE_NAMES)}, got {forced!r}")
        return forced
    if device_type == "cuda":
        return config_dtype if config_dtype in DTYPE_NAMES else "bfloat16"
    return "bfloat16" if native_bf16_cpu() else "float32"


@dataclass(frozen=True)
class EngineOptions:
    page_size: int = 16                       # tokens per KV page
    num_pages: int | None = None              # cap on KV pages; alone, it also sizes the arena (workers.arena)
    cache_memory_bytes: int | None = None     # the arena: pages, running states, checkpoints (256 MiB default)
    max_checkpoints: int | None = None        # cap on checkpoints; None = as many as the arena pays
    cache_policy: str = "cairn"               # cairn | exact | all | interval | end_branch
    tail_guard: int = 4                       # tokens before a prompt's end the tail checkpoint keeps clear
    checkpoint_interval_pages: int = 32       # pages between `interval` checkpoints
    max_num_seqs: int = 64                    # sequences running at once (each holds a state slot)
    max_num_batched_tokens: int = 1024        # tokens computed in one step (decodes + prefill chunks)
    max_model_len: int | None = None          # prompt + output tokens; None = model's max positions
    dtype: str = "auto"                       # float32 | bfloat16 | float16 | auto (choose_dtype)
    device: str = "auto"                      # cpu | cuda | cuda:N | auto (cuda when present)
    seed: int = 0                             # randomness of requests that carry no seed
    memory_utilization: float | None = None   # CUDA: size the arena from what the device has left (workers.device_budget)
    tensor_parallel_size: int = 1             # devices (ranks) one engine spans (workers.tp_runner)
    collective_timeout_s: float = 60.0        # the longest a rank waits on the others in a step
    host_cache_bytes: int = 0                 # host tier: what the device evicts is kept here (0: off; workers.host_tier)

    def device_type(self) -> str:
        """"cuda" or "cpu": where an engine with these options runs (auto: CUDA when present)."""
        if self.device == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return "cuda" if self.device.startswith("cuda") else "cpu"

    def run_dtype(self, config_dtype: str) -> str:
        """The dtype the engine runs in, for a checkpoint whose config says `config_dtype`."""
        return choose_dtype(self.dtype, config_dtype, self.device_type())

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if allow_none and v is None:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer{' or None' if allow_none else ''}, got {v!r}")

        for name in ("page_size", "max_num_seqs", "max_num_batched_tokens", "checkpoint_interval_pages",
                     "tensor_parallel_size"):
            positive(name)
        for name in ("num_pages", "cache_memory_bytes"):
            positive(name, allow_none=True)
        if isinstance(self.host_cache_bytes, bool) or not isinstance(self.host_cache_bytes, int) or \
                self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be an integer >= 0 (0: no host tier), got {self.host_cache_bytes!r}")
        if self.max_checkpoints is not None and (not isinstance(self.max_checkpoints, int) or self.max_checkpoints < 0):
            raise ValueError(f"max_checkpoints must be an integer >= 0 or None, got {self.max_checkpoints!r}")
        if isinstance(self.tail_guard, bool) or not isinstance(self.tail_guard, int) or self.tail_guard < 0:
            raise ValueError(f"tail_guard must be an integer >= 0, got {self.tail_guard!r}")
        positive("max_model_len", allow_none=True)
        share = self.memory_utilization
        if share is not None:
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise ValueError(f"memory_utilization must be a fraction in (0, 1], got {share!r}")
            if self.cache_memory_bytes is not None or self.num_pages is not None:
                raise ValueError("memory_utilization sizes the arena itself: give it, or cache_memory_bytes / "
                                 "num_pages, not both")
        timeout = self.collective_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"collective_timeout_s must be a positive number of seconds, got {timeout!r}")
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; expected some of {sorted(known)}")
        return cls(**kwargs)  # type: ignore[arg-type]
