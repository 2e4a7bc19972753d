"""Paged attention: `store_kv`, `paged_attention_prefill`, `paged_attention_decode`. The op's one
entry point: each call runs the implementation `OPS` picks for its tensors' device
(`cairn.kernels.common.dispatch`). Contracts: attention/reference.py.

| device | store_kv | prefill | decode |
|---|---|---|---|
| CUDA | triton_ops | triton_ops | triton_ops |
| CPU (C++ library) | torch_ops | cpu_ops (AMX bf16, D 64), else torch_ops | cpu_ops |
| CPU (no library) | torch_ops | torch_ops | reference (the slow fallback) |
"""

from __future__ import annotations

from torch import Tensor

from cairn.kernels.common.dispatch import Ops
from cairn.kernels.common.varlen_plan import VarlenPlan

__all__ = ["store_kv", "paged_attention_prefill", "paged_attention_decode"]

OPS = Ops(cuda=("cairn.kernels.attention.triton_ops",),
          cpu=("cairn.kernels.attention.cpu_ops", "cairn.kernels.attention.torch_ops"),
          fallback="cairn.kernels.attention.reference")


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    OPS.pick("store_kv", key)(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float,
                            plan: VarlenPlan | None = None) -> Tensor:
    return OPS.pick("paged_attention_prefill", query)(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens,
                                                      scale, plan)


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    return OPS.pick("paged_attention_decode", query)(query, k_cache, v_cache, page_table, seq_lens, scale)
