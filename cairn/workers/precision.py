"""Which dtype an engine runs in: `dtype="auto"` resolved for a device and a processor.

`choose_dtype(requested, config_dtype, device_type)`: `requested` unless it is auto; auto is
- `$CAIRN_DTYPE`, when set (the test suite pins float32: its parity oracles are fp32);
- on CUDA, the checkpoint's dtype;
- on a CPU that computes bf16 natively (AVX512-BF16 or AMX tiles), bfloat16: faster than fp32
  there (on the bench demo model, about 1.4x prefill and 1.5x decode);
- on any other CPU, float32.
`run_dtype(options, config_dtype)` applies it to `EngineOptions`, their `device` (auto: CUDA
when present) deciding the device. Torch is imported only when the processor or CUDA is asked
about, so the plan-making code that names dtypes (options, spec) imports none.
"""

from __future__ import annotations

import os
from typing import Any

DTYPE_NAMES = ("float32", "bfloat16", "float16")
AUTO_DTYPE_ENV = "CAIRN_DTYPE"


def native_bf16_cpu() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX tiles)."""
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def device_type(device: str) -> str:
    """"cuda" or "cpu" for an `EngineOptions.device` value (auto: CUDA when present)."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if device.startswith("cuda") else "cpu"


def choose_dtype(requested: str, config_dtype: str, device_kind: str) -> str:
    """The dtype an engine runs in (see the module docstring); `device_kind` is "cuda" or "cpu"."""
    if requested != "auto":
        return requested
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if forced:
        if forced not in DTYPE_NAMES:
            raise ValueError(f"${AUTO_DTYPE_ENV} must be one of {', '.join(DTYPE_NAMES)}, got {forced!r}")
        return forced
    if device_kind == "cuda":
        return config_dtype if config_dtype in DTYPE_NAMES else "bfloat16"
    return "bfloat16" if native_bf16_cpu() else "float32"


def run_dtype(options: Any, config_dtype: str) -> str:
    """The dtype an engine with `options` (an `EngineOptions`) runs a checkpoint of `config_dtype` in."""
    return choose_dtype(options.dtype, config_dtype, device_type(options.device))
