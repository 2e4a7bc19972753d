"""The arena's size from what a device has left: `memory_utilization`.

Contract: `arena_bytes(free, total, utilization)` is how much of a device cairn's arena may take
once the weights are loaded: `utilization` of the device's total memory, minus what is already
in use (the weights, the CUDA context, anything else on it), i.e. `free - (1 - utilization) *
total`, at least 0. `sized(asked, device, group)` returns a new `EngineOptions`, `asked` with
`cache_memory_bytes` set that way and no `memory_utilization`, when `asked.memory_utilization`
is given (CUDA only; a `ValueError` otherwise), else `asked` itself; `asked` is never changed
(frozen), so callers keep both: what was asked, what the arena is laid out from. Tensor-parallel
ranks call it with the same `asked` at the same point of their start, after loading their
shards, and take the minimum over the ranks (one all-reduce): every rank lays out the same
arena, as their shared page and slot ids need, and no device is asked for more than it has.
Activations of a step come out of the (1 - utilization) share; so does what decode graphs hold
(cairn.workers.execution.decode_graphs), except that its estimate, `graph_reserve_bytes`, is
taken from the arena's share first (`reserve`): captured after the arena, they must not find the
device full.
A speculating engine (`num_speculative_tokens`) sizes with `sized_for_speculation`: the verify
steps' spare state slots (and one group's alignment) are reserved first, and the MTP head's K/V,
one more attention layer's pages, takes its share of what is left; every rank the same way.
The engine logs the estimate beside what capture measured. Library workspaces made at the first
matmul (cuBLAS's, per stream) are made before the sizing (`make_workspaces`, called by
cairn.workers.loading), so they are in what the weights left, not on top of the arena.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from cairn.workers.engine_options import EngineOptions


def arena_bytes(free: int, total: int, utilization: float) -> int:
    return max(0, int(free - (1.0 - utilization) * total))


def make_workspaces(device: torch.device, dtype: torch.dtype) -> None:
    """Makes the device's library workspaces now, so the arena is sized from what is free after
    them: cuBLAS's handle and workspace for the current stream (a matmul in the model's dtype).
    Nothing on other devices."""
    if device.type != "cuda":
        return
    a = torch.ones(64, 64, dtype=dtype, device=device)
    torch.nn.functional.linear(a, a)
    torch.cuda.synchronize(device)


def graph_reserve_bytes(cfg, max_num_seqs: int) -> int:
    """What decode graphs' memory pool may hold: the peak of one decode forward at the largest
    batch (logits and the LM head's output, a few rows of activations per layer, the MoE's pair
    buffers, split attention's partials), twice, and 32 MiB."""
    b, k = max_num_seqs, cfg.num_experts_per_tok + 1
    per_row = (6 * cfg.vocab_size + 64 * cfg.hidden_size + 4 * k * max(cfg.moe_intermediate_size, 1)
               + 4 * cfg.num_attention_heads * cfg.head_dim * 64 // max(b, 1))
    return 2 * b * per_row + (32 << 20)


def sized(asked: EngineOptions, device: torch.device, group=None, reserve: int = 0) -> EngineOptions:
    """New options: `asked` with the arena sized from `device`'s free memory, less `reserve` bytes
    (see the module doc)."""
    if asked.memory_utilization is None:
        return asked
    if device.type != "cuda":
        raise ValueError("memory_utilization sizes the arena from a CUDA device's free memory; on the CPU "
                         "give cache_memory_bytes")
    free, total = torch.cuda.mem_get_info(device)
    budget = arena_bytes(free, total, asked.memory_utilization) - reserve
    if group is not None:  # every rank: the smallest of them
        budget = int(group.all_reduce(torch.tensor([budget], dtype=torch.int64, device=group.device), op="min").item())
    if budget <= 0:
        raise ValueError(f"memory_utilization {asked.memory_utilization} leaves no memory for the cache on "
                         f"{device} ({free} of {total} bytes free after loading)")
    return replace(asked, cache_memory_bytes=budget, memory_utilization=None)


def sized_for_speculation(asked: EngineOptions, cfg, itemsize: int, device: torch.device, group=None,
                          reserve: int = 0) -> EngineOptions:
    """`sized` for an engine that keeps the MTP head's K/V beside the arena and
    `ArenaLayout.spare_slots` after it (see the module doc)."""
    if asked.memory_utilization is None:
        return asked
    from cairn.workers.cache.arena import ArenaLayout

    probe = ArenaLayout.plan(cfg, replace(asked, memory_utilization=None, num_pages=1), itemsize)
    sized_ = sized(asked, device, group, reserve + probe.spare_bytes + probe.slot_blocks * probe.block_bytes)
    layers = len(cfg.attention_layers)  # the head's K/V: one more attention layer's pages
    return replace(sized_, cache_memory_bytes=sized_.cache_memory_bytes * layers // (layers + 1))
