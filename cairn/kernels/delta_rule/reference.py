"""The gated delta rule in plain fp32 torch: the oracle every implementation is tested against
(transformers' Qwen3-Next `torch_chunk_gated_delta_rule` and `torch_recurrent_gated_delta_rule`
are the oracles of this one, matched in fp32), and the slow fallback
(`cairn.kernels.common.dispatch`).

The ops' contract, which every implementation keeps:
- Per value head, with state S [D_k, D_v] and per token t:
      S = S * exp(g_t);  S = S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = q_t^T S
  g is a log decay (<= 0). With `use_qk_l2norm`, q and k are first mapped to
  x * rsqrt(sum(x * x) + 1e-6); q is then scaled by `scale` (default D_k ** -0.5). Value head h
  reads key head h // (H_v // H_k) (transformers' repeat_interleave).
- Math in fp32; outputs in v's dtype; states fp32.
- Varlen: rows of B sequences concatenated (`cu_seqlens` [B+1] int32; a sequence may be empty,
  its state then left as it is). A pool [num_slots, H_v, D_k, D_v] fp32 (any strides) is indexed
  by state_slots [B] int64, distinct within a call, read and written in place. `plan`, when
  given, is cu_seqlens' `VarlenPlan` (its host boundaries and positions are used).
- In `gated_delta_rule_step_slots` a slot of -1 is a padding row (a CUDA graph's batch bucket):
  it starts from a zero state and writes none.
- Only `gated_delta_rule_step`, the `_slots` op and the varlen op write into their arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from cairn.kernels.common.checks import check_delta, check_state_pool, expect, expect_dtype, expect_shape
from cairn.kernels.common.varlen_plan import VarlenPlan, checked_plan

_F32 = torch.float32


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
             use_qk_l2norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32 copies of the inputs, q and k normalised, q scaled, key heads repeated to H_v."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    repeat = v.shape[-2] // k.shape[-2]
    return q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2), v, g, beta


def _delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of the recurrence: q, k [..., D_k], v [..., D_v], g, beta [...], state [..., D_k, D_v]."""
    state = state * g.exp()[..., None, None]
    recalled = torch.einsum("...k,...kv->...v", k, state)
    state = state + k[..., :, None] * (beta[..., None] * (v - recalled))[..., None, :]
    return torch.einsum("...k,...kv->...v", q, state), state


def _initial_state(initial_state: Tensor | None, h_v: int, d_k: int, d_v: int, device: torch.device) -> Tensor:
    if initial_state is None:
        return torch.zeros(h_v, d_k, d_v, dtype=_F32, device=device)
    expect_shape("initial_state", initial_state, "H_v, D_k, D_v", (h_v, d_k, d_v))
    return initial_state.float()


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None, *, scale: float | None = None,
                               use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """The gated delta rule over one sequence, token by token (the oracle for the chunked form).

    q, k [T, H_k, D_k]; v [T, H_v, D_v]; g, beta [T, H_v]; initial_state [H_v, D_k, D_v] or None.
    Returns (out [T, H_v, D_v] in v's dtype, final_state [H_v, D_k, D_v] fp32).
    """
    length, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    state = _initial_state(initial_state, h_v, d_k, d_v, v.device)
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    out = torch.empty(length, h_v, d_v, dtype=_F32, device=v.device)
    for t in range(length):
        out[t], state = _delta_step(q[t], k[t], vf[t], g[t], beta[t], state)
    return out.to(v.dtype), state


def _chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, ...]:
    """The state-independent terms of every chunk at once (UT transform).

    q, k [..., C, D_k]; v [..., C, D_v]; g, beta [..., C] (any leading dims: chunks, sequences,
    heads). With G the in-chunk cumulative log decay and A[t, j] = beta_t e^(G_t - G_j) k_t.k_j
    for j < t, a chunk that starts from state S has updates u = W - K S where (I + A) W = beta v
    and (I + A) K = beta e^G k. Then o = (e^G q) S + (q k^T * D) u, and the state after the
    first r tokens is e^(G_r) S + sum_{j<r} e^(G_r - G_j) k_j u_j^T, with D[t, j] = e^(G_t - G_j)
    for j <= t. Returns (W, K, intra = q k^T * D, decayed q, cum G).
    """
    size = g.shape[-1]
    cum = g.cumsum(dim=-1)
    causal = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()
    # I + A: the solve reads only the strict lower triangle (unitriangular, lower), so neither
    # the unit diagonal nor the zeros above it are written
    system = (k @ k.transpose(-1, -2)).mul_(decay).mul_(beta[..., :, None])
    rhs = torch.cat((beta[..., None] * v, (beta * cum.exp())[..., None] * k), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w, kk = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra = (q @ k.transpose(-1, -2)).mul_(decay)
    return w, kk, intra, cum.exp()[..., None] * q, cum


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, *, scale: float | None = None,
                           chunk_size: int = 64, use_qk_l2norm: bool = True,
                           state_positions: Sequence[int] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """The gated delta rule over one sequence, chunk by chunk; also the states at chosen positions.

    q, k [T, H_k, D_k]; v [T, H_v, D_v]; g, beta [T, H_v]; initial_state [H_v, D_k, D_v] or None;
    T >= 1. The in-chunk terms of all chunks are solved in one batch; only the state scan loops.
    state_positions: strictly increasing ints, 0 < p <= T, anywhere (not only on chunk bounds).
    Returns (out [T, H_v, D_v] in v's dtype, final_state [H_v, D_k, D_v] fp32, states
    [len(state_positions), H_v, D_k, D_v] fp32, states[i] being the state after the first
    state_positions[i] tokens).
    """
    length, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    expect(length >= 1, "T >= 1", length)
    expect(chunk_size >= 1, "chunk_size >= 1", chunk_size)
    positions = [int(p) for p in state_positions]
    expect(all(0 < p <= length for p in positions) and all(a < b for a, b in zip(positions, positions[1:])),
            f"state_positions strictly increasing in (0, {length}]", positions)
    state = _initial_state(initial_state, h_v, d_k, d_v, v.device)
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    size = min(chunk_size, length)
    pad = -(-length // size) * size - length  # padded tokens have g = 0 and beta = 0: they change nothing
    q, k, vf, g, beta = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, 0, 0, pad))[None] for t in (q, k, vf, g, beta))
    out, state, saved = delta_chunks(q, k, vf, g, beta, state[None], [positions], size)
    return out[0, :length].to(v.dtype), state[0], saved


def delta_chunks(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                 positions: Sequence[Sequence[int]], size: int) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked rule over B sequences at once, each padded to L = N * size tokens.

    q, k [B, L, H_v, D_k], v [B, L, H_v, D_v], g, beta [B, L, H_v], fp32 and prepared
    (`_prepare`), zeros past each sequence's end (g = beta = 0 there: no effect); state
    [B, H_v, D_k, D_v] fp32, each sequence's initial state (not modified); positions[b]: the
    states wanted, 0 < p <= its length. The in-chunk terms of every chunk of every sequence are
    solved in one batch; only the state scan loops, over the chunks. Returns (out [B, L, H_v, D_v]
    fp32, final states [B, H_v, D_k, D_v], the states at the positions [P, H_v, D_k, D_v],
    sequence by sequence, position by position).
    """
    batch, length, h_v = g.shape
    d_v, num_chunks = v.shape[-1], length // size

    def chunked(t: Tensor) -> Tensor:  # [B, L, H, ...] -> [N, B, H, C, ...], chunk-major and contiguous:
        t = t.reshape(batch, num_chunks, size, *t.shape[2:])  # the scan reads chunk n as one block, and
        return t.permute(1, 0, 3, 2, *range(4, t.dim())).contiguous()  # no product copies its operands

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    w, kk, intra, q_decayed, cum = _chunk_terms(q, k, v, g, beta)
    k_to_end = ((cum[..., -1:] - cum).exp()[..., None] * k).transpose(-1, -2)  # [N, B, H, D_k, C]
    decay_end = cum[..., -1].exp()[..., None, None]  # [N, B, H, 1, 1]
    out = torch.empty(num_chunks, batch, h_v, size, d_v, dtype=_F32, device=v.device)
    wanted: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (sequence, tokens into it, order)
    order = 0
    for b, ps in enumerate(positions):
        for p in ps:
            wanted.setdefault((p - 1) // size, []).append((b, p - ((p - 1) // size) * size, order))
            order += 1
    saved: list[Tensor | None] = [None] * order
    for n in range(num_chunks):
        u = w[n] - kk[n] @ state  # [B, H, C, D_v]
        torch.matmul(q_decayed[n], state, out=out[n])
        out[n].add_(intra[n] @ u)
        for b, r, at in wanted.get(n, []):  # state after the first r tokens of this chunk
            c = cum[n, b, :, :r]
            part = (c[:, -1:] - c).exp()[..., None] * k[n, b, :, :r]
            saved[at] = c[:, -1].exp()[:, None, None] * state[b] + part.transpose(-1, -2) @ u[b, :, :r]
        state = decay_end[n] * state + k_to_end[n] @ u
    out = out.permute(1, 0, 3, 2, 4).reshape(batch, length, h_v, d_v)
    states = torch.stack(saved) if saved else torch.empty(0, h_v, k.shape[-1], d_v, dtype=_F32, device=v.device)
    return out, state, states


def gated_delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
                          scale: float | None = None, use_qk_l2norm: bool = True) -> Tensor:
    """One decode token for each of B sequences.

    q, k [B, H_k, D_k]; v [B, H_v, D_v]; g, beta [B, H_v]; state [B, H_v, D_k, D_v] fp32,
    updated in place. Returns out [B, H_v, D_v] in v's dtype.
    """
    batch, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "B")
    expect_shape("state", state, "B, H_v, D_k, D_v", (batch, h_v, d_k, d_v))
    expect_dtype("state", state, _F32)
    expect(state.is_contiguous(), "a contiguous state (it is updated in place)", "a strided view")
    q, k, vf, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    # The decode hot path on CPU: batched matmuls and in-place updates touch the state a few
    # times instead of materialising an outer product per step.
    flat = state.view(batch * h_v, d_k, d_v)
    flat.mul_(g.exp().reshape(-1, 1, 1))
    k_rows = k.reshape(batch * h_v, 1, d_k)
    recalled = torch.bmm(k_rows, flat)  # [B*H_v, 1, D_v]
    delta = (vf.reshape(batch * h_v, 1, d_v) - recalled) * beta.reshape(-1, 1, 1)
    flat.baddbmm_(k_rows.transpose(1, 2), delta)
    out = torch.bmm(q.reshape(batch * h_v, 1, d_k), flat)
    return out.view(batch, h_v, d_v).to(v.dtype)


def chunk_gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                  state_pool: Tensor, state_slots: Tensor, *, scale: float | None = None,
                                  use_qk_l2norm: bool = True, state_positions: Sequence[Sequence[int]] = (),
                                  plan: VarlenPlan | None = None) -> tuple[Tensor, Tensor]:
    """The chunked delta rule over B sequences, each starting from and ending in its state slot.

    q, k [T, H_k, D_k]; v [T, H_v, D_v]; g, beta [T, H_v]; cu_seqlens [B+1] int32; state_pool
    [num_slots, H_v, D_k, D_v] fp32, state_pool[state_slots[b]] read as sequence b's initial state
    and overwritten with its final state. state_positions: per sequence (a shorter list means no
    positions for the rest), strictly increasing 0 < p <= len_b. Returns (out [T, H_v, D_v] in v's
    dtype, states [P, H_v, D_k, D_v] fp32: the state after state_positions[b][i] tokens of
    sequence b, sequence by sequence, position by position).
    """
    total, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "T")
    plan = checked_plan(cu_seqlens, total, plan, state_positions)
    cu, positions = plan.cu, plan.positions
    batch = len(cu) - 1
    check_state_pool(state_pool, state_slots, batch, h_v, d_k, d_v)
    expect(len(positions) <= batch, f"at most B = {batch} lists of state_positions", len(positions))
    out, saved = torch.empty_like(v), []
    for b, slot in enumerate(state_slots.tolist()):
        wanted = list(positions[b]) if b < len(positions) else []
        if cu[b] == cu[b + 1]:
            expect(not wanted, f"no state_positions for the empty sequence {b}", wanted)
            continue
        rows = slice(cu[b], cu[b + 1])
        out[rows], state_pool[slot], states = chunk_gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], state_pool[slot], scale=scale,
            use_qk_l2norm=use_qk_l2norm, state_positions=wanted)
        saved.append(states)
    return out, torch.cat(saved) if saved else torch.empty(0, h_v, d_k, d_v, dtype=_F32, device=v.device)


def gated_delta_rule_step_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                                state_slots: Tensor, *, scale: float | None = None,
                                use_qk_l2norm: bool = True) -> Tensor:
    """`gated_delta_rule_step` on states kept in a pool: state_pool [num_slots, H_v, D_k, D_v] fp32,
    rows state_slots [B] int64 updated in place. Returns out [B, H_v, D_v] in v's dtype."""
    batch, h_v, d_k, d_v = check_delta(q, k, v, g, beta, "B")
    check_state_pool(state_pool, state_slots, batch, h_v, d_k, d_v)
    out = torch.empty_like(v)
    for b, slot in enumerate(state_slots.tolist()):
        state = (state_pool[slot] if slot >= 0 else torch.zeros_like(state_pool[0])).clone()[None]
        out[b:b + 1] = gated_delta_rule_step(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], state,
                                             scale=scale, use_qk_l2norm=use_qk_l2norm)
        if slot >= 0:
            state_pool[slot] = state[0]
    return out
