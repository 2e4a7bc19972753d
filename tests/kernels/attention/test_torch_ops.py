"""The CPU's torch forms of paged attention (attention/torch_ops.py: `store_kv`'s indexed write,
prefill through torch's flash kernel, prefix and new tokens merged by their log-sum-exps) against
the reference's sequence-by-sequence definition."""

from __future__ import annotations

import torch

from cairn.kernels.attention import reference, torch_ops
from tests.kernels.attention.test_reference import BATCH, SCALE, nan_caches, paged_batch


def test_store_kv_writes_what_the_reference_writes_and_skips_negative_slots():
    key, value = torch.randn(5, 2, 12), torch.randn(5, 2, 12)
    slots = torch.tensor([0, 17, -1, 63, 9])
    mine, theirs = nan_caches(), nan_caches()
    torch_ops.store_kv(key, value, *mine, slots)
    reference.store_kv(key, value, *theirs, slots)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(mine, theirs))


def test_prefill_over_a_cached_prefix_and_new_tokens_equals_the_reference():
    query, k_cache, v_cache, table, cu, lens, _ = paged_batch(BATCH)
    torch.testing.assert_close(torch_ops.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE),
                               reference.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE),
                               atol=2e-5, rtol=1e-4)


def test_bf16_prefill_is_the_fp32_attention_to_bf16_accuracy():
    """bf16 caches and queries attend in bf16 (oneDNN's flash kernel; sums in fp32 inside it), as
    close to the reference's fp32 as bf16 allows."""
    query, k_cache, v_cache, table, cu, lens, _ = paged_batch(BATCH)
    query, k_cache, v_cache = (x.bfloat16() for x in (query, k_cache, v_cache))
    out = torch_ops.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    want = reference.paged_attention_prefill(query.float(), k_cache.float(), v_cache.float(), table, cu, lens, SCALE)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
