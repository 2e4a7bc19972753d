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


SHORT = 8  # a prefill segment of at most this many new tokens runs as decode rows (`paged_attention_prefill`)


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float,
                            plan: VarlenPlan | None = None) -> Tensor:
    """Segments of at most `SHORT` new tokens (a verify step's, a prompt's last few) run through
    the decode kernel, one row a token, each row seeing the keys up to its own position: one
    call for all of them instead of a flash call or two each. The rest: the C++ kernel in bf16
    with a head dim of 64 on a CPU with AMX; anything else torch's flash kernel
    (attention/torch_ops.py)."""
    batch, _, cu, lens = check_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, plan)
    short = [b for b in range(batch) if 0 < cu[b + 1] - cu[b] <= SHORT]
    if not short:
        return _long(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, plan, cu)
    out = torch.empty_like(query)
    rows, tables, row_lens = [], [], []
    for b in short:
        n = cu[b + 1] - cu[b]
        rows += range(cu[b], cu[b + 1])
        tables += [b] * n
        row_lens += range(lens[b] - n + 1, lens[b] + 1)
    rows_t = torch.tensor(rows, dtype=torch.long)
    out[rows_t] = _ops.attention_decode(query[rows_t], k_cache, v_cache,
                                        page_table[torch.tensor(tables, dtype=torch.long)],
                                        torch.tensor(row_lens, dtype=torch.int32), scale)
    long = [b for b in range(batch) if cu[b + 1] - cu[b] > SHORT]
    if long:
        index = torch.tensor(long, dtype=torch.long)
        sub_rows = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in long])
        sub_cu = [0]
        for b in long:
            sub_cu.append(sub_cu[-1] + cu[b + 1] - cu[b])
        out[sub_rows] = _long(query[sub_rows], k_cache, v_cache, page_table[index],
                              torch.tensor(sub_cu, dtype=torch.int32), seq_lens[index], scale, None, sub_cu)
    return out


def _long(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor, cu_seqlens_q: Tensor,
          seq_lens: Tensor, scale: float, plan: VarlenPlan | None, cu: list[int]) -> Tensor:
    """Prefill by the C++ kernel (AMX, bf16, head dim 64) or torch's flash kernel."""
    if not _amx:
        _amx.append(bool(_ops.amx_available()))
    if not (_amx[0] and query.dtype == k_cache.dtype == torch.bfloat16 and query.shape[-1] == 64
            and query.stride(-1) == 1 and k_cache.stride(-1) == 1):
        return torch_ops.paged_attention_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale,
                                                 plan)
    return _ops.attention_prefill(query, k_cache, v_cache, page_table, cu, seq_lens, scale)


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    batch, _ = check_paged(query, k_cache, v_cache, page_table, seq_lens)
    expect_shape("query", query, "B, H_q, D", (batch, None, None))
    check_decode_lens(seq_lens, page_table.shape[1] * k_cache.shape[1])
    return _ops.attention_decode(query, k_cache, v_cache, page_table, seq_lens, scale)
