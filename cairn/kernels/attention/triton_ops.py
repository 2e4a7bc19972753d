"""Triton paged attention: store K/V into pages, varlen causal prefill, and split-K batched decode.

Same contracts as `reference.store_kv`, `paged_attention_prefill`, `paged_attention_decode`.
Shapes: caches [num_pages, page_size, H_kv, D] (D contiguous; pages may be strided, as the
engine's arena lays them); query/out [T, H_q, D] (prefill, B
sequences concatenated, cu_seqlens_q [B+1] int32) or [B, H_q, D] (decode); page_table
[B, max_pages] int32; seq_lens [B] int32 (K/V of the new tokens already stored); slot_mapping
[T] int64. Query head h reads KV head h // (H_q / H_kv). The output gate is the model's job.
Scores and softmax in fp32; the two matmuls take operands in the cache dtype (bf16 runs on
tensor cores, fp32 runs exact "ieee" dots), accumulating in fp32. Page-table entries past a
sequence's pages and cache slots past seq_len are never read (their loads are masked).
Decode splits and prefill blocks are sized on the host from tensor shapes and cu_seqlens_q.

Launches:
- `_store_kv_kernel`, grid (T,): one token's [H_kv, D] K and V; a negative slot stores nothing.
- `_prefill_kernel`, grid (num_blocks, H_kv): a block is ROWS new tokens of one sequence times
  the GROUP query heads of one KV head (tile table built on the host, `VarlenPlan`); online
  softmax over key blocks of BN positions, each position's page looked up in page_table: the
  blocks wholly before the tile's first query (the cached prefix, the earlier new tokens) with
  no mask at all, then the diagonal's with the causal mask, up to the tile's last query position
  (causal blocks past it are never visited).
- `_decode_kernel`, grid (B, H_kv, S): the GROUP query heads of one KV head attend to split s of
  the sequence (S splits of the longest possible context, max_pages * page_size, so no host
  sync); writes unnormalised partials. `_decode_merge_kernel`, grid (B, H_q), combines them, a
  few splits at a time. Split and token counts are not specialised on: one compile serves every
  batch and length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cairn.kernels.attention.tuning import (ATTENTION_ROWS, DECODE_CONFIGS, DECODE_PROGRAMS_PER_SM, MAX_SPLITS,
                                            MERGE_SPLITS, PREFILL_CONFIGS)
from cairn.kernels.common import triton_helpers as tc
from cairn.kernels.common.checks import check_paged, check_store_kv, expect, expect_dtype, expect_shape
from cairn.kernels.common.varlen_plan import VarlenPlan

# Masked scores and empty running maxima are -1e30, a finite -inf: a row that sees nothing yet
# (padding rows, empty splits) computes exp(0) * 0 instead of exp(nan).


@triton.jit(do_not_specialize_on_alignment=["slots"])
def _store_kv_kernel(key, value, k_cache, v_cache, slots, sk_t, sk_h, sv_t, sv_h, sc_page, sc_tok, sc_head,
                     PAGE, H, D, BH: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots + t)
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    page, offset = slot // PAGE, slot % PAGE
    dst = page * sc_page + offset * sc_tok + h[:, None] * sc_head + d[None, :]  # [BH, BD] int64
    live = (tl.zeros([BH, BD], dtype=tl.int64) + slot) >= 0  # a negative slot stores nothing
    mask = (h < H)[:, None] & (d < D)[None, :] & live
    kv = tl.load(key + t * sk_t + h[:, None] * sk_h + d[None, :], mask=mask)
    vv = tl.load(value + t * sv_t + h[:, None] * sv_h + d[None, :], mask=mask)
    tl.store(k_cache + dst, kv.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, vv.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _attend_block(q, m, l, acc, k_cache, v_cache, table_row, pos, visible, kvh, d, dmask,
                  s_page, s_tok, s_head, PAGE, DT: tl.constexpr, PREC: tl.constexpr, MASKED: tl.constexpr):
    """One key block of the online softmax: q [M, BD] (scaled), pos [BN], visible [M, BN]. Without
    MASKED, every position of the block is visible to every row (a block wholly before the
    tile's first query): no mask is built or applied, and K/V go from memory to the dot as stored."""
    if MASKED:
        live = tl.max(visible.to(tl.int32), axis=0) > 0  # [BN] positions some row may read
        page = tl.load(table_row + pos // PAGE, mask=live, other=0).to(tl.int64)
        kv_mask = live[:, None] & dmask[None, :]
    else:
        page = tl.load(table_row + pos // PAGE).to(tl.int64)
        kv_mask = dmask[None, :]
    off = page * s_page + (pos % PAGE) * s_tok + kvh * s_head
    kt = tl.load(k_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q.to(DT), tl.trans(kt.to(DT)), input_precision=PREC)  # [M, BN]
    if MASKED:
        s = tl.where(visible, s, -1.0e30)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    if MASKED:
        p = tl.where(visible, p, 0.0)
    vt = tl.load(v_cache + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DT), vt.to(DT), input_precision=PREC)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@tc.tuned(PREFILL_CONFIGS, key=["D", "GROUP", "ROWS"])
@triton.jit(do_not_specialize=["s_table"],
            do_not_specialize_on_alignment=["page_table", "cu_q", "seq_lens", "block_seq", "block_row"])
def _prefill_kernel(q_ptr, k_cache, v_cache, out, page_table, cu_q, seq_lens, block_seq, block_row,
                    sq_t, sq_h, so_t, so_h, s_page, s_tok, s_head, s_table, scale, D, PAGE,
                    GROUP: tl.constexpr, ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                    DT: tl.constexpr, PREC: tl.constexpr):
    """A tile of ROWS query rows of one sequence times the GROUP query heads of one K/V head: BM >=
    ROWS * GROUP (row, head) pairs in one program, so each K/V block is read once for the group."""
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.load(block_seq + blk)
    row0 = tl.load(block_row + blk)
    q_start = tl.load(cu_q + b)
    q_end = tl.load(cu_q + b + 1)
    total = tl.load(seq_lens + b)
    first_pos = total - (q_end - q_start)  # position of the sequence's first new token
    r = tl.arange(0, BM)
    rows = row0 + r // GROUP
    heads = kvh * GROUP + r % GROUP
    rmask = (rows < q_end) & (r < ROWS * GROUP)
    qpos = first_pos + (rows - q_start)
    d = tl.arange(0, BD)
    dmask = d < D
    rows64 = rows.to(tl.int64)
    q = tl.load(q_ptr + rows64[:, None] * sq_t + heads[:, None] * sq_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32) * scale
    m = tl.full((BM,), -1.0e30, dtype=tl.float32)
    l = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    hi = first_pos + (tl.minimum(row0 + ROWS, q_end) - q_start)  # one past the tile's last query position
    full = (first_pos + (row0 - q_start) + 1) // BN * BN  # blocks before it: visible to every row of the tile
    table_row = page_table + b.to(tl.int64) * s_table
    for n0 in range(0, full, BN):  # the cached prefix and the earlier new tokens: no mask
        pos = n0 + tl.arange(0, BN)
        m, l, acc = _attend_block(q, m, l, acc, k_cache, v_cache, table_row, pos, rmask[:, None], kvh, d, dmask,
                                  s_page, s_tok, s_head, PAGE, DT, PREC, False)
    for n0 in range(full, hi, BN):  # the diagonal: causal and tile-edge masks
        pos = n0 + tl.arange(0, BN)
        visible = (pos[None, :] <= qpos[:, None]) & rmask[:, None]
        m, l, acc = _attend_block(q, m, l, acc, k_cache, v_cache, table_row, pos, visible, kvh, d, dmask,
                                  s_page, s_tok, s_head, PAGE, DT, PREC, True)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out + rows64[:, None] * so_t + heads[:, None] * so_h + d[None, :], o.to(out.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


@tc.tuned(DECODE_CONFIGS, key=["D", "GROUP"])
@triton.jit(do_not_specialize=["num_splits", "s_table"], do_not_specialize_on_alignment=["page_table", "seq_lens"])
def _decode_kernel(q_ptr, k_cache, v_cache, part, stats, page_table, seq_lens,
                   sq_b, sq_h, s_page, s_tok, s_head, s_table, scale, D, PAGE, num_splits,
                   GROUP: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                   DT: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    total = tl.load(seq_lens + b)
    split_len = tl.cdiv(tl.cdiv(total, num_splits), BN) * BN  # this sequence's splits, whole blocks each
    lo = split * split_len
    hi = tl.minimum(lo + split_len, total)
    g = tl.arange(0, BG)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    d = tl.arange(0, BD)
    dmask = d < D
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32) * scale
    m = tl.full((BG,), -1.0e30, dtype=tl.float32)
    l = tl.zeros((BG,), dtype=tl.float32)
    acc = tl.zeros((BG, BD), dtype=tl.float32)
    table_row = page_table + b.to(tl.int64) * s_table
    for n0 in range(lo, hi, BN):
        pos = n0 + tl.arange(0, BN)
        visible = gmask[:, None] & (pos < hi)[None, :]
        m, l, acc = _attend_block(q, m, l, acc, k_cache, v_cache, table_row, pos, visible, kvh, d, dmask,
                                  s_page, s_tok, s_head, PAGE, DT, PREC, True)
    row = (b * (GROUP * tl.num_programs(1)) + heads).to(tl.int64) * num_splits + split  # [B, H_q, S]
    tl.store(part + row[:, None] * BD + d[None, :], acc, mask=gmask[:, None])
    tl.store(stats + row * 2, m, mask=gmask)
    tl.store(stats + row * 2 + 1, l, mask=gmask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(part, stats, out, so_b, so_h, num_heads, num_splits, D,
                         BS: tl.constexpr, BD: tl.constexpr):
    """Merges a (sequence, head)'s splits BS at a time, rescaling to the running max: one
    specialisation for any number of splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BD)
    first = (b * num_heads + h).to(tl.int64) * num_splits
    m_run = tl.full([], -1.0e30, tl.float32)
    l_run = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BD], dtype=tl.float32)
    for s0 in range(0, num_splits, BS):  # split 0 always holds position 0, so the max is real
        s = s0 + tl.arange(0, BS)
        smask = s < num_splits
        m = tl.load(stats + (first + s) * 2, mask=smask, other=-1.0e30)
        l = tl.load(stats + (first + s) * 2 + 1, mask=smask, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        alpha = tl.exp(m_run - m_new)
        weight = tl.exp(m - m_new)
        part_rows = tl.load(part + (first + s)[:, None] * BD + d[None, :], mask=smask[:, None], other=0.0)
        acc = acc * alpha + tl.sum(weight[:, None] * part_rows, axis=0)
        l_run = l_run * alpha + tl.sum(weight * l, axis=0)
        m_run = m_new
    tl.store(out + b * so_b + h * so_h + d, (acc / l_run).to(out.dtype.element_ty), mask=d < D)


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """See `reference.store_kv`."""
    h_kv, d = check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    key, value = tc.unit_last(key), tc.unit_last(value)
    _store_kv_kernel[(key.shape[0],)](key, value, k_cache, v_cache, slot_mapping.contiguous(),
                                      key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                      k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
                                      h_kv, d, BH=tc.pow2(h_kv, least=1), BD=tc.pow2(d, least=1))


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float,
                            plan: VarlenPlan | None = None) -> Tensor:
    """See `reference.paged_attention_prefill`; `plan` (cairn.kernels.varlen_plan) holds the tiles, so no
    length is read back from the device (without one, cu_seqlens_q is, once)."""
    batch, group = check_paged(query, k_cache, v_cache, page_table, seq_lens)
    expect_shape("cu_seqlens_q", cu_seqlens_q, "B+1", (batch + 1,))
    expect_dtype("cu_seqlens_q", cu_seqlens_q, torch.int32)
    plan = plan or VarlenPlan.of(cu_seqlens_q, group=group)
    plan.check("cu_seqlens_q", query.shape[0])
    expect(plan.attention_rows * group <= ATTENTION_ROWS or plan.attention_rows == 1,
            f"a plan of attention tiles of {max(1, ATTENTION_ROWS // group)} rows for {group} query heads per "
            f"K/V head (VarlenPlan.build(..., group={group}))", plan.attention_rows)
    query = tc.unit_last(query)
    out = tc.empty_like(query)
    d = query.shape[2]
    bd = tc.pow2(d)
    tiles = plan.tables["attention_tiles"].shape[1]
    if not tiles:
        return out
    blocks = plan.device("attention_tiles")
    dt, prec = tc.dot_dtype(k_cache), "ieee"
    rows = plan.attention_rows
    _prefill_kernel[(tiles, k_cache.shape[2])](
        query, k_cache, v_cache, out, page_table, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
        blocks[0], blocks[1], query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), page_table.stride(0), float(scale), d,
        k_cache.shape[1], GROUP=group, ROWS=rows, BM=tc.pow2(rows * group), BD=bd, DT=dt, PREC=prec)
    return out


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    """See `reference.paged_attention_decode`."""
    batch, group = check_paged(query, k_cache, v_cache, page_table, seq_lens)
    expect_shape("query", query, "B, H_q, D", (batch, None, None))
    query = tc.unit_last(query)
    out = tc.empty_like(query)
    if batch == 0:
        return out
    h_q, d = query.shape[1], query.shape[2]
    h_kv, page_size = k_cache.shape[2], k_cache.shape[1]
    bd, bn = tc.pow2(d), 64
    max_len = page_table.shape[1] * page_size  # a bound known without reading seq_lens
    # Enough programs for DECODE_PROGRAMS_PER_SM on every SM (a batch of one at a long context
    # needs them all streaming its K/V); a split never holds less than one block. Each sequence
    # cuts its own length into that many splits (in the kernel, from seq_lens), so the work is even
    # whatever the page table's width (a decode graph's is the longest sequence's).
    wanted = triton.cdiv(DECODE_PROGRAMS_PER_SM * tc.sm_count(query.device), batch * h_kv)
    splits = max(1, min(wanted, triton.cdiv(max_len, bn), MAX_SPLITS))
    part = tc.empty(batch, h_q, splits, bd, dtype=torch.float32, device=query.device)
    stats = tc.empty(batch, h_q, splits, 2, dtype=torch.float32, device=query.device)
    dt, prec = tc.dot_dtype(k_cache), "ieee"
    _decode_kernel[(batch, h_kv, splits)](
        query, k_cache, v_cache, part, stats, page_table, seq_lens.contiguous(),
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), float(scale), d, page_size, splits,
        GROUP=group, BG=tc.pow2(group), BD=bd, DT=dt, PREC=prec)
    _decode_merge_kernel[(batch, h_q)](part, stats, out, out.stride(0), out.stride(1), h_q, splits, d,
                                       BS=MERGE_SPLITS, BD=bd)
    return out
