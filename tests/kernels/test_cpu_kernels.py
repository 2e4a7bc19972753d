"""The CPU kernels (cairn/kernels/csrc, launched by cairn.kernels.cpu) against the torch references they stand
in for, at odd shapes (odd lengths, empty and short segments, head dims off the vector width, more
value heads than key heads), on the strided pools and pages the engine passes, in fp32 and bf16.
Pool slots the op must not touch, and the rest of every buffer, start as NaN: a kernel that reads
or writes outside its rows fails loudly. The row-wise ops round where the references round: in bf16
they are bit-identical. `kernels` sends CPU tensors here once the library builds, and to the
references when told to (CAIRN_KERNELS=reference) or when it cannot build."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from cairn import kernels
from cairn.kernels import cpu, cpu_build
from cairn.kernels import reference as ref
from cairn.kernels import reference_fused as ref_fused
from cairn.kernels import reference_sample as ref_sample
from cairn.kernels import reference_varlen as ref_varlen
from tests.support.paths import REPO

ROOT = REPO
pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the CPU kernels cannot build here (the references run)")
TOL = dict(atol=2e-5, rtol=1e-4)
BF16 = dict(atol=2e-2, rtol=2e-2)
HEADS = [(2, 4, 16, 16), (1, 2, 24, 40), (4, 8, 64, 64), (2, 4, 128, 128)]  # H_k, H_v, D_k, D_v


def test_the_library_builds_on_a_machine_with_a_compiler():
    assert cpu_build.library(), cpu_build.build_error()
    assert kernels._varlen_backend(torch.zeros(1)) is cpu


def rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def delta_inputs(total, heads, dtype, seed=0):
    h_k, h_v, d_k, d_v = heads
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(total, h_k, d_k, generator=gen).to(dtype) for _ in range(2))
    v = torch.randn(total, h_v, d_v, generator=gen).to(dtype)
    g = F.logsigmoid(2 * torch.randn(total, h_v, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(total, h_v, generator=gen)).to(dtype)
    return q, k, v, g, beta


def layer_pool(slots, inner, dtype=torch.float32, layers=3, layer=1):
    """A per-layer view of a pool of all layers' states, strided by a slot as the engine's arena
    lays it out, NaN everywhere; returns (the whole pool, the layer's view)."""
    whole = torch.full((slots, layers, *inner), math.nan, dtype=dtype)
    return whole, whole[:, layer]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_varlen_delta_rule_equals_the_reference_with_states_at_positions(heads, dtype, tol):
    lengths = [75, 0, 3, 130, 1]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v, g, beta = delta_inputs(int(cu[-1]), heads, dtype)
    h_v, d_k, d_v = heads[1:]
    whole, pool = layer_pool(8, (h_v, d_k, d_v))
    slots = torch.tensor([6, 0, 2, 5, 3])
    pool[slots] = rand(5, h_v, d_k, d_v, seed=3, scale=0.5)
    positions = [[1, 16, 64, 75], [], [2], [63, 130], [1]]
    want_whole = whole.clone()
    want_out, want_states = ref_varlen.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, want_whole[:, 1], slots,
                                                                     state_positions=positions)
    out, states = cpu.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, pool, slots, state_positions=positions)
    assert out.dtype == dtype and states.dtype == torch.float32
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
    torch.testing.assert_close(states, want_states, **TOL)
    torch.testing.assert_close(whole, want_whole, equal_nan=True, **TOL)  # the final states; the rest NaN still


def test_an_explicit_scale_and_no_l2_norm_reach_the_kernel():
    q, k, v, g, beta = delta_inputs(40, HEADS[0], torch.float32)
    q, k = q / 4, k / 4  # unnormalised keys of norm about 1: a contracting recurrence, as in a model
    cu = torch.tensor([0, 40], dtype=torch.int32)
    for kwargs in (dict(scale=0.3), dict(use_qk_l2norm=False, scale=0.1)):
        a, b = torch.zeros(2, 4, 16, 16), torch.zeros(2, 4, 16, 16)
        want, _ = ref_varlen.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, a, torch.tensor([1]), **kwargs)
        out, _ = cpu.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, b, torch.tensor([1]), **kwargs)
        torch.testing.assert_close(out, want, **TOL)
        torch.testing.assert_close(b, a, **TOL)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, TOL), (torch.bfloat16, BF16)])
def test_decode_step_in_slots_leaves_padding_rows_unwritten(heads, dtype, tol):
    q, k, v, g, beta = delta_inputs(5, heads, dtype, seed=4)
    h_v, d_k, d_v = heads[1:]
    whole, pool = layer_pool(7, (h_v, d_k, d_v))
    slots = torch.tensor([4, -1, 0, 6, -1])
    pool[slots[slots >= 0]] = rand(3, h_v, d_k, d_v, seed=5, scale=0.5)
    want_whole = whole.clone()
    want = ref_varlen.gated_delta_rule_step_slots(q, k, v, g, beta, want_whole[:, 1], slots)
    out = cpu.gated_delta_rule_step_slots(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(out.float(), want.float(), **tol)
    torch.testing.assert_close(whole, want_whole, equal_nan=True, **TOL)


@pytest.mark.parametrize("channels", [24, 300, 1024])
@pytest.mark.parametrize("dtype, pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.bfloat16, torch.float32)])
def test_varlen_conv_equals_the_reference_for_segments_shorter_than_its_window(channels, dtype, pool_dtype):
    lengths = [0, 1, 2, 3, 70, 130]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    x = rand(int(cu[-1]), channels, seed=1, dtype=dtype)
    weight = rand(channels, 4, seed=2)
    whole, pool = layer_pool(9, (channels, 3), dtype=pool_dtype)
    slots = torch.tensor([8, 1, 2, 0, 5, 7])
    pool[slots] = rand(6, channels, 3, seed=3, dtype=pool_dtype)
    want_whole = whole.clone()
    want = ref_varlen.causal_conv1d_varlen(x, weight, cu, want_whole[:, 1], slots)
    out = cpu.causal_conv1d_varlen(x, weight, cu, pool, slots)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want.float(), **(TOL if dtype == torch.float32 else BF16))
    assert torch.equal(whole.isnan(), want_whole.isnan())
    torch.testing.assert_close(whole, want_whole, equal_nan=True, **TOL)  # states are copies: exact


def test_conv_reads_strided_rows_of_its_input():
    mixed = rand(50, 96, seed=1)
    x = mixed[7:40, 8:72]  # rows of a wider projection
    weight, cu = rand(64, 4, seed=2), torch.tensor([0, 10, 33], dtype=torch.int32)
    a, b = rand(3, 64, 3, seed=3), None
    b = a.clone()
    want = ref_varlen.causal_conv1d_varlen(x, weight, cu, a, torch.tensor([2, 0]))
    torch.testing.assert_close(cpu.causal_conv1d_varlen(x, weight, cu, b, torch.tensor([2, 0])), want, **TOL)
    torch.testing.assert_close(b, a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_in_slots_leaves_padding_rows_unwritten(dtype):
    x, weight = rand(4, 40, seed=1, dtype=dtype), rand(40, 4, seed=2)
    whole, pool = layer_pool(5, (40, 3), dtype=dtype)
    slots = torch.tensor([3, -1, 0, 4])
    pool[slots[slots >= 0]] = rand(3, 40, 3, seed=3, dtype=dtype)
    want_whole = whole.clone()
    want = ref_varlen.causal_conv1d_update_slots(x, weight, want_whole[:, 1], slots)
    out = cpu.causal_conv1d_update_slots(x, weight, pool, slots)
    torch.testing.assert_close(out.float(), want.float(), **(TOL if dtype == torch.float32 else BF16))
    torch.testing.assert_close(whole, want_whole, equal_nan=True, **TOL)


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
    want = ref.paged_attention_decode(q, k_cache, v_cache, table, lens, head_dim ** -0.5)
    out = cpu.paged_attention_decode(q, k_cache, v_cache, table, lens, head_dim ** -0.5)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), **tol)


def amx() -> bool:
    return cpu_build.library() and bool(torch.ops.cairn_cpu.amx_available())


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
    got = cpu.paged_attention_prefill(q, k_cache, v_cache, table, cu, lens, 0.125)
    exact = ref.paged_attention_prefill(q.float(), k_cache.float(), v_cache.float(), table, cu, lens, 0.125)
    theirs = ref.paged_attention_prefill(q, k_cache, v_cache, table, cu, lens, 0.125)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    bound = (theirs.float() - exact).abs().max().item()
    assert (got.float() - exact).abs().max().item() <= 1.5 * bound + 1e-3


def test_prefill_attention_at_other_head_dims_runs_the_reference():
    q, k_cache = rand(5, 2, 32, dtype=torch.bfloat16), rand(2, 16, 1, 32, dtype=torch.bfloat16)
    table, cu, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), \
        torch.tensor([20], dtype=torch.int32)
    assert torch.equal(cpu.paged_attention_prefill(q, k_cache, k_cache, table, cu, lens, 0.2),
                       ref.paged_attention_prefill(q, k_cache, k_cache, table, cu, lens, 0.2))


def test_decode_attention_refuses_lengths_past_the_page_table():
    k_cache = torch.zeros(4, 16, 1, 8)
    with pytest.raises(ValueError, match="seq_lens"):
        cpu.paged_attention_decode(torch.zeros(1, 2, 8), k_cache, k_cache.clone(), torch.zeros(1, 2, dtype=torch.int32),
                                   torch.tensor([33], dtype=torch.int32), 1.0)


# ---------------------------------------------------------------- the row-wise ops


def same(got, want, dtype):
    """bf16: bit for bit; fp32: to rounding."""
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(1, 40), (7, 96), (65, 33)])
def test_rms_norm_rounds_as_the_reference_with_and_without_the_residual(dtype, rows, width):
    x, res = rand(rows, width, seed=1, dtype=dtype), rand(rows, width, seed=2, dtype=dtype)
    weight = rand(width, seed=3, dtype=dtype, scale=0.1)
    same(cpu.rms_norm(x, weight, 1e-6), ref_fused.rms_norm(x, weight, 1e-6), dtype)
    y, total = cpu.rms_norm(x, weight, 1e-6, res)
    want_y, want_total = ref_fused.rms_norm(x, weight, 1e-6, res)
    same(y, want_y, dtype)
    same(total, want_total, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_rounds_its_product_as_the_reference(dtype, weight_dtype):
    wide = rand(9, 40, seed=1, dtype=dtype)
    x, gate = wide[:, :20], wide[:, 20:]  # strided rows, as the layer passes them
    weight = rand(20, seed=3, dtype=weight_dtype)
    same(cpu.gated_rms_norm(x, gate, weight, 1e-6), ref_fused.gated_rms_norm(x, gate, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, pairs", [(32, 4), (24, 12), (64, 8)])
def test_qk_norm_rope_rounds_as_the_reference(dtype, head_dim, pairs):
    q = rand(11, 6, 2 * head_dim, seed=1, dtype=dtype)[:, :, :head_dim]  # strided heads
    k = rand(11, 2, head_dim, seed=2, dtype=dtype)
    wq, wk = rand(head_dim, seed=3, dtype=dtype, scale=0.1), rand(head_dim, seed=4, dtype=dtype, scale=0.1)
    positions = torch.tensor([0, 1, 2, 7, 100, 4095, 5, 6, 9, 3000, 12])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 2 * pairs, 2, dtype=torch.float32) / (2 * pairs)))
    got = cpu.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6)
    want = ref_fused.qk_norm_rope(q, k, wq, wk, positions, inv_freq, 1e-6)
    for a, b in zip(got, want):
        if dtype == torch.bfloat16:  # cos and sin by libm here, by torch there: at most a rounding apart
            torch.testing.assert_close(a, b, atol=0, rtol=2 ** -7)
        else:
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_round_as_the_reference(dtype):
    a, b = rand(5, 300, seed=1, dtype=dtype, scale=4), rand(5, 300, seed=2, dtype=dtype, scale=4)
    same(cpu.silu_mul(a, b), ref_fused.silu_mul(a, b), dtype)
    same(cpu.sigmoid_gate(a, b), ref_fused.sigmoid_gate(a, b), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_gates_including_softplus_past_its_threshold(dtype):
    a = torch.tensor([[-30.0, -1.0, 0.0, 19.0], [20.5, 40.0, 3.0, -5.0]]).to(dtype)
    b = rand(2, 4, seed=1, dtype=dtype)
    A_log, dt_bias = rand(4, seed=2), rand(4, seed=3, dtype=dtype)
    g, beta = cpu.delta_gates(a, b, A_log, dt_bias)
    want_g, want_beta = ref_fused.delta_gates(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, want_g, **TOL)
    same(beta, want_beta, dtype)


# ---------------------------------------------------------------- dispatch


def test_cpu_tensors_run_the_kernels_unless_the_references_are_asked_for(monkeypatch):
    x = torch.zeros(2, 4)
    assert kernels._fused_backend(x) is cpu and kernels._backend(x, native=True) is cpu
    assert kernels._backend(x) is ref  # an op without a kernel here
    monkeypatch.setenv("CAIRN_KERNELS", "reference")
    assert kernels._fused_backend(x) is ref_fused and kernels._varlen_backend(x) is ref_varlen
    monkeypatch.delenv("CAIRN_KERNELS")
    kernels.force_reference(True)
    try:
        assert kernels._backend(x, native=True) is ref
    finally:
        kernels.force_reference(False)


def test_without_the_library_an_engine_runs_the_references():
    script = ("import warnings, torch\n"
              "from cairn import kernels\n"
              "from cairn.workers import Engine, SamplingParams\n"
              "from cairn.workers.demo import demo_model_dir\n"
              "e = Engine.from_pretrained(demo_model_dir('tiny', 'qwen3_5'))\n"
              "out = e.generate([[5, 6, 7] * 30], SamplingParams(max_tokens=3, temperature=0))[0]\n"
              "assert kernels._varlen_backend(torch.zeros(1)).__name__ == 'cairn.kernels.reference_varlen'\n"
              "print(len(out.token_ids))\n")
    env = dict(os.environ, CAIRN_NATIVE_CPU="0")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_takes_the_first_maximum_and_refuses_rows_that_are_not_finite(dtype):
    logits = rand(7, 1000, seed=1, dtype=dtype)
    logits[1, 17] = logits[1, 900] = 50.0  # a tie: the first
    logits[2, 999] = 60.0  # in the tail past the last whole vector
    logits[3, 5] = math.nan
    logits[4, 400] = math.inf
    logits[5] = -math.inf
    logits[6, 0] = 70.0
    got = cpu.argmax_rows(logits)
    assert got.tolist() == ref.argmax_rows(logits).tolist()
    assert got.tolist()[1:] == [17, 999, -1, -1, -1, 0]
    narrow = rand(3, 5, seed=2, dtype=dtype)  # shorter than a vector
    assert cpu.argmax_rows(narrow).tolist() == narrow.float().argmax(-1).tolist()



def draws_over(draw_fn, rows: int, grid: int = 1500) -> torch.Tensor:
    """[grid, rows]: the token each row draws at each uniform of a fine grid."""
    return torch.stack([draw_fn(torch.full((rows,), float(u))) for u in torch.linspace(0, 0.9999, grid)])


SAMPLING_ROWS = [  # (temperature, top_k, top_p, min_p): every branch, alone and together
    (1.0, 0, 1.0, 0.0), (0.5, 0, 0.9, 0.0), (1.3, 5, 1.0, 0.0), (0.8, 40, 0.7, 0.0), (1.0, 0, 1.0, 0.3),
    (0.7, 3, 0.5, 0.1), (1.0, 2000, 1.0, 0.0), (1.0, 2000, 0.8, 0.0), (1e-30, 0, 0.9, 0.0)]


@pytest.mark.parametrize("vocab", [1000, 4099])  # a whole number of vectors, and a tail
def test_sampling_draws_from_exactly_the_references_support(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(len(SAMPLING_ROWS), vocab, generator=g) * 3  # distinct values: no ties to break
    x[1, 100:] = -math.inf  # a masked row (a grammar's)
    t, k, p, m = (torch.tensor(c) for c in zip(*SAMPLING_ROWS))
    k = k.long()
    host = (k.tolist(), p.tolist(), m.tolist())
    got = draws_over(lambda u: cpu.sample_rows(x, t, k, p, m, u), len(SAMPLING_ROWS))
    want = draws_over(lambda u: ref_sample.sample_rows(x, t, k, p, m, u, host), len(SAMPLING_ROWS))
    for r in range(len(SAMPLING_ROWS)):
        # the same inverse CDF: the same token at every uniform but where sums in another order
        # move a boundary between two tokens past a grid point
        assert (got[:, r] != want[:, r]).sum() <= 3, (SAMPLING_ROWS[r], (got[:, r] != want[:, r]).sum())
        if SAMPLING_ROWS[r][1] in (3, 5):  # a few tokens, among the k largest
            assert set(got[:, r].tolist()) == set(want[:, r].tolist())
            assert set(got[:, r].tolist()) <= set(torch.topk(x[r], SAMPLING_ROWS[r][1]).indices.tolist())
    assert set(got[:, -1].tolist()) == {int(x[-1].argmax())}  # a temperature too small to divide by is greedy
    assert int(got[:, 1].max()) < 100


def test_sampling_top_k_breaks_ties_to_the_lowest_ids_and_never_draws_a_zero_weight():
    x = torch.zeros(2, 64)
    x[1, 10:] = -math.inf
    k = torch.tensor([5, 20])
    one = torch.ones(2)
    got = draws_over(lambda u: cpu.sample_rows(x, one, k, one, torch.zeros(2), u), 2)
    assert set(got[:, 0].tolist()) == set(range(5)) and set(got[:, 1].tolist()) == set(range(10))


def test_penalties_and_masks_match_their_references():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1003, generator=g) * 4
    counts = torch.randint(0, 3, (4, 1003), generator=g, dtype=torch.int32) * (torch.rand(4, 1003, generator=g) < 0.05)
    prompt = torch.rand(4, 1003, generator=g) < 0.05
    at, rows = torch.tensor([0, 2, 4]), torch.tensor([3, 0, 1])
    values = torch.tensor([[1.3, 0.5, 1.0], [0.7, -1.0, 2.0], [1.0, 0.0, -0.5]])
    mine, theirs = x.clone(), x.clone()
    cpu.penalise_rows(mine, at, rows, counts, prompt, values)
    ref_sample.penalise_rows(theirs, at, rows, counts, prompt, values)
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    words = torch.randint(-2**31, 2**31 - 1, (3, 32), generator=g, dtype=torch.int32)
    words[0] = -1  # everything allowed
    mine, theirs = x.clone(), x.clone()
    cpu.mask_rows(mine, at, words)
    ref_sample.mask_rows(theirs, at, words)
    assert torch.equal(mine, theirs) and torch.equal(mine[0], x[0]) and torch.equal(mine[1], x[1])


# ---------------------------------------------------------------- the engine at serving shapes


@pytest.fixture(scope="module")
def serving_shaped(tmp_path_factory):
    """A Qwen3.5 checkpoint in bf16 with head dims of 64: the shapes whose kernels take the fast
    paths (the tile unit's prefill attention, the delta rule's vector recurrence)."""
    from tests.support.checkpoints import Q35_TEXT, QWEN3_5_CHECKPOINTS, build_hf_checkpoint

    rope = dict(Q35_TEXT["rope_parameters"], mrope_section=[4, 2, 2])
    QWEN3_5_CHECKPOINTS["q35_head64"] = ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        Q35_TEXT, head_dim=64, num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, rope_parameters=rope))
    return build_hf_checkpoint(tmp_path_factory.mktemp("head64"), "q35_head64", dtype=torch.bfloat16)


def test_the_engine_in_bf16_at_serving_shapes_tracks_transformers_in_bf16(serving_shaped):
    from tests.support.checkpoints import hf_reference_model

    from cairn.workers import Engine

    engine = Engine.from_pretrained(serving_shaped, dtype="bfloat16", max_num_batched_tokens=64)  # chunked
    ids = torch.randint(0, engine.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    got = engine.prompt_logits(ids)
    with torch.inference_mode():
        want = hf_reference_model(serving_shaped).to(torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max().item() <= 2 * 2 ** -8 * want.abs().max().item()  # two bf16 roundings


def test_a_resumed_prompt_at_serving_shapes_answers_as_a_cold_one(serving_shaped):
    from cairn.workers import Engine, SamplingParams

    gen = torch.Generator().manual_seed(2)
    first = torch.randint(0, 200, (133,), generator=gen).tolist()
    second = first + torch.randint(0, 200, (50,), generator=gen).tolist()  # the next turn
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    warm = Engine.from_pretrained(serving_shaped, dtype="bfloat16", max_num_batched_tokens=64)
    warm.generate([first], params)
    resumed = warm.generate([second], params)[0]
    cold = Engine.from_pretrained(serving_shaped, dtype="bfloat16", max_num_batched_tokens=64).generate(
        [second], params)[0]
    assert resumed.cached_tokens > 0
    assert resumed.token_ids == cold.token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in resumed.logprobs]),
                               torch.tensor([lp.logprob for lp in cold.logprobs]), atol=0.02, rtol=0)
