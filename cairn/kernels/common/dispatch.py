"""Which implementation runs an op: the one choice every op package makes, through `Ops.pick`.

An op package (`cairn.kernels.attention`, ...) declares its implementations once, as an `Ops`:
- `cuda`: modules for CUDA tensors: compiled Triton kernels, or torch ops on the device where no
  kernel of ours exists (sampling);
- `cpu`: modules for CPU tensors; a module that sets `NATIVE = True` launches the C++ library
  (`cairn.kernels.common.native`) and is passed over where that library is not loaded;
- `fallback`: the op's torch reference (its oracle in the tests), the slow fallback: run only where
  no module above has the op (the C++ library not built, a CUDA tensor in a process that
  imported Triton interpreted), or everywhere while `CAIRN_KERNELS=reference` (read at every call)
  or `force_reference(True)` asks for it, to rule out a suspected kernel.
The first module, in order, that defines the op runs it. A process runs Triton either compiled or
interpreted, fixed when triton is first imported: under TRITON_INTERPRET=1 (the CPU tests) no kernel
can compile, so CUDA tensors there run the fallback, with a warning (a test session on a GPU machine
keeps working; tests/kernels/test_triton_gpu.py runs the compiled kernels in a child process). The
CPU tests run the interpreted kernels by importing an op's `triton_ops` module directly.
Which module runs an op is remembered per (op, device type, forced): the hot path pays a dict
lookup and a getattr (so a test that patches a module's function is heard).
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

_forced = False
_warned_interpreted = False
_routed: str | None = None  # a device type every pick takes instead of its tensor's (`routed_as`)
_every: list[Ops] = []  # every op package's Ops, for `forget`


def force_reference(on: bool = True) -> None:
    """Run the torch references on every device (or, with on=False, go back to the default)."""
    global _forced
    _forced = bool(on)


def reference_forced() -> bool:
    return _forced or os.environ.get("CAIRN_KERNELS", "").strip().lower() == "reference"


INTERPRETED_CUDA = "cuda-interpreted"


@contextmanager
def routed_as(device: str) -> Iterator[None]:
    """Within it, every op picks as if its tensors were on `device` (the step census runs CUDA's
    launchers' host code over CPU tensors, cairn.workers.execution.step_census). `INTERPRETED_CUDA`:
    CUDA's implementations, run on CPU tensors by the Triton interpreter (a test of what an engine
    on a GPU launches and compiles, in a TRITON_INTERPRET=1 process)."""
    global _routed
    saved, _routed = _routed, device
    try:
        yield
    finally:
        _routed = saved


def routed() -> str | None:
    """The device every pick takes now instead of its tensor's (None: the tensor's own)."""
    return _routed


def forget() -> None:
    """Drop every remembered pick (a test that changes what a process can run calls it)."""
    for ops in _every:
        ops._picked.clear()


def triton_compiled() -> bool:
    """Whether this process can launch compiled Triton (imports triton: call it for CUDA tensors only)."""
    from cairn.kernels.common import triton_helpers

    if triton_helpers.INTERPRETED:
        global _warned_interpreted
        if not _warned_interpreted:
            _warned_interpreted = True
            warnings.warn("TRITON_INTERPRET=1 in this process: CUDA tensors run the torch reference ops",
                          RuntimeWarning, stacklevel=4)
        return False
    return True


def runs_triton(device: str) -> bool:
    """Whether ops on tensors of `device` (a type: "cuda", "cpu") run Triton kernels here: compiled
    on CUDA (unless the references are forced), or interpreted under `routed_as(INTERPRETED_CUDA)`."""
    if _routed == INTERPRETED_CUDA:
        return True
    return device == "cuda" and not reference_forced() and triton_compiled()


def native_loaded() -> bool:
    """Whether the C++ library CPU tensors run on is loaded (building it on the first call)."""
    from cairn.kernels.common import native

    return native.library()


@dataclass(frozen=True)
class Ops:
    """One op package's implementations, by device (module names, imported on first use)."""

    cuda: tuple[str, ...]
    cpu: tuple[str, ...]
    fallback: str
    _picked: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        _every.append(self)

    def pick(self, name: str, tensor) -> Callable:
        """The function that runs op `name` on `tensor`'s device."""
        key = (name, _routed or tensor.device.type, reference_forced())
        module = self._picked.get(key)
        if module is None:
            module = self._picked[key] = self._choose(name, key[1], key[2])
        return getattr(module, name)

    def _choose(self, name: str, device: str, forced: bool) -> ModuleType:
        for module in () if forced else self._modules(device):
            if hasattr(module, name):
                return module
        return importlib.import_module(self.fallback)

    def _modules(self, device: str) -> list[ModuleType]:
        if device == "cuda":
            return [importlib.import_module(m) for m in self.cuda] if triton_compiled() else []
        if device == INTERPRETED_CUDA:
            return [importlib.import_module(m) for m in self.cuda]
        if device == "cpu":
            modules = [importlib.import_module(m) for m in self.cpu]
            return [m for m in modules if not getattr(m, "NATIVE", False) or native_loaded()]
        return []
