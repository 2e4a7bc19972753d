"""Small host-side helpers the Triton launchers share.

`INTERPRETED`: whether this process runs Triton interpreted. It is fixed when triton is first
imported (TRITON_INTERPRET=1 then makes even triton's own `tl.sum` interpreted), so one process
cannot run both interpreted and compiled kernels.

`tuned(configs, key, ...)`: how a kernel is autotuned. Compiled, over a few configs keyed on its
shapes (triton.autotune, which benchmarks them at the first launch of each key: in an engine, in
its warm-up, before any request; the choices are kept on disk, `tuning_cache`). Interpreted, where autotuning
cannot run, at the first config, fixed. Launchers pass none of a config's names, and give a grid
that depends on them as a function of them (`grid(meta)`).

Importing it installs `compile_watch` (every Triton compile of the process counted), telling it
`INTERPRETED`.

`FILL`: when set (tests set NaN), every buffer a launcher allocates, outputs and scratch alike, is
filled with it instead of left uninitialised (integer buffers with their dtype's minimum), so a kernel that reads memory nobody wrote, or
leaves part of its output unwritten, fails loudly rather than by luck.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.common import compile_watch, tuning_cache

LAUNCH = ("num_warps", "num_stages")  # a config's launch options; its other names are the kernel's constexprs
INTERPRETED = not isinstance(tl.standard.sum, triton.runtime.jit.JITFunction)
FILL: float | None = None


class Fixed:
    """An interpreted kernel launched at one config (what `tuned` gives under TRITON_INTERPRET=1):
    the first of its candidates (with `per`, the first of those for the launch's value of it)."""

    def __init__(self, kernel, configs: list[dict] | dict, per: str | None):
        self.kernel, self.fn, self.configs, self.per = kernel, kernel.fn, configs, per

    def config_for(self, kwargs: dict) -> dict:
        return dict(self.configs[kwargs[self.per]][0] if self.per else self.configs[0])

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            config = self.config_for(kwargs)
            return self.kernel[grid(config) if callable(grid) else grid](*args, **config, **kwargs)
        return launch


def _config(c: dict) -> triton.Config:
    return triton.Config({k: v for k, v in c.items() if k not in LAUNCH}, num_warps=c.get("num_warps", 4),
                         num_stages=c.get("num_stages", 3))


def tuned(configs: list[dict] | dict, key: list[str], reset_to_zero: tuple[str, ...] = (),
          restore_value: tuple[str, ...] = (), per: str | None = None):
    """Decorates a @triton.jit kernel (see the module doc). `configs`: meta-parameters, with
    `num_warps` and `num_stages` (default 4 and 3) among them; with `per` (a constexpr the launcher
    passes, e.g. a tile's rows), a dict of such lists by that constexpr's value: a launch tries only
    those. `key`: argument names whose values select a tuning; `reset_to_zero` and
    `restore_value`: outputs a kernel accumulates into or updates in place, reset or restored
    around each benchmark run so that tuning leaves what one launch would."""
    def wrap(kernel):
        if INTERPRETED:
            kernel.tune_key = tuple(key)  # a compiled process tunes once per value (compile_watch)
            return Fixed(kernel, configs, per)
        by_value = {v: [_config(c) for c in cs] for v, cs in configs.items()} if per else None
        candidates = [c for cs in by_value.values() for c in cs] if per else [_config(c) for c in configs]
        prune = None
        if per:
            def prune_to(all_configs, named_args, **kwargs):
                return by_value[kwargs[per] if per in kwargs else named_args[per]]
            prune = {"early_config_prune": prune_to}
        tuner = triton.autotune(candidates, key=key, prune_configs_by=prune, reset_to_zero=list(reset_to_zero) or None,
                                restore_value=list(restore_value) or None)(kernel)
        tuning_cache.TUNED.append(tuner)
        return tuner
    return wrap


compile_watch.install(INTERPRETED)


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    if FILL is None:
        return torch.empty(*shape, dtype=dtype, device=device)
    if not dtype.is_floating_point:  # integer scratch: the most negative value, an index nothing may use
        return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)
    return torch.full(shape, FILL, dtype=dtype, device=device)


def empty_like(t: Tensor) -> Tensor:
    return empty(*t.shape, dtype=t.dtype, device=t.device)


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, which launchers size their grids by (interpreted on
    CPU tensors: a small number, so that the tests still cover every grid shape)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def pow2(n: int, least: int = 16) -> int:
    """The block size covering n: a power of two, at least `least` (tl.dot wants >= 16)."""
    return max(least, triton.next_power_of_2(max(int(n), 1)))


def unit_last(t: Tensor) -> Tensor:
    """`t` itself when its last dim is contiguous (kernels take the other strides), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def dot_dtype(t: Tensor) -> tl.dtype:
    """Matmul operand dtype for data stored as `t`: 16-bit stays 16-bit (tensor cores), else fp32.
    Interpreted, always fp32: the interpreter's tl.dot of bf16 operands returns garbage."""
    if INTERPRETED:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(t.dtype, tl.float32)
