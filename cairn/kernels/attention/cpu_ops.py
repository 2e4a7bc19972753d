"""Paged attention's C++ CPU kernels (attention_decode.cpp, attention_prefill.cpp), launched over
`torch.ops.cairn_cpu`: decode always; prefill in bf16 at a head dim of 64 on a CPU with AMX, the
rest of prefill by attention/torch_ops.py. Contracts: attention/reference.py's."""

from __future__ import annotations

import torch
from torch import Tensor

from cairn.kernels.attention import torch_ops
from cairn.kernels.common.checks import check_decode_lens, check_paged, check_prefill, expect_shape
from cairn.kernels.common.varlen_plan import VarlenPlan

NATIVE = True  # runs only where the C++ library is loaded
_ops = torch.ops.cairn_cpu
_amx: list[bool] = []  # whether the tile unit runs here (asked once)


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float,
                            plan: VarlenPlan | None = None) -> Tensor:
    """The C++ kernel takes bf16 with a head dim of 64 on a CPU with AMX; anything else runs torch's
    flash kernel (attention/torch_ops.py)."""
    if not _amx:
        _amx.append(bool(_ops.amx_available()))
    if not (_amx[0] and query.dtype == k_cache.dtype == torch.bfloat16 and query.shape[-1] == 64
            and query.stride(-1) == 1 and k_cache.stride(-1) == 1):
        return torch_ops.paged_attention_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale,
                                                 plan)
    _, _, cu, _ = check_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, plan)
    return _ops.attention_prefill(query, k_cache, v_cache, page_table, cu, seq_lens, scale)


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    batch, _ = check_paged(query, k_cache, v_cache, page_table, seq_lens)
    expect_shape("query", query, "B, H_q, D", (batch, None, None))
    check_decode_lens(seq_lens, page_table.shape[1] * k_cache.shape[1])
    return _ops.attention_decode(query, k_cache, v_cache, page_table, seq_lens, scale)
