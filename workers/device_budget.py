"""The arena's size from what a device has left: `memory_utilization`.

Contract: `arena_bytes(free, total, utilization)` is how much of a device cairn's arena may take
once the weights are loaded: `utilization` of the device's total memory, minus what is already
in use (the weights, the CUDA context, anything else on it), i.e. `free - (1 - utilization) *
total`, at least 0. `sized(options, device, group)` returns `options` with `cache_memory_bytes`
set that way when `options.memory_utilization` is given (CUDA only; a `ValueError` otherwise),
else `options` unchanged. Tensor-parallel ranks call it at the same point of their start, after
loading their shards, and take the minimum over the ranks (one all-reduce): every rank lays out
the same arena, as their shared page and slot ids need, and no device is asked for more than it
has. Activations of a step come out of the (1 - utilization) share.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from workers.options import EngineOptions


def arena_bytes(free: int, total: int, utilization: float) -> int:
    return max(0, int(free - (1.0 - utilization) * total))


def sized(options: EngineOptions, device: torch.device, group=None) -> EngineOptions:
    """`options` with the arena sized from `device`'s free memory (see the module doc)."""
    if options.memory_utilization is None:
        return options
    if device.type != "cuda":
        raise ValueError("memory_utilization sizes the arena from a CUDA device's free memory; on the CPU "
                         "give cache_memory_bytes")
    free, total = torch.cuda.mem_get_info(device)
    budget = arena_bytes(free, total, options.memory_utilization)
    if group is not None:  # every rank: the smallest of them
        budget = int(group.all_reduce(torch.tensor([budget], dtype=torch.int64, device=group.device), op="min").item())
    if budget <= 0:
        raise ValueError(f"memory_utilization {options.memory_utilization} leaves no memory for the cache on "
                         f"{device} ({free} of {total} bytes free after loading)")
    return replace(options, cache_memory_bytes=budget, memory_utilization=None)
