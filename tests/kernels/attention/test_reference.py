"""The reference of paged attention (store_kv, prefill, decode) (cairn/kernels/attention/reference.py, the contract every
implementation is held to) against plain attention, prefill against decode, at odd shapes in fp32. Buffers an op writes into start as NaN,
so reading an unwritten slot fails loudly. The ops run through `cairn.kernels` with the references
forced.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cairn.kernels import (
    paged_attention_decode,
    paged_attention_prefill,
    store_kv,
)
from tests.kernels.conventions import TOL

PAGE, NUM_PAGES, H_Q, H_KV, D = 8, 40, 6, 2, 12


pytestmark = pytest.mark.usefixtures("the_references")


GARBAGE = [-1, 2**30, 39]  # past a sequence's pages: negative, out of range, an unused NaN page


def nan_caches(dtype=torch.float32):
    shape = (NUM_PAGES, PAGE, H_KV, D)
    return torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)


def paged_batch(cached_and_new: list[tuple[int, int]], seed: int = 0):
    """A varlen batch whose sequences live on shuffled pages of NaN-filled caches.

    Returns (query [T, H_q, D], caches, page_table, cu_seqlens_q, seq_lens, full K/V per sequence).
    """
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = nan_caches()
    free = torch.randperm(NUM_PAGES - 1, generator=gen).tolist()  # page 39 stays unused
    max_pages = max(-(-(c + n) // PAGE) for c, n in cached_and_new) + 2
    table = torch.tensor(GARBAGE * max_pages)[: max_pages].repeat(len(cached_and_new), 1)
    queries, full_kv = [], []
    for b, (cached, new) in enumerate(cached_and_new):
        total = cached + new
        pages = [free.pop() for _ in range(-(-total // PAGE))]
        table[b, : len(pages)] = torch.tensor(pages)
        key, value = torch.randn(total, H_KV, D, generator=gen), torch.randn(total, H_KV, D, generator=gen)
        slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(total)])
        store_kv(key, value, k_cache, v_cache, slots)
        queries.append(torch.randn(new, H_Q, D, generator=gen))
        full_kv.append((key, value))
    lens = [c + n for c, n in cached_and_new]
    cu = torch.tensor([0] + [n for _, n in cached_and_new], dtype=torch.int32).cumsum(0).to(torch.int32)
    return (torch.cat(queries), k_cache, v_cache, table.to(torch.int32), cu,
            torch.tensor(lens, dtype=torch.int32), full_kv)


BATCH = [(0, 13), (9, 1), (16, 7), (0, 1), (21, 30)]  # cached prefix, new tokens (some prefixes 0)


SCALE = D ** -0.5


def test_store_kv_writes_exactly_the_mapped_slots_and_skips_negative_ones():
    k_cache, v_cache = nan_caches()
    key, value = torch.randn(6, H_KV, D), torch.randn(6, H_KV, D)
    slots = torch.tensor([13, -1, 0, 7, -5, 319])
    store_kv(key, value, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, H_KV, D), v_cache.view(-1, H_KV, D)
    written = slots[slots >= 0]
    torch.testing.assert_close(flat_k[written], key[slots >= 0], atol=0, rtol=0)
    torch.testing.assert_close(flat_v[written], value[slots >= 0], atol=0, rtol=0)
    untouched = torch.ones(NUM_PAGES * PAGE, dtype=torch.bool)
    untouched[written] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_store_kv_casts_to_the_cache_dtype():
    k_cache, v_cache = nan_caches(torch.bfloat16)
    key, value = torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    store_kv(key, value, k_cache, v_cache, torch.tensor([3, 9]))
    assert torch.equal(k_cache.view(-1, H_KV, D)[[3, 9]], key.bfloat16())
    assert torch.equal(v_cache.view(-1, H_KV, D)[[3, 9]], value.bfloat16())


def test_prefill_equals_plain_causal_attention_over_prefix_and_new_tokens():
    query, k_cache, v_cache, table, cu, lens, full_kv = paged_batch(BATCH)
    out = paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    assert out.shape == query.shape and not out.isnan().any()
    for b, ((cached, new), (key, value)) in enumerate(zip(BATCH, full_kv)):
        q = query[cu[b]: cu[b + 1]].transpose(0, 1)[None]  # [1, H_q, new, D]
        k, v = (x.repeat_interleave(H_Q // H_KV, dim=1).transpose(0, 1)[None] for x in (key, value))
        visible = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=SCALE)[0].transpose(0, 1)
        torch.testing.assert_close(out[cu[b]: cu[b + 1]], want, **TOL)


def test_decode_equals_the_prefill_output_of_each_sequence_last_token():
    query, k_cache, v_cache, table, cu, lens, _ = paged_batch(BATCH)
    prefill = paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    last = (cu[1:] - 1).long()
    out = paged_attention_decode(query[last], k_cache, v_cache, table, lens, SCALE)
    torch.testing.assert_close(out, prefill[last], **TOL)

