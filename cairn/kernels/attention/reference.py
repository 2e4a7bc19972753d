"""Paged attention in plain fp32 torch, sequence by sequence: the oracle every implementation of
`store_kv`, `paged_attention_prefill` and `paged_attention_decode` is tested against, and the slow
fallback (`cairn.kernels.common.dispatch`).

The ops' contract, which every implementation keeps:
- Tokens are rows. A varlen prefill concatenates B sequences' new tokens into query [T, H_q, D]
  with `cu_seqlens_q` [B+1] int32 offsets; a decode batch is [B, H_q, D], one token per sequence.
- Paged KV: `k_cache`, `v_cache` are [num_pages, page_size, H_kv, D] (D contiguous; pages may be
  strided, views over the engine's arena). Token p of sequence b lives in page
  `page_table[b, p // page_size]` ([B, max_pages] int32) at offset `p % page_size`; a KV slot is
  `page * page_size + offset` (token units). `seq_lens` [B] int32 counts a sequence's tokens
  including the new ones, whose K/V are stored before attention runs. Entries of `page_table`
  past a sequence's ceil(seq_len / page_size) pages are garbage and never read; so are unwritten
  slots of the caches.
- GQA: query head h reads KV head h // (H_q // H_kv). Softmax in fp32; outputs in query's dtype.
- Only `store_kv` writes into its arguments (the caches).
The math here is the definition, spelled out: scores, mask and softmax over each sequence's
gathered keys, in fp32, no blocking.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cairn.kernels.common.checks import (
    check_decode_lens,
    check_paged,
    check_prefill,
    check_store_kv,
    expect_shape,
)


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write each token's K/V into its cache slot, cast to the cache dtype; negative slots are skipped.

    key, value [T, H_kv, D]; k_cache, v_cache [num_pages, page_size, H_kv, D] (written in place);
    slot_mapping [T] int64, slot = page * page_size + offset_in_page.
    """
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    page_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // page_size, slot % page_size] = key[t].to(k_cache.dtype)
            v_cache[slot // page_size, slot % page_size] = value[t].to(v_cache.dtype)


def _attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, pages: Tensor, total: int, scale: float) -> Tensor:
    """The last q.shape[0] positions of a sequence of `total` tokens (in `pages`) attend causally
    to its positions: q [n, H_q, D] -> [n, H_q, D] fp32."""
    n, h_q = q.shape[0], q.shape[1]
    k = k_cache[pages.long()].flatten(0, 1)[:total].float()  # [total, H_kv, D]
    v = v_cache[pages.long()].flatten(0, 1)[:total].float()
    group = h_q // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [total, H_q, D]
    scores = torch.einsum("nhd,khd->hnk", q.float(), k) * scale
    position = torch.arange(total - n, total, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(total, device=q.device)[None, :] > position, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(dim=-1), v)


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float, plan=None) -> Tensor:
    """Causal attention of B sequences' new tokens over their cached prefix and themselves.

    query [T, H_q, D]; cu_seqlens_q [B+1] int32; seq_lens [B] int32, totals including the new
    tokens. New token i of sequence b sits at position seq_lens[b] - q_len_b + i and attends to
    positions [0, that position]. Returns [T, H_q, D] in query's dtype. `plan` (the
    `VarlenPlan` of cu_seqlens_q), when given, spares reading the boundaries back.
    """
    batch, _, cu, lens = check_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, plan)
    page_size = k_cache.shape[1]
    out = torch.empty_like(query)
    for b in range(batch):
        if cu[b + 1] > cu[b]:
            pages = page_table[b, : -(-lens[b] // page_size)]
            out[cu[b]:cu[b + 1]] = _attend(query[cu[b]:cu[b + 1]], k_cache, v_cache, pages, lens[b], scale).to(query.dtype)
    return out


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    """One new token per sequence attends to its sequence's positions [0, seq_lens[b]).

    query [B, H_q, D]; seq_lens [B] int32 (>= 1, the new token's K/V already stored).
    Returns [B, H_q, D] in query's dtype.
    """
    batch, _ = check_paged(query, k_cache, v_cache, page_table, seq_lens)
    expect_shape("query", query, "B, H_q, D", (batch, None, None))
    page_size = k_cache.shape[1]
    check_decode_lens(seq_lens, page_table.shape[1] * page_size)
    out = torch.empty_like(query)
    for b, total in enumerate(seq_lens.tolist()):
        pages = page_table[b, : -(-total // page_size)]
        out[b] = _attend(query[b:b + 1], k_cache, v_cache, pages, total, scale)[0].to(query.dtype)
    return out
