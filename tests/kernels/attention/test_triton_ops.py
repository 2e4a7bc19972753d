"""The Triton kernels of paged attention (store_kv, prefill, decode) against the op's reference, interpreted on CPU (conftest sets
TRITON_INTERPRET=1 before triton is imported), in fp32 at small, deliberately odd shapes: T = 1,
63, 75; head dims that are not powers of two; more value heads than key heads; varlen batches
against a per-sequence loop. Every buffer a launcher allocates starts as NaN, and so do caches
and state slots nobody should read, so a kernel that reads unwritten memory, or leaves part of
its output unwritten, fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from cairn.kernels.attention import reference as attention_ref
from cairn.kernels.attention import triton_ops as attention_triton
from tests.kernels.conventions import EXACT, TOL, triton_interpreted

PAGE, NUM_PAGES, H_Q, H_KV, D = 8, 40, 6, 2, 12  # D = 12: not a power of two


GARBAGE = [-1, 2**30, NUM_PAGES - 1]  # table entries past a sequence: negative, out of range, a NaN page


pytestmark = [triton_interpreted, pytest.mark.usefixtures("nan_filled_buffers")]


def nan_caches():
    shape = (NUM_PAGES, PAGE, H_KV, D)
    return torch.full(shape, math.nan), torch.full(shape, math.nan)


def paged_batch(cached_and_new: list[tuple[int, int]], seed: int = 0):
    """Sequences on shuffled pages of NaN caches; returns (query, k_cache, v_cache, table, cu, lens)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = nan_caches()
    free = torch.randperm(NUM_PAGES - 1, generator=gen).tolist()  # the last page stays NaN
    max_pages = max(-(-(c + n) // PAGE) for c, n in cached_and_new) + 2
    table = torch.tensor(GARBAGE * max_pages)[:max_pages].repeat(len(cached_and_new), 1)
    queries = []
    for b, (cached, new) in enumerate(cached_and_new):
        total = cached + new
        pages = [free.pop() for _ in range(-(-total // PAGE))]
        table[b, : len(pages)] = torch.tensor(pages)
        slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(total)])
        attention_ref.store_kv(torch.randn(total, H_KV, D, generator=gen), torch.randn(total, H_KV, D, generator=gen),
                           k_cache, v_cache, slots)
        queries.append(torch.randn(new, H_Q, D, generator=gen))
    cu = torch.tensor([0] + [n for _, n in cached_and_new]).cumsum(0).to(torch.int32)
    lens = torch.tensor([c + n for c, n in cached_and_new], dtype=torch.int32)
    return torch.cat(queries), k_cache, v_cache, table.to(torch.int32), cu, lens


# cached prefix, new tokens: empty prefixes, single tokens, a prefix past one key block (64), a
# prompt past one query block (64)
BATCH = [(0, 13), (9, 1), (16, 7), (0, 1), (70, 5), (0, 75)]


SCALE = D ** -0.5


def arena_views(k_cache: torch.Tensor, v_cache: torch.Tensor, layers: int = 3, layer: int = 1):
    """The caches as the engine lays them: one NaN arena block per page holding every layer's K
    and V, each layer's cache a view whose pages are strided by a block."""
    arena = torch.full((NUM_PAGES, layers, 2, PAGE, H_KV, D), math.nan)
    k, v = arena[:, layer, 0], arena[:, layer, 1]
    k.copy_(k_cache)
    v.copy_(v_cache)
    return arena, k, v


def test_store_kv_writes_exactly_the_mapped_slots_and_skips_negative_ones():
    key, value = torch.randn(7, H_KV, D), torch.randn(7, H_KV, D)
    slots = torch.tensor([13, -1, 0, 7, -5, 319, 200])
    got, want = nan_caches(), nan_caches()
    attention_triton.store_kv(key, value, *got, slots)
    attention_ref.store_kv(key, value, *want, slots)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, **EXACT)


def test_prefill_equals_the_reference_and_each_sequence_alone():
    query, k_cache, v_cache, table, cu, lens = paged_batch(BATCH)
    out = attention_triton.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    want = attention_ref.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    torch.testing.assert_close(out, want, **TOL)
    for b in (1, 4, 5):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = attention_triton.paged_attention_prefill(query[rows], k_cache, v_cache, table[b:b + 1],
                                                  torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
                                                  lens[b:b + 1], SCALE)
        torch.testing.assert_close(alone, out[rows], **TOL)


def test_decode_equals_the_reference_and_the_last_prefill_row_across_splits():
    query, k_cache, v_cache, table, cu, lens = paged_batch(BATCH, seed=1)
    last = (cu[1:] - 1).long()
    out = attention_triton.paged_attention_decode(query[last], k_cache, v_cache, table, lens, SCALE)
    torch.testing.assert_close(out, attention_ref.paged_attention_decode(query[last], k_cache, v_cache, table, lens,
                                                                     SCALE), **TOL)
    prefill = attention_triton.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    torch.testing.assert_close(out, prefill[last], **TOL)


def test_attention_over_strided_arena_pages_equals_contiguous_caches():
    query, k_cache, v_cache, table, cu, lens = paged_batch(BATCH, seed=2)
    arena, k, v = arena_views(k_cache, v_cache)
    assert not k.is_contiguous()
    torch.testing.assert_close(attention_triton.paged_attention_prefill(query, k, v, table, cu, lens, SCALE),
                               attention_ref.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE),
                               **TOL)
    last = (cu[1:] - 1).long()
    torch.testing.assert_close(attention_triton.paged_attention_decode(query[last], k, v, table, lens, SCALE),
                               attention_ref.paged_attention_decode(query[last], k_cache, v_cache, table, lens, SCALE),
                               **TOL)
    key, value = torch.randn(5, H_KV, D), torch.randn(5, H_KV, D)
    slots = torch.tensor([13, -1, 0, 7, 319])
    attention_ref.store_kv(key, value, k_cache, v_cache, slots)
    before = arena.clone()
    attention_triton.store_kv(key, value, k, v, slots)
    torch.testing.assert_close(k, k_cache, equal_nan=True, **EXACT)
    torch.testing.assert_close(v, v_cache, equal_nan=True, **EXACT)
    others = torch.ones(arena.shape[1], dtype=torch.bool)
    others[1] = False
    torch.testing.assert_close(arena[:, others], before[:, others], equal_nan=True, **EXACT)  # other layers untouched



def test_decode_over_more_splits_than_the_merge_reads_at_once_equals_the_reference(monkeypatch):
    """A long context cut into 16 splits (the interpreted launcher sizes them for 8 SMs): the merge
    folds them in MERGE_SPLITS at a time, rescaling to the running maximum."""
    gen = torch.Generator().manual_seed(11)
    pages, total = 128, 900
    k_cache, v_cache = torch.randn(pages, PAGE, H_KV, D, generator=gen), torch.randn(pages, PAGE, H_KV, D, generator=gen)
    table = torch.randperm(pages, generator=gen)[None, :-(-total // PAGE)].to(torch.int32)
    lens = torch.tensor([total], dtype=torch.int32)
    query = torch.randn(1, H_Q, D, generator=gen)
    splits = []
    monkeypatch.setattr(attention_triton, "_decode_merge_kernel",
                        Splits(attention_triton._decode_merge_kernel, splits))
    got = attention_triton.paged_attention_decode(query, k_cache, v_cache, table, lens, SCALE)
    assert splits and splits[0] > 8, splits
    torch.testing.assert_close(got, attention_ref.paged_attention_decode(query, k_cache, v_cache, table, lens, SCALE),
                               **TOL)


class Splits:
    """Stands in for the merge kernel: records its split count, then launches it."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(args[6])  # num_splits
            return self.kernel[grid](*args, **kwargs)
        return launch
