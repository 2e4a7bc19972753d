"""The CPU kernels' launchers: the ops of `cairn.kernels.reference` / `reference_varlen` that have a C++
kernel (cairn/kernels/csrc), with the same signatures, checks and results (to rounding: the delta rule
runs token by token here, chunk by chunk there).

Which ops: the Gated DeltaNet's conv and delta rule, varlen (prefill) and per slot (decode),
attention over paged K/V (decode; prefill in bf16 at a head dim of 64 with AMX), the row-wise ops
of `reference_fused`, and greedy sampling's argmax: the ops whose torch form is a chain of small tensors' ops, where a
fused loop keeps its data in cache. Each is a launcher over `torch.ops.cairn_cpu.<op>`, built by
`cairn.kernels.cpu_build`; `kernels` sends CPU tensors here only once that library is loaded.
The kernels' own notes (what runs on a thread, the math) open their C++ sources.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cairn.kernels import reference
from cairn.kernels.reference import _check_delta, _check_paged, _expect, _expect_dtype, _expect_shape
from cairn.kernels.reference_varlen import _check_slots, _plan
from cairn.kernels.varlen_plan import VarlenPlan

_ops = torch.ops.cairn_cpu


def chunk_gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                  state_pool: Tensor, state_slots: Tensor, *, scale: float | None = None,
                                  use_qk_l2norm: bool = True, state_positions: Sequence[Sequence[int]] = (),
                                  plan: VarlenPlan | None = None) -> tuple[Tensor, Tensor]:
    """See `reference_varlen.chunk_gated_delta_rule_varlen`."""
    total, h_v, d_k, d_v = _check_delta(q, k, v, g, beta, "T")
    plan = _plan(cu_seqlens, total, plan, state_positions)
    batch = plan.batch
    _check_slots("state_pool", state_pool, "num_slots, H_v, D_k, D_v", (h_v, d_k, d_v), state_slots, batch)
    _expect_dtype("state_pool", state_pool, torch.float32)
    positions = [list(plan.positions[b]) if b < len(plan.positions) else [] for b in range(batch)]
    offsets = [0]
    for b, ps in enumerate(positions):
        _expect(not ps or plan.cu[b] < plan.cu[b + 1], f"no state_positions for the empty sequence {b}", ps)
        offsets.append(offsets[-1] + len(ps))
    return _ops.delta_rule_varlen(q, k, v, g, beta, plan.cu, state_pool, state_slots,
                                  [p for ps in positions for p in ps], offsets, scale or 0.0, use_qk_l2norm)


def gated_delta_rule_step_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                                state_slots: Tensor, *, scale: float | None = None,
                                use_qk_l2norm: bool = True) -> Tensor:
    """See `reference_varlen.gated_delta_rule_step_slots`."""
    batch, h_v, d_k, d_v = _check_delta(q, k, v, g, beta, "B")
    _check_slots("state_pool", state_pool, "num_slots, H_v, D_k, D_v", (h_v, d_k, d_v), state_slots, batch)
    _expect_dtype("state_pool", state_pool, torch.float32)
    return _ops.delta_rule_step(q, k, v, g, beta, state_pool, state_slots, scale or 0.0, use_qk_l2norm)


def _check_conv(x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor, batch: int | None) -> None:
    _expect_shape("weight", weight, "C, K", (None, None))
    channels, width = weight.shape
    _expect_shape("x", x, "T, C", (None, channels))
    _check_slots("conv_pool", conv_pool, "num_slots, C, K-1", (channels, width - 1), state_slots,
                 x.shape[0] if batch is None else batch)


def causal_conv1d_varlen(x: Tensor, weight: Tensor, cu_seqlens: Tensor, conv_pool: Tensor,
                         state_slots: Tensor, plan: VarlenPlan | None = None) -> Tensor:
    """See `reference_varlen.causal_conv1d_varlen`."""
    _expect_shape("weight", weight, "C, K", (None, None))
    cu = _plan(cu_seqlens, x.shape[0], plan).cu
    _check_conv(x, weight, conv_pool, state_slots, len(cu) - 1)
    return _ops.conv_varlen(x, weight, cu, conv_pool, state_slots)


def causal_conv1d_update_slots(x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor) -> Tensor:
    """See `reference_varlen.causal_conv1d_update_slots`."""
    _check_conv(x, weight, conv_pool, state_slots, None)
    return _ops.conv_update(x, weight, conv_pool, state_slots)


_amx: list[bool] = []  # whether the tile unit runs here (asked once)


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float,
                            plan: VarlenPlan | None = None) -> Tensor:
    """See `reference.paged_attention_prefill`. The C++ kernel takes bf16 with a head dim of 64 on
    a CPU with AMX (cairn/kernels/csrc/attention_prefill.cpp); anything else runs the reference (torch's
    flash kernel)."""
    if not _amx:
        _amx.append(bool(_ops.amx_available()))
    if not (_amx[0] and query.dtype == k_cache.dtype == torch.bfloat16 and query.shape[-1] == 64
            and query.stride(-1) == 1 and k_cache.stride(-1) == 1):
        return reference.paged_attention_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale,
                                                 plan)
    batch, _ = _check_paged(query, k_cache, v_cache, page_table, seq_lens)
    _expect_shape("cu_seqlens_q", cu_seqlens_q, "B+1", (batch + 1,))
    cu = plan.cu if plan is not None else cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    _expect(cu[0] == 0 and cu[-1] == query.shape[0], f"cu_seqlens_q from 0 to T = {query.shape[0]}", cu)
    for b in range(batch):
        _expect(0 <= cu[b + 1] - cu[b] <= lens[b] <= page_table.shape[1] * k_cache.shape[1],
                f"0 <= q_len <= seq_len <= max_pages * page_size for sequence {b}", (cu[b + 1] - cu[b], lens[b]))
    return _ops.attention_prefill(query, k_cache, v_cache, page_table, cu, seq_lens, scale)


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    """See `reference.paged_attention_decode`."""
    batch, _ = _check_paged(query, k_cache, v_cache, page_table, seq_lens)
    _expect_shape("query", query, "B, H_q, D", (batch, None, None))
    if batch:
        shortest, longest = int(seq_lens.min()), int(seq_lens.max())
        _expect(1 <= shortest and longest <= page_table.shape[1] * k_cache.shape[1],
                "1 <= seq_lens <= max_pages * page_size", (shortest, longest))
    return _ops.attention_decode(query, k_cache, v_cache, page_table, seq_lens, scale)


# ---------------------------------------------------------------- the row-wise ops (reference_fused)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """See `reference_fused.rms_norm`."""
    _expect_shape("weight", weight, "D", (x.shape[-1],))
    y, total = _ops.rms_norm(x, weight, eps, residual)
    return y if residual is None else (y, total)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """See `reference_fused.gated_rms_norm`: the weighted row is rounded to the dtype the
    reference's product has (x's, unless one of them is fp32)."""
    _expect_shape("x", x, "N, D", (None, weight.shape[0]))
    _expect_shape("gate", gate, "N, D", tuple(x.shape))
    return _ops.gated_rms_norm(x, gate, weight, eps, torch.promote_types(weight.dtype, x.dtype) == x.dtype)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor, inv_freq: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """See `reference_fused.qk_norm_rope`."""
    _expect_shape("q", q, "T, H_q, D", (None, None, None))
    _expect_shape("k", k, "T, H_kv, D", (q.shape[0], None, q.shape[2]))
    _expect_shape("positions", positions, "T", (q.shape[0],))
    return _ops.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps)


def delta_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """See `reference_fused.delta_gates`."""
    _expect_shape("a", a, "T, H_v", (None, A_log.shape[0]))
    _expect_shape("b", b, "T, H_v", tuple(a.shape))
    return _ops.delta_gates(a, b, A_log, dt_bias)


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    """See `reference_fused.sigmoid_gate`."""
    _expect_shape("gate", gate, "T, N", tuple(x.shape))
    return _ops.sigmoid_mul(x, gate)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """See `reference_fused.silu_mul`."""
    _expect_shape("up", up, "T, N", tuple(gate.shape))
    return _ops.silu_mul(gate, up)


def argmax_rows(logits: Tensor) -> Tensor:
    """See `reference.argmax_rows`."""
    _expect_shape("logits", logits, "N, V", (None, None))
    return _ops.argmax_rows(logits)


def mask_rows(x: Tensor, at: Tensor, words: Tensor) -> None:
    """See `reference_sample.mask_rows`."""
    _expect_shape("x", x, "N, V", (None, None))
    _ops.mask_rows(x, at, words)


def penalise_rows(x: Tensor, at: Tensor, rows: Tensor, counts: Tensor, prompt: Tensor, values: Tensor) -> None:
    """See `reference_sample.penalise_rows`."""
    _expect_shape("x", x, "N, V", (None, None))
    _ops.penalise_rows(x, at, rows, counts, prompt, values)


def sample_rows(x: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, u: Tensor) -> Tensor:
    """See `reference_sample.sample_rows`; ties at a top-k boundary go to the lowest indices, and
    sums run in another order (the kept set may differ from the reference's by a token whose
    weight sits at the boundary within rounding)."""
    _expect_shape("x", x, "N, V", (None, None))
    return _ops.sample_rows(x.float().contiguous(), temperature.contiguous(), top_k.contiguous(),
                            top_p.contiguous(), min_p.contiguous(), u.contiguous())
