"""Counts, on CPU, what code would ask of a GPU: kernel launches, host syncs and uploads of host
data, each by phase of the engine step, by layer kind and by call site.

Contract: inside `with Census() as c:` every aten op dispatched is seen (a TorchDispatchMode),
every Triton launch is recorded instead of started (`JITFunction.run` is replaced), and every
tensor read back by the host is caught (`Tensor.tolist`, `.numpy`, `.cpu`). The counts are the
same ones the code makes on CUDA, because it is the same host code: the op kinds below are
classified as a GPU would pay for them, whatever device the tensors are on here.
- a launch: an aten op that computes (not a view, alias or allocation), a Triton launch, or a
  collective (`CensusGroup`, a rank's stand-in for its tensor-parallel group);
- a host sync: the host reading device values (`_local_scalar_dense` is item/int/bool; tolist,
  numpy, cpu), or an op whose output size depends on device values (nonzero, unique,
  masked_select, indexing by a boolean mask, repeat_interleave without its output size);
- an upload: host data entering torch (`lift_fresh`: torch.tensor, from_numpy, as_tensor), a
  host-to-device copy on a GPU.
Each event is attributed to the innermost frame of cairn's own code (its call site), to the
phase of the step it ran in (`PHASES`), and, inside a decoder layer, to that layer's kind.

Kernels run on CPU tensors only as their launchers' host code (the launch is a record, and the
buffers launchers allocate come zeroed, so what follows sees finite values), so a census step
computes nothing: the states it leaves are garbage. It needs a process where triton
imported compiled (not TRITON_INTERPRET=1), and it routes CUDA's ops (each op folder's triton_ops) to CPU
tensors for its duration (`cairn.kernels.common.dispatch.routed_as`).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]  # the cairn package: frames under it are cairn's
_OWN = str(ROOT)
_ME = str(Path(__file__).resolve())
aten = torch.ops.aten

# Metadata and allocation ops: no kernel runs.
_FREE = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.detach.default,
         aten.alias.default, aten._unsafe_view.default, aten.set_.source_Storage_storage_offset,
         aten.resize_.default, aten.lift_fresh.default, aten._local_scalar_dense.default}
# Ops whose output size is read from the device before they can return.
_SIZED_BY_DATA = {aten.nonzero.default, aten._unique2.default, aten.unique_dim.default,
                  aten.unique_consecutive.default, aten.masked_select.default, aten.argwhere.default,
                  aten.nonzero_static.default}

# (file under the project, function) -> phase, innermost first
PHASES = (("workers/model/hybrid.py", "forward", "forward"),
          ("workers/execution/runner.py", "upload", "upload"),
          ("workers/sampler.py", None, "sample"),
          ("workers/execution/runner.py", "run", "copies"))


@dataclass
class Tally:
    launches: int = 0
    syncs: int = 0
    uploads: int = 0
    ops: int = 0  # aten ops dispatched, free ones included

    def add(self, other: "Tally") -> None:
        self.launches += other.launches
        self.syncs += other.syncs
        self.uploads += other.uploads
        self.ops += other.ops


@dataclass
class Census(TorchDispatchMode):
    phases: dict[str, Tally] = field(default_factory=dict)
    layers: dict[tuple[str, int], Tally] = field(default_factory=dict)  # (kind, layer index)
    sites: Counter = field(default_factory=Counter)  # (site, what) -> count
    kernels: Counter = field(default_factory=Counter)  # Triton kernel name -> launches

    def __post_init__(self) -> None:
        super().__init__()

    # ---- totals ------------------------------------------------------------------------------
    def total(self) -> Tally:
        out = Tally()
        for t in self.phases.values():
            out.add(t)
        return out

    def per_layer_kind(self) -> dict[str, tuple[int, Tally]]:
        """kind -> (number of layers of that kind, their summed tally)."""
        out: dict[str, tuple[int, Tally]] = {}
        for (kind, _), t in self.layers.items():
            n, acc = out.get(kind, (0, Tally()))
            acc.add(t)
            out[kind] = (n + 1, acc)
        return out

    def busiest(self, what: str, n: int = 10) -> list[tuple[str, int]]:
        return [(site, c) for (site, w), c in self.sites.most_common() if w == what][:n]

    # ---- recording ---------------------------------------------------------------------------
    def _record(self, what: str, count: int = 1, op: bool = False) -> None:
        phase, layer, site = "host", None, "?"
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(_OWN) and name != _ME:
                rel = name[len(_OWN) + 1:]
                if site == "?":
                    site = f"{rel}:{frame.f_lineno} {frame.f_code.co_name}"
                if layer is None and rel == "workers/model/hybrid.py" and frame.f_code.co_name == "forward":
                    owner = frame.f_locals.get("self")
                    if owner is not None and hasattr(owner, "is_attention"):
                        layer = ("attention" if owner.is_attention else "deltanet", id(owner))
                if phase == "host":
                    for file, func, label in PHASES:
                        if rel == file and func in (None, frame.f_code.co_name):
                            phase = label
                            break
            frame = frame.f_back
        for tally in [self.phases.setdefault(phase, Tally())] + ([self.layers.setdefault(layer, Tally())]
                                                               if layer else []):
            if op:
                tally.ops += 1
            if what == "launch":
                tally.launches += count
            elif what == "sync":
                tally.syncs += count
            elif what == "upload":
                tally.uploads += count
        if what != "op":
            self.sites[(site, what)] += count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.lift_fresh.default:
            self._record("upload", op=True)
        elif func is aten._local_scalar_dense.default:
            self._record("sync", op=True)
        elif func in _SIZED_BY_DATA or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            self._record("launch", op=True)
            self._record("sync")
        elif func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self._record("launch", op=True)
            self._record("sync")  # a boolean mask is a nonzero first
        elif func in _FREE or func.is_view:
            self._record("op", op=True)
        else:
            self._record("launch", op=True)
        return func(*args, **kwargs)

    # ---- the patches ---------------------------------------------------------------------------
    def __enter__(self):
        import triton

        from cairn.kernels.common import dispatch, triton_helpers
        census = self
        self._saved = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in ("tolist", "numpy", "cpu")]
        self._saved.append((triton.runtime.jit.JITFunction, "run", triton.runtime.jit.JITFunction.run))
        self._saved.append((triton.runtime.autotuner.Autotuner, "run", triton.runtime.autotuner.Autotuner.run))
        self._saved.append((triton_helpers, "empty", triton_helpers.empty))
        self._routing = dispatch.routed_as("cuda")

        def reading(original):
            def read(tensor, *args, **kwargs):
                census._record("sync")
                with torch.utils._python_dispatch._disable_current_modes():
                    return original(tensor, *args, **kwargs)
            return read

        def launch(kernel, *args, grid, warmup=False, **kwargs):
            census.kernels[kernel.fn.__name__] += 1
            census._record("launch")

        for owner, name, original in self._saved[:3]:
            setattr(owner, name, reading(original))
        def zeros(*shape, dtype, device):  # what a launch would have written: finite, and free to make
            with torch.utils._python_dispatch._disable_current_modes():
                return torch.zeros(*shape, dtype=dtype, device=device)

        def tuned_launch(tuner, *args, **kwargs):  # an autotuned kernel: one launch, no tuning
            census.kernels[tuner.fn.fn.__name__] += 1
            census._record("launch")

        triton.runtime.jit.JITFunction.run = launch
        triton.runtime.autotuner.Autotuner.run = tuned_launch
        triton_helpers.empty = zeros
        self._routing.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._routing.__exit__(None, None, None)
            for owner, name, original in self._saved:
                setattr(owner, name, original)


class CensusGroup:
    """A tensor-parallel rank's group for a census of that rank alone: each collective is one
    launch, and returns what a real group would in shape (an all-gather repeats the rank's part)."""

    def __init__(self, world: int, census: Census | None = None):
        self.world = world
        self.census = census

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.census is not None:
            self.census._record("launch")
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.census is not None:
            self.census._record("launch")
        return torch.cat([t] * self.world, dim=dim)
