"""The C++ CPU kernels of paged attention (store_kv, prefill, decode) (cairn/kernels/attention/*.cpp, launched by cpu_ops.py) against
the op's reference, at odd shapes (odd lengths, empty and short segments, head dims off the vector
width, more value heads than key heads), on the strided pools and pages the engine passes, in
fp32 and bf16. Pool slots the op must not touch, and the rest of every buffer, start as NaN: a
kernel that reads or writes outside its rows fails loudly.
Prefill runs the C++ kernel only in bf16 at a head dim of 64 on an AMX CPU, else torch's flash kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from cairn.kernels.attention import cpu_ops as attention_cpu
from cairn.kernels.attention import reference as attention_ref
from cairn.kernels.attention import torch_ops as attention_torch
from cairn.kernels.common import native
from tests.kernels.conventions import BF16, TOL, needs_compiler, rand

pytestmark = [needs_compiler, pytest.mark.usefixtures("native_library")]


def amx() -> bool:
    return native.library() and bool(torch.ops.cairn_cpu.amx_available())


@pytest.mark.parametrize("group, head_dim", [(1, 32), (4, 64), (3, 40)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_decode_attention_over_strided_pages_equals_the_reference(group, head_dim, dtype, tol):
    h_kv, page_size, pages = 2, 16, 40
    arena = torch.full((pages, 3, 2, page_size, h_kv, head_dim), math.nan, dtype=dtype)  # [block, layer, K|V, ...]
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    lens = torch.tensor([1, 16, 17, 100, 33], dtype=torch.int32)
    table = torch.randperm(pages)[:5 * 8].reshape(5, 8).to(torch.int32)
    for b, n in enumerate(lens.tolist()):  # write only each sequence's own tokens
        for p in range(n):
            page = table[b, p // page_size]
            k_cache[page, p % page_size] = rand(h_kv, head_dim, seed=100 * b + p, dtype=dtype)
            v_cache[page, p % page_size] = rand(h_kv, head_dim, seed=100 * b + p + 50, dtype=dtype)
    q = rand(5, h_kv * group, head_dim, seed=9, dtype=dtype)
    want = attention_ref.paged_attention_decode(q, k_cache, v_cache, table, lens, head_dim ** -0.5)
    out = attention_cpu.paged_attention_decode(q, k_cache, v_cache, table, lens, head_dim ** -0.5)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), **tol)


@pytest.mark.skipif(not amx(), reason="no AMX tile unit on this CPU: prefill attention runs torch's flash kernel")
@pytest.mark.parametrize("new, cached, group", [([37], [0], 4), ([16, 5, 0, 100], [0, 33, 9, 70], 4),
                                                ([1], [500], 2), ([300], [1000], 1), ([65, 64], [63, 1], 8)])
def test_prefill_attention_on_the_tile_unit_equals_the_reference(new, cached, group):
    """bf16 at a head dim of 64: within the reference's own distance to fp32 attention."""
    h_kv, page_size, d = 2, 16, 64
    totals = [n + c for n, c in zip(new, cached)]
    width = max(-(-t // page_size) for t in totals)
    arena = torch.full((len(new) * width + 3, 2, 2, page_size, h_kv, d), math.nan, dtype=torch.bfloat16)
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]  # strided pages, as the engine's arena
    table = torch.randperm(arena.shape[0])[:len(new) * width].reshape(len(new), width).to(torch.int32)
    for b, total in enumerate(totals):
        for p in range(total):
            page = table[b, p // page_size]
            k_cache[page, p % page_size] = rand(h_kv, d, seed=1000 * b + p, dtype=torch.bfloat16)
            v_cache[page, p % page_size] = rand(h_kv, d, seed=1000 * b + p + 500, dtype=torch.bfloat16)
    q = rand(sum(new), h_kv * group, d, seed=7, dtype=torch.bfloat16)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(totals, dtype=torch.int32)
    got = attention_cpu.paged_attention_prefill(q, k_cache, v_cache, table, cu, lens, 0.125)
    exact = attention_ref.paged_attention_prefill(q.float(), k_cache.float(), v_cache.float(), table, cu, lens, 0.125)
    theirs = attention_ref.paged_attention_prefill(q, k_cache, v_cache, table, cu, lens, 0.125)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    bound = (theirs.float() - exact).abs().max().item()
    assert (got.float() - exact).abs().max().item() <= 1.5 * bound + 1e-3


def test_prefill_attention_at_other_head_dims_runs_torchs_flash_kernel():
    q, k_cache = rand(12, 2, 32, dtype=torch.bfloat16), rand(2, 16, 1, 32, dtype=torch.bfloat16)
    table, cu, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 12], dtype=torch.int32), \
        torch.tensor([20], dtype=torch.int32)
    assert torch.equal(attention_cpu.paged_attention_prefill(q, k_cache, k_cache, table, cu, lens, 0.2),
                       attention_torch.paged_attention_prefill(q, k_cache, k_cache, table, cu, lens, 0.2))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_short_prefill_segments_run_as_decode_rows_and_equal_the_reference(dtype, tol):
    """Segments of at most `SHORT` new tokens (a verify step's) go through the decode kernel, a
    row a token, each seeing the keys up to its own position; longer ones beside them through
    the prefill kernel: together, the reference's causal attention over cached prefixes."""
    h_kv, group, page_size, d = 2, 4, 16, 64
    new, cached = [3, 1, 20, attention_cpu.SHORT, 2, 9], [40, 0, 17, 15, 0, 100]
    totals = [n + c for n, c in zip(new, cached)]
    width = max(-(-t // page_size) for t in totals)
    arena = torch.full((len(new) * width + 3, 2, 2, page_size, h_kv, d), math.nan, dtype=dtype)
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    table = torch.randperm(arena.shape[0])[:len(new) * width].reshape(len(new), width).to(torch.int32)
    for b, total in enumerate(totals):
        for p in range(total):
            page = table[b, p // page_size]
            k_cache[page, p % page_size] = rand(h_kv, d, seed=1000 * b + p, dtype=dtype)
            v_cache[page, p % page_size] = rand(h_kv, d, seed=1000 * b + p + 500, dtype=dtype)
    q = rand(sum(new), h_kv * group, d, seed=3, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(totals, dtype=torch.int32)
    got = attention_cpu.paged_attention_prefill(q, k_cache, v_cache, table, cu, lens, 0.125)
    want = attention_ref.paged_attention_prefill(q, k_cache, v_cache, table, cu, lens, 0.125)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_decode_attention_refuses_lengths_past_the_page_table():
    k_cache = torch.zeros(4, 16, 1, 8)
    with pytest.raises(ValueError, match="seq_lens"):
        attention_cpu.paged_attention_decode(torch.zeros(1, 2, 8), k_cache, k_cache.clone(), torch.zeros(1, 2, dtype=torch.int32),
                                   torch.tensor([33], dtype=torch.int32), 1.0)

