"""Triton fused mixture of experts: `fused_moe` as moe/reference.py defines it, in seven
launches, with no host sync and no shape that depends on the routing (a CUDA graph can hold it).

The launches, for T tokens, E experts, top k (N = T * k (token, expert) pairs, pair p = token
p // k, its (p % k)-th choice):
1. `_route_kernel`, grid (T,): softmax of the token's logits in fp32, top k by iterated argmax
   (exact ties: the lower expert id), renormalised; writes the pair weights [N] fp32 and expert
   ids [N] int32, and zeroes the token's fp32 output row.
2-4. `align` (reference.align's layout: `sorted_pairs`, `block_expert`, `num_padded`), in three
   launches over many programs: `_align_count_kernel`, grid (C,), counts each chunk's pairs per
   expert (C chunks of a power of two pairs, about ALIGN_CHUNKS of them); `_align_offsets_kernel`,
   grid (1,), prefix-sums those counts over the chunks (C x E small integers) and the padded runs
   over the experts; `_align_scatter_kernel`, grid (C + MAX_BLOCKS / ALIGN_FILL_BLOCKS,), writes
   each pair at its expert's start + its chunk's offset + its rank in the chunk (stable), while
   the other programs write each block's expert and the padding (N). MAX_PADDED = N + E (BLOCK_M
   - 1) rounded up to a block: the most any routing can pad to, so every size is fixed by (T, E, k).
5. `_gate_up_kernel`, grid (MAX_BLOCKS, cdiv(I, BLOCK_N)): a block of one expert's pairs times
   its gate and up rows, SiLU(gate) * up, into `inter` [N, I] by pair. Blocks past `num_padded`
   return at once: the grid is the worst case, the work is the routing's.
6. `_down_kernel`, grid (MAX_BLOCKS, cdiv(H, BLOCK_N)): `inter` rows times down[e], scaled by the
   pair's weight, atomically added into the token's fp32 row (a token's k pairs go to k distinct
   experts, so no two rows of one program share a token).
7. the fp32 output cast to x's dtype (none for fp32).

Loads are upcast to fp32 (which the interpreter needs for bf16), then matmul operands go back to
the stored 16-bit dtype (tensor cores) or stay exact fp32 (no TF32); accumulation is fp32. BLOCK_M
is fixed by the pair count (16 at decode sizes, 64 for prefills); the GEMMs' BLOCK_N, BLOCK_K and
warps are autotuned per (H, I, BLOCK_M) (moe/tuning.py's `GEMM_CONFIGS`, triton_helpers.tuned; the
first one interpreted).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.common import triton_helpers as tc
from cairn.kernels.common.checks import check_moe, check_shared_expert
from cairn.kernels.moe.expert import SharedExpert, shared_expert
from cairn.kernels.moe.reference import align_size
from cairn.kernels.moe.tuning import ALIGN_CHUNKS, ALIGN_FILL_BLOCKS, ALIGN_TILE, GEMM_CONFIGS


@triton.jit
def _route_kernel(logits, s_lt, weights, ids, out, x, s_xt, shared_gate, N, H, E, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    row = tl.load(logits + t * s_lt + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(row - tl.max(row, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < E, p, -1.0)
    j = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        pick = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        top_w = tl.where(j == k, best, top_w)
        top_i = tl.where(j == k, pick, top_i)
        p = tl.where(e == pick, -2.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)
    tl.store(weights + t * TOP_K + j, top_w, mask=j < TOP_K)
    tl.store(ids + t * TOP_K + j, top_i, mask=j < TOP_K)
    dot = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        tl.store(out + t * H + h, tl.zeros([BLOCK_H], dtype=tl.float32), mask=h < H)
        if HAS_SHARED:
            xv = tl.load(x + t * s_xt + h, mask=h < H, other=0.0).to(tl.float32)
            dot += xv * tl.load(shared_gate + h, mask=h < H, other=0.0).to(tl.float32)
    if HAS_SHARED:  # the shared expert's weight, at pair N + t
        tl.store(weights + N + t, 1.0 / (1.0 + tl.exp(-tl.sum(dot, axis=0))))


@triton.jit
def _align_count_kernel(ids, N, counts, CHUNK: tl.constexpr, PASS: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[c, e]: how many of chunk c's pairs chose expert e."""
    chunk = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    c = tl.arange(0, PASS)
    mine = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s in range(0, CHUNK, PASS):
        at = chunk * CHUNK + s + c
        chose = tl.load(ids + at, mask=at < N, other=-1)
        mine += tl.sum((chose[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(counts + chunk * BLOCK_E + e, mine)


@triton.jit
def _align_offsets_kernel(counts, CHUNKS, E, expert_start, expert_count, num_padded, BLOCK_M: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: turns counts[c, e] in place into where chunk c's first pair of expert e goes
    within that expert's run (a prefix sum over the chunks), then lays the experts' padded runs out
    in expert order (a prefix sum over the experts)."""
    e = tl.arange(0, BLOCK_E)
    r = tl.arange(0, ROWS)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, CHUNKS, ROWS):
        rows = c0 + r
        where = counts + rows[:, None] * BLOCK_E + e[None, :]
        tile = tl.load(where, mask=rows[:, None] < CHUNKS, other=0)
        tl.store(where, tl.cumsum(tile, axis=0) - tile + total[None, :], mask=rows[:, None] < CHUNKS)
        total += tl.sum(tile, axis=0)
    total = tl.where(e < E, total, 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    tl.store(expert_start + e, tl.cumsum(padded, axis=0) - padded)
    tl.store(expert_count + e, total)
    tl.store(num_padded, tl.sum(padded, axis=0))


@triton.jit
def _align_scatter_kernel(ids, N, E, offsets, expert_start, expert_count, sorted_pairs, block_expert, CHUNKS,
                          MAX_BLOCKS, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PASS: tl.constexpr,
                          BLOCK_E: tl.constexpr, FILL_BLOCKS: tl.constexpr):
    """Programs below CHUNKS: their chunk's pairs into `sorted_pairs`, each at its expert's start
    + the chunk's offset + its rank among the chunk's earlier pairs of that expert. The others:
    FILL_BLOCKS blocks each, their `block_expert` and their padding slots (N). The two sets of
    slots are disjoint, so no program waits on another."""
    program = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    if program < CHUNKS:
        c = tl.arange(0, PASS)
        cursor = tl.load(offsets + program * BLOCK_E + e) + tl.load(expert_start + e)
        for s in range(0, CHUNK, PASS):
            at = program * CHUNK + s + c
            chose = tl.load(ids + at, mask=at < N, other=-1)
            onehot = (chose[:, None] == e[None, :]).to(tl.int32)
            before = ((chose[:, None] == chose[None, :]) & (c[None, :] < c[:, None])).to(tl.int32)
            slot = tl.sum(onehot * cursor[None, :], axis=1) + tl.sum(before, axis=1)
            tl.store(sorted_pairs + slot, at, mask=at < N)
            cursor += tl.sum(onehot, axis=0)
    else:
        b = (program - CHUNKS) * FILL_BLOCKS + tl.arange(0, FILL_BLOCKS)
        first = b * BLOCK_M
        start = tl.load(expert_start + e)
        count = tl.load(expert_count + e)
        end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        owner = tl.sum(((end[None, :] <= first[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
        tl.store(block_expert + b, owner, mask=b < MAX_BLOCKS)
        own = owner < E
        run_start = tl.load(expert_start + owner, mask=own, other=0)
        run_count = tl.load(expert_count + owner, mask=own, other=0)
        slot = first[:, None] + tl.arange(0, BLOCK_M)[None, :]
        padding = (slot - run_start[:, None] >= run_count[:, None]) & (b < MAX_BLOCKS)[:, None]
        tl.store(sorted_pairs + slot, tl.zeros([FILL_BLOCKS, BLOCK_M], dtype=tl.int32) + N, mask=padding)


@triton.jit
def _expert_block(sorted_pairs, block_expert, num_padded, N, T, MAX_BLOCKS, TOP_K: tl.constexpr,
                  BLOCK_M: tl.constexpr):
    """This program's block: (whether it has work, expert, pair ids [BLOCK_M], which are pairs and
    not padding, their tokens). Blocks past MAX_BLOCKS are the shared expert's (expert E): tokens
    in order, pair N + t."""
    b = tl.program_id(0)
    r = tl.arange(0, BLOCK_M)
    if b < MAX_BLOCKS:
        pairs = tl.load(sorted_pairs + b * BLOCK_M + r)
        valid = pairs < N
        tokens = pairs // TOP_K
        expert = tl.load(block_expert + b)
        busy = b * BLOCK_M < tl.load(num_padded)
    else:
        tokens = (b - MAX_BLOCKS) * BLOCK_M + r
        valid = tokens < T
        pairs = N + tokens
        expert = tl.full([], -1, tl.int32)
        busy = b >= MAX_BLOCKS
    return busy, expert.to(tl.int64), pairs.to(tl.int64), valid, tokens.to(tl.int64)


@tc.tuned(GEMM_CONFIGS, key=["H", "I", "BLOCK_M"])
@triton.jit
def _gate_up_kernel(x, s_xt, w, s_we, s_wn, sg, su, s_sn, inter, sorted_pairs, block_expert, num_padded, N, T,
                    MAX_BLOCKS, H, I, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    busy, expert, pairs, valid, tokens = _expert_block(sorted_pairs, block_expert, num_padded, N, T, MAX_BLOCKS,
                                                       TOP_K, BLOCK_M)
    if not busy:
        return
    if expert >= 0:
        gate_rows, up_rows, s_n = w + expert * s_we, w + expert * s_we + I * s_wn, s_wn
    else:
        gate_rows, up_rows, s_n = sg, su, s_sn
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        a = tl.load(x + tokens[:, None] * s_xt + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w_ok = k_ok[:, None] & n_ok[None, :]
        g = tl.load(gate_rows + k[:, None] + n[None, :] * s_n, mask=w_ok, other=0.0).to(tl.float32)
        u = tl.load(up_rows + k[:, None] + n[None, :] * s_n, mask=w_ok, other=0.0).to(tl.float32)
        acc_gate += tl.dot(a.to(DOT), g.to(DOT), input_precision=PREC)
        acc_up += tl.dot(a.to(DOT), u.to(DOT), input_precision=PREC)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    dst = inter + pairs[:, None] * I + n[None, :]
    tl.store(dst, h.to(inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@tc.tuned(GEMM_CONFIGS, key=["H", "I", "BLOCK_M"], reset_to_zero=("out",))
@triton.jit
def _down_kernel(inter, w, s_we, s_wn, sd, s_sd, weights, out, sorted_pairs, block_expert, num_padded, N, T,
                 MAX_BLOCKS, H, I, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    busy, expert, pairs, valid, tokens = _expert_block(sorted_pairs, block_expert, num_padded, N, T, MAX_BLOCKS,
                                                       TOP_K, BLOCK_M)
    if not busy:
        return
    if expert >= 0:
        rows, s_n = w + expert * s_we, s_wn
    else:
        rows, s_n = sd, s_sd
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(inter + pairs[:, None] * I + k[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        d = tl.load(rows + n[None, :] * s_n + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(a.to(DOT), d.to(DOT), input_precision=PREC)
    scale = tl.load(weights + pairs, mask=valid, other=0.0)
    tl.atomic_add(out + tokens[:, None] * H + n[None, :], acc * scale[:, None], mask=valid[:, None] & n_ok[None, :])


def align(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """See `reference.align`: three launches over many programs, no host sync, every grid fixed by
    (N, num_experts, block_m)."""
    n, dev = ids.shape[0], ids.device
    block_e = tc.pow2(num_experts)
    step = max(1, ALIGN_TILE // block_e)  # pairs a pass: the [pairs, experts] one-hot tile stays ALIGN_TILE
    chunk = max(step, tc.pow2(triton.cdiv(n, ALIGN_CHUNKS), least=1))
    chunks = max(1, triton.cdiv(n, chunk))
    max_padded = align_size(n, num_experts, block_m)
    max_blocks = max_padded // block_m
    offsets = tc.empty(chunks, block_e, dtype=torch.int32, device=dev)
    expert_start = tc.empty(block_e, dtype=torch.int32, device=dev)
    expert_count = tc.empty(block_e, dtype=torch.int32, device=dev)
    sorted_pairs = tc.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = tc.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = tc.empty(1, dtype=torch.int32, device=dev)
    _align_count_kernel[(chunks,)](ids, n, offsets, CHUNK=chunk, PASS=step, BLOCK_E=block_e)
    _align_offsets_kernel[(1,)](offsets, chunks, num_experts, expert_start, expert_count, num_padded,
                                BLOCK_M=block_m, ROWS=step, BLOCK_E=block_e, num_warps=8)
    _align_scatter_kernel[(chunks + triton.cdiv(max_blocks, ALIGN_FILL_BLOCKS),)](
        ids, n, num_experts, offsets, expert_start, expert_count, sorted_pairs, block_expert, chunks, max_blocks,
        BLOCK_M=block_m, CHUNK=chunk, PASS=step, BLOCK_E=block_e, FILL_BLOCKS=ALIGN_FILL_BLOCKS)
    return sorted_pairs, block_expert, num_padded


def fused_moe(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
              renormalize: bool = True, shared: SharedExpert | None = None) -> Tensor:
    """See moe/reference.py; five launches, no host sync. A shared expert of the routed
    experts' width runs in the same launches, as T more pairs; of another width, beside them."""
    check_moe(x, logits, gate_up, down, top_k)
    T, H = x.shape
    E, I = gate_up.shape[0], down.shape[2]
    if shared is not None:
        check_shared_expert(x, shared)
        if shared.gate_proj.shape[0] != I:
            return fused_moe(x, logits, gate_up, down, top_k, renormalize) + shared_expert(x, shared)
    has_shared = shared is not None
    x, logits = tc.unit_last(x), tc.unit_last(logits)
    gate_up, down = gate_up.contiguous(), down.contiguous()
    sg, su, sd, s_gate = (t.contiguous() for t in shared) if has_shared else (down, down, down, down)
    dev = x.device
    n = T * top_k
    out = tc.empty(T, H, dtype=torch.float32, device=dev)
    if T == 0:
        return out.to(x.dtype)
    pairs = n + (T if has_shared else 0)
    weights = tc.empty(pairs, dtype=torch.float32, device=dev)
    ids = tc.empty(n, dtype=torch.int32, device=dev)
    block_e = tc.pow2(E)
    _route_kernel[(T,)](logits, logits.stride(0), weights, ids, out, x, x.stride(0), s_gate, n, H, E, TOP_K=top_k,
                        RENORMALIZE=renormalize, HAS_SHARED=has_shared, BLOCK_E=block_e,
                        BLOCK_K=tc.pow2(top_k, least=2), BLOCK_H=min(1024, tc.pow2(H)))
    block_m = 16 if n <= 16 * E else 64
    sorted_pairs, block_expert, num_padded = align(ids, E, block_m)
    max_blocks = block_expert.shape[0]
    blocks = max_blocks + (triton.cdiv(T, block_m) if has_shared else 0)
    inter = tc.empty(pairs, I, dtype=x.dtype, device=dev)
    common = dict(TOP_K=top_k, BLOCK_M=block_m, DOT=tc.dot_dtype(x), PREC="ieee")
    _gate_up_kernel[lambda meta: (blocks, triton.cdiv(I, meta["BLOCK_N"]))](
        x, x.stride(0), gate_up, gate_up.stride(0), gate_up.stride(1), sg, su, sg.stride(0), inter, sorted_pairs,
        block_expert, num_padded, n, T, max_blocks, H, I, **common)
    _down_kernel[lambda meta: (blocks, triton.cdiv(H, meta["BLOCK_N"]))](
        inter, down, down.stride(0), down.stride(1), sd, sd.stride(0), weights, out, sorted_pairs, block_expert,
        num_padded, n, T, max_blocks, H, I, **common)
    return out if x.dtype == torch.float32 else out.to(x.dtype)
