"""Triton fused mixture of experts: `fused_moe` as moe/reference.py defines it, in seven
launches, with no host sync and no shape that depends on the routing (a CUDA graph can hold it).

The launches, for T tokens, E experts, top k (N = T * k (token, expert) pairs, pair p = token
p // k, its (p % k)-th choice):
1. `_route_kernel`, grid (T,): softmax of the token's logits in fp32, top k by iterated argmax
   (exact ties: the lower expert id), renormalised; writes the pair weights [N] fp32 and expert
   ids [N] int32 (and, with a shared expert, its sigmoid gate as the weight of pair N + t).
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
   pair's weight in fp32, stored as the pair's row of `y` [N, H] in x's dtype (no atomics: each
   pair's row is written once).
7. `_sum_kernel`, grid (T, cdiv(H, SUM_BLOCK_H)): each token's k rows of `y` (and its shared
   row) summed in fp32 into the output, in x's dtype.

Matmul operands are cast to `DOT` as loaded: compiled, the stored 16-bit dtype (tensor cores, no
round trip through fp32 between the load and the dot) or exact fp32 (no TF32); interpreted, fp32
(which the interpreter needs for bf16). Accumulation is fp32. BLOCK_M
is fixed by the mean pairs per expert (moe/tuning.py's `block_m`: 16, 64 or 128); the GEMMs'
BLOCK_N, BLOCK_K, warps and stages are autotuned per (H, I, BLOCK_M) (`GATE_UP_CONFIGS`,
`DOWN_CONFIGS`, triton_helpers.tuned; the first one interpreted). The integers that vary with the
step (tokens, pairs, blocks, chunks) are not specialised on (`do_not_specialize`): one compile
serves every step size (cairn.kernels.common.compile_watch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.common import triton_helpers as tc
from cairn.kernels.common.checks import check_moe, check_shared_expert
from cairn.kernels.moe.expert import SharedExpert, shared_expert
from cairn.kernels.moe.tuning import (ALIGN_CHUNKS, ALIGN_FILL_BLOCKS, ALIGN_TILE, DOWN_CONFIGS, GATE_UP_CONFIGS,
                                     GEMM_K, GEMM_N, SUM_BLOCK_H, block_m)


@triton.jit(do_not_specialize=["N"])
def _route_kernel(logits, s_lt, weights, ids, x, s_xt, shared_gate, N, H, E, TOP_K: tl.constexpr,
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
    if HAS_SHARED:  # the shared expert's weight, at pair N + t
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            xv = tl.load(x + t * s_xt + h, mask=h < H, other=0.0).to(tl.float32)
            dot += xv * tl.load(shared_gate + h, mask=h < H, other=0.0).to(tl.float32)
        tl.store(weights + N + t, 1.0 / (1.0 + tl.exp(-tl.sum(dot, axis=0))))


@triton.jit(do_not_specialize=["N", "CHUNK"])
def _align_count_kernel(ids, N, counts, CHUNK, PASS: tl.constexpr, BLOCK_E: tl.constexpr):
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


@triton.jit(do_not_specialize=["CHUNKS"])
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


@triton.jit(do_not_specialize=["N", "CHUNKS", "MAX_BLOCKS", "CHUNK"])
def _align_scatter_kernel(ids, N, E, offsets, expert_start, expert_count, sorted_pairs, block_expert, CHUNKS,
                          MAX_BLOCKS, CHUNK, BLOCK_M: tl.constexpr, PASS: tl.constexpr,
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
    in order, pair N + t. Padding rows get pair and token 0, so that loads need no mask (their
    rows are computed and never stored)."""
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
    pairs = tl.where(valid, pairs, 0)
    tokens = tl.where(valid, tokens, 0)
    return busy, expert.to(tl.int64), pairs.to(tl.int64), valid, tokens.to(tl.int64)


@triton.jit
def _gathered_product(a_rows, b_rows, b_cols, col_ok, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, EVEN: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: rows gathered from A (`a_rows`: [BLOCK_M] row pointers, K contiguous)
    times B's columns (`b_cols`: [BLOCK_N] offsets from `b_rows` of K contiguous weights each; the
    tiles are int32 offsets from those pointers). EVEN: K a multiple of BLOCK_K and every column
    real, so no load is masked; padding rows point at a real row and are never stored."""
    kk = tl.arange(0, BLOCK_K)
    b_off = kk[:, None] + b_cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN:
            a = tl.load(a_rows[:, None] + (k0 + kk)[None, :])
            b = tl.load(b_rows + k0 + b_off)
        else:
            k_ok = k0 + kk < K
            a = tl.load(a_rows[:, None] + (k0 + kk)[None, :], mask=k_ok[None, :], other=0.0)
            b = tl.load(b_rows + k0 + b_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC)
    return acc


@tc.tuned(GATE_UP_CONFIGS, key=["H", "I", "BLOCK_M"], per="BLOCK_M")
@triton.jit(do_not_specialize=["N", "T", "MAX_BLOCKS"])
def _gate_up_kernel(x, s_xt, w, s_we, s_wn, sg, s_sn, shared_up, inter, sorted_pairs, block_expert, num_padded, N, T,
                    MAX_BLOCKS, H, I, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, EVEN: tl.constexpr):
    """Output columns [j BLOCK_N / 2, (j + 1) BLOCK_N / 2) of block b: one [BLOCK_M, BLOCK_N] product
    whose B tile interleaves gate and up rows (column c: gate row if c is even, up row if odd), so
    one accumulator holds both and the epilogue splits it. Up rows lie `I s_wn` elements past the
    gate rows in gate_up[e]; the shared expert's, `shared_up` past its gate's (another tensor)."""
    busy, expert, pairs, valid, tokens = _expert_block(sorted_pairs, block_expert, num_padded, N, T, MAX_BLOCKS,
                                                       TOP_K, BLOCK_M)
    if not busy:
        return
    if expert >= 0:
        gate_rows, up_minus_gate, s_n = w + expert * s_we, I * s_wn, s_wn
    else:
        gate_rows, up_minus_gate, s_n = sg, shared_up, s_sn
    c = tl.arange(0, BLOCK_N)
    half = tl.program_id(1) * (BLOCK_N // 2)
    col = half + c // 2  # the output column each B column feeds
    col_ok = col < I
    acc = _gathered_product(x + tokens * s_xt, gate_rows, col * s_n + (c % 2) * up_minus_gate, col_ok, H,
                            BLOCK_M, BLOCK_N, BLOCK_K, DOT, PREC, EVEN)
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    h = gate / (1.0 + tl.exp(-gate)) * up
    n = half + tl.arange(0, BLOCK_N // 2)
    tl.store(inter + pairs[:, None] * I + n[None, :], h.to(inter.dtype.element_ty), mask=valid[:, None] & (n < I)[None, :])


@tc.tuned(DOWN_CONFIGS, key=["H", "I", "BLOCK_M"], per="BLOCK_M")
@triton.jit(do_not_specialize=["N", "T", "MAX_BLOCKS"])
def _down_kernel(inter, w, s_we, s_wn, sd, s_sd, weights, y, sorted_pairs, block_expert, num_padded, N, T,
                 MAX_BLOCKS, H, I, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, EVEN: tl.constexpr):
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
    acc = _gathered_product(inter + pairs * I, rows, n * s_n, n_ok, I, BLOCK_M, BLOCK_N, BLOCK_K, DOT, PREC, EVEN)
    scale = tl.load(weights + pairs, mask=valid, other=0.0)
    tl.store(y + pairs[:, None] * H + n[None, :], (acc * scale[:, None]).to(y.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["N"])
def _sum_kernel(y, out, s_ot, N, H, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = the sum of token t's pair rows of y (its k routed pairs, then its shared one), in fp32."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y + (t * TOP_K + j) * H + h, mask=h < H, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(y + (N + t) * H + h, mask=h < H, other=0.0).to(tl.float32)
    tl.store(out + t * s_ot + h, acc.to(out.dtype.element_ty), mask=h < H)


def align(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """See `reference.align`: three launches over many programs, no host sync, every grid fixed by
    (N, num_experts, block_m)."""
    n, dev = ids.shape[0], ids.device
    block_e = tc.pow2(num_experts)
    step = max(1, ALIGN_TILE // block_e)  # pairs a pass: the [pairs, experts] one-hot tile stays ALIGN_TILE
    chunk = max(step, tc.pow2(triton.cdiv(n, ALIGN_CHUNKS), least=1))
    chunks = max(1, triton.cdiv(n, chunk))
    max_padded = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m  # any routing's most
    max_blocks = max_padded // block_m
    offsets = tc.empty(chunks, block_e, dtype=torch.int32, device=dev)
    expert_start = tc.empty(block_e, dtype=torch.int32, device=dev)
    expert_count = tc.empty(block_e, dtype=torch.int32, device=dev)
    sorted_pairs = tc.empty(max_padded, dtype=torch.int32, device=dev)
    block_expert = tc.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = tc.empty(1, dtype=torch.int32, device=dev)
    _align_count_kernel[(chunks,)](ids, n, offsets, chunk, PASS=step, BLOCK_E=block_e)
    _align_offsets_kernel[(1,)](offsets, chunks, num_experts, expert_start, expert_count, num_padded,
                                BLOCK_M=block_m, ROWS=step, BLOCK_E=block_e, num_warps=8)
    _align_scatter_kernel[(chunks + triton.cdiv(max_blocks, ALIGN_FILL_BLOCKS),)](
        ids, n, num_experts, offsets, expert_start, expert_count, sorted_pairs, block_expert, chunks, max_blocks, chunk,
        BLOCK_M=block_m, PASS=step, BLOCK_E=block_e, FILL_BLOCKS=ALIGN_FILL_BLOCKS)
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
    out = tc.empty(T, H, dtype=x.dtype, device=dev)
    if T == 0:
        return out
    pairs = n + (T if has_shared else 0)
    weights = tc.empty(pairs, dtype=torch.float32, device=dev)
    ids = tc.empty(n, dtype=torch.int32, device=dev)
    block_e = tc.pow2(E)
    _route_kernel[(T,)](logits, logits.stride(0), weights, ids, x, x.stride(0), s_gate, n, H, E, TOP_K=top_k,
                        RENORMALIZE=renormalize, HAS_SHARED=has_shared, BLOCK_E=block_e,
                        BLOCK_K=tc.pow2(top_k, least=2), BLOCK_H=min(1024, tc.pow2(H)))
    bm = block_m(n, E)
    sorted_pairs, block_expert, num_padded = align(ids, E, bm)
    max_blocks = block_expert.shape[0]
    blocks = max_blocks + (triton.cdiv(T, bm) if has_shared else 0)
    inter = tc.empty(pairs, I, dtype=x.dtype, device=dev)
    shared_up = (su.data_ptr() - sg.data_ptr()) // su.element_size() if has_shared else 0
    common = dict(TOP_K=top_k, BLOCK_M=bm, DOT=tc.dot_dtype(x), PREC="ieee")
    _gate_up_kernel[lambda meta: (blocks, triton.cdiv(2 * I, meta["BLOCK_N"]))](
        x, x.stride(0), gate_up, gate_up.stride(0), gate_up.stride(1), sg, sg.stride(0), shared_up, inter, sorted_pairs,
        block_expert, num_padded, n, T, max_blocks, H, I, **common, EVEN=H % GEMM_K == 0 and I % GEMM_N == 0)
    y = tc.empty(pairs, H, dtype=x.dtype, device=dev)
    _down_kernel[lambda meta: (blocks, triton.cdiv(H, meta["BLOCK_N"]))](
        inter, down, down.stride(0), down.stride(1), sd, sd.stride(0), weights, y, sorted_pairs, block_expert,
        num_padded, n, T, max_blocks, H, I, **common, EVEN=I % GEMM_K == 0 and H % GEMM_N == 0)
    block_h = min(SUM_BLOCK_H, tc.pow2(H))
    _sum_kernel[(T, triton.cdiv(H, block_h))](y, out, out.stride(0), n, H, TOP_K=top_k, HAS_SHARED=has_shared,
                                              BLOCK_H=block_h)
    return out
