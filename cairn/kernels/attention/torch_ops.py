"""Paged attention as torch ops on a CPU: what a CPU runs where the C++ library has no kernel for
the call (`store_kv`, and prefill except bf16 at a head dim of 64 with AMX: attention/cpu_ops.py).

Contracts: attention/reference.py's. `store_kv` is one indexed write per cache. Prefill runs
torch's CPU flash-attention kernel per sequence, twice where a prefix is cached: the new tokens
over themselves (causal) and over the prefix (every new token sees it all, so a KV head's query
heads fold into its rows), merged exactly by their log-sum-exps. Over bf16 queries and caches it
runs on the bf16 values (oneDNN's matrix engine; scores, softmax and sums accumulate in fp32
inside it), about 2.7x faster than in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cairn.kernels.common.checks import check_prefill, check_store_kv


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """See attention/reference.py."""
    check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    page_size = k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size
    k_cache[pages, offsets] = key[keep].to(k_cache.dtype)
    v_cache[pages, offsets] = value[keep].to(v_cache.dtype)


def _flash(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """softmax(q k^T * scale) v over [1, H, n, D] blocks (causal: query i sees keys <= i), and the
    rows' log-sum-exp [1, H, n]: two blocks' results merge exactly by them, so a prefix needs no mask."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scale)


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float, plan=None) -> Tensor:
    """See attention/reference.py (CPU tensors)."""
    batch, group, cu, lens = check_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, plan)
    page_size = k_cache.shape[1]
    work = torch.bfloat16 if query.dtype == torch.bfloat16 else torch.float32
    out, h_kv = torch.empty_like(query), k_cache.shape[2]
    for b in range(batch):
        start, end, total = cu[b], cu[b + 1], lens[b]
        n_new = end - start
        if n_new == 0:
            continue
        pages = page_table[b, : -(-total // page_size)].long()
        k = k_cache[pages].flatten(0, 1)[:total].to(work).transpose(0, 1)  # [H_kv, total, D]
        v = v_cache[pages].flatten(0, 1)[:total].to(work).transpose(0, 1)
        q = query[start:end].to(work).transpose(0, 1)  # [H_q, n_new, D]
        cached = total - n_new  # keys before the new tokens: all visible; the new ones causally
        o, lse = _flash(q[None], k[None, :, cached:].repeat_interleave(group, 1),
                        v[None, :, cached:].repeat_interleave(group, 1), True, scale)
        if cached:
            folded = q.reshape(h_kv, group * n_new, q.shape[-1])[None]
            o_old, lse_old = _flash(folded, k[None, :, :cached], v[None, :, :cached], False, scale)
            o_old, lse_old = o_old.reshape(o.shape), lse_old.reshape(lse.shape)
            top = torch.maximum(lse, lse_old)
            w, w_old = (lse - top).exp()[..., None], (lse_old - top).exp()[..., None]
            o = (o.float() * w + o_old.float() * w_old) / (w + w_old)
        out[start:end] = o[0].transpose(0, 1).to(query.dtype)
    return out
