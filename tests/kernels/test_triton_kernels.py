"""Every Triton kernel agrees with the torch reference, interpreted on CPU (conftest sets
TRITON_INTERPRET=1 before triton is imported), in fp32 at small, deliberately odd shapes: T = 1,
63, 75; head dims that are not powers of two; more value heads than key heads; varlen batches
checked against a per-sequence loop. Every buffer a launcher allocates starts as NaN, and so do
caches and state slots nobody should read, so a kernel that reads unwritten memory, or leaves part
of its output unwritten, fails."""

from __future__ import annotations

import importlib
import math
import os
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.interpreter import InterpretedFunction

from cairn import kernels
from cairn.kernels import reference, reference_fused, reference_varlen, triton_common
from cairn.kernels import triton_attention as attention
from cairn.kernels import triton_conv as conv
from cairn.kernels import triton_delta_recurrent as recurrent
from cairn.kernels import triton_delta_rule as delta
from cairn.kernels import triton_state as state

OUT_TOL = dict(atol=2e-5, rtol=1e-4)  # outputs: one pass of fp32 math
STATE_TOL = dict(atol=5e-5, rtol=2e-4)  # recurrent states: error accumulates over the chunks
EXACT = dict(atol=0, rtol=0)  # copies: stored values, conv windows, slots

pytestmark = pytest.mark.skipif(not triton_common.INTERPRETED,
                                reason="needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")


@pytest.fixture(autouse=True)
def nan_filled_buffers(monkeypatch):
    monkeypatch.setattr(triton_common, "FILL", math.nan)


def test_the_kernels_under_test_are_interpreted():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for kernel in (attention._prefill_kernel, delta._chunk_scan_kernel, conv._conv_fwd_kernel):
        kernel = getattr(kernel, "kernel", kernel)  # an autotuned kernel runs its first config, fixed
        assert isinstance(kernel, InterpretedFunction)


# ---------------------------------------------------------------- paged KV and attention

PAGE, NUM_PAGES, H_Q, H_KV, D = 8, 40, 6, 2, 12  # D = 12: not a power of two
GARBAGE = [-1, 2**30, NUM_PAGES - 1]  # table entries past a sequence: negative, out of range, a NaN page


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
        reference.store_kv(torch.randn(total, H_KV, D, generator=gen), torch.randn(total, H_KV, D, generator=gen),
                           k_cache, v_cache, slots)
        queries.append(torch.randn(new, H_Q, D, generator=gen))
    cu = torch.tensor([0] + [n for _, n in cached_and_new]).cumsum(0).to(torch.int32)
    lens = torch.tensor([c + n for c, n in cached_and_new], dtype=torch.int32)
    return torch.cat(queries), k_cache, v_cache, table.to(torch.int32), cu, lens


# cached prefix, new tokens: empty prefixes, single tokens, a prefix past one key block (64), a
# prompt past one query block (64)
BATCH = [(0, 13), (9, 1), (16, 7), (0, 1), (70, 5), (0, 75)]
SCALE = D ** -0.5


def test_store_kv_writes_exactly_the_mapped_slots_and_skips_negative_ones():
    key, value = torch.randn(7, H_KV, D), torch.randn(7, H_KV, D)
    slots = torch.tensor([13, -1, 0, 7, -5, 319, 200])
    got, want = nan_caches(), nan_caches()
    attention.store_kv(key, value, *got, slots)
    reference.store_kv(key, value, *want, slots)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, **EXACT)


def test_prefill_equals_the_reference_and_each_sequence_alone():
    query, k_cache, v_cache, table, cu, lens = paged_batch(BATCH)
    out = attention.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    want = reference.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    torch.testing.assert_close(out, want, **OUT_TOL)
    for b in (1, 4, 5):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = attention.paged_attention_prefill(query[rows], k_cache, v_cache, table[b:b + 1],
                                                  torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
                                                  lens[b:b + 1], SCALE)
        torch.testing.assert_close(alone, out[rows], **OUT_TOL)


def test_decode_equals_the_reference_and_the_last_prefill_row_across_splits():
    query, k_cache, v_cache, table, cu, lens = paged_batch(BATCH, seed=1)
    last = (cu[1:] - 1).long()
    out = attention.paged_attention_decode(query[last], k_cache, v_cache, table, lens, SCALE)
    torch.testing.assert_close(out, reference.paged_attention_decode(query[last], k_cache, v_cache, table, lens,
                                                                     SCALE), **OUT_TOL)
    prefill = attention.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    torch.testing.assert_close(out, prefill[last], **OUT_TOL)


def arena_views(k_cache: torch.Tensor, v_cache: torch.Tensor, layers: int = 3, layer: int = 1):
    """The caches as the engine lays them: one NaN arena block per page holding every layer's K
    and V, each layer's cache a view whose pages are strided by a block."""
    arena = torch.full((NUM_PAGES, layers, 2, PAGE, H_KV, D), math.nan)
    k, v = arena[:, layer, 0], arena[:, layer, 1]
    k.copy_(k_cache)
    v.copy_(v_cache)
    return arena, k, v


def test_attention_over_strided_arena_pages_equals_contiguous_caches():
    query, k_cache, v_cache, table, cu, lens = paged_batch(BATCH, seed=2)
    arena, k, v = arena_views(k_cache, v_cache)
    assert not k.is_contiguous()
    torch.testing.assert_close(attention.paged_attention_prefill(query, k, v, table, cu, lens, SCALE),
                               reference.paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE),
                               **OUT_TOL)
    last = (cu[1:] - 1).long()
    torch.testing.assert_close(attention.paged_attention_decode(query[last], k, v, table, lens, SCALE),
                               reference.paged_attention_decode(query[last], k_cache, v_cache, table, lens, SCALE),
                               **OUT_TOL)
    key, value = torch.randn(5, H_KV, D), torch.randn(5, H_KV, D)
    slots = torch.tensor([13, -1, 0, 7, 319])
    reference.store_kv(key, value, k_cache, v_cache, slots)
    before = arena.clone()
    attention.store_kv(key, value, k, v, slots)
    torch.testing.assert_close(k, k_cache, equal_nan=True, **EXACT)
    torch.testing.assert_close(v, v_cache, equal_nan=True, **EXACT)
    others = torch.ones(arena.shape[1], dtype=torch.bool)
    others[1] = False
    torch.testing.assert_close(arena[:, others], before[:, others], equal_nan=True, **EXACT)  # other layers untouched


# ---------------------------------------------------------------- causal conv1d

CHANNELS, WIDTH = 10, 4


def conv_weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(CHANNELS, WIDTH, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [1, 2, 63, 75])
@pytest.mark.parametrize("with_state", [False, True])
def test_conv_equals_the_reference_output_and_new_state(length, with_state):
    x, weight = torch.randn(length, CHANNELS), conv_weight()
    init = torch.randn(CHANNELS, WIDTH - 1) if with_state else None
    out, new_state = conv.causal_conv1d(x, weight, init)
    want_out, want_state = reference.causal_conv1d(x, weight, init)
    torch.testing.assert_close(out, want_out, **OUT_TOL)
    torch.testing.assert_close(new_state, want_state, **EXACT)


def nan_pool(*inner: int, slots: int = 7, layers: int = 2, layer: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool [slots, layers, *inner] of NaN, its per-layer view [slots, *inner]: strided, like the engine's)."""
    pool = torch.full((slots, layers, *inner), math.nan)
    return pool, pool[:, layer]


def test_conv_varlen_equals_a_per_sequence_loop_and_leaves_other_slots_alone():
    lengths, used = [75, 1, 2, 0, 5], [5, 0, 3, 6, 2]
    x, weight = torch.randn(sum(lengths), CHANNELS), conv_weight(1)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    pool, view = nan_pool(CHANNELS, WIDTH - 1)
    view[used] = torch.randn(len(used), CHANNELS, WIDTH - 1)
    want_pool = pool.clone()
    slots = torch.tensor(used)
    out = conv.causal_conv1d_varlen(x, weight, cu, view, slots)
    want = reference_varlen.causal_conv1d_varlen(x, weight, cu, want_pool[:, 1], slots)
    torch.testing.assert_close(out, want, **OUT_TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **EXACT)


def test_conv_update_equals_the_reference_in_a_batch_and_in_slots():
    x, weight = torch.randn(3, CHANNELS), conv_weight(2)
    init = torch.randn(3, CHANNELS, WIDTH - 1)
    got_state, want_state = init.clone(), init.clone()
    out = conv.causal_conv1d_update(x, weight, got_state)
    torch.testing.assert_close(out, reference.causal_conv1d_update(x, weight, want_state), **OUT_TOL)
    torch.testing.assert_close(got_state, want_state, **EXACT)

    pool, view = nan_pool(CHANNELS, WIDTH - 1)
    slots = torch.tensor([4, 1, 6])
    view[slots] = init
    want_pool = pool.clone()
    out = conv.causal_conv1d_update_slots(x, weight, view, slots)
    want = reference_varlen.causal_conv1d_update_slots(x, weight, want_pool[:, 1], slots)
    torch.testing.assert_close(out, want, **OUT_TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **EXACT)


# ---------------------------------------------------------------- gated delta rule

H_K, H_V, D_K, D_V = 2, 6, 24, 20  # more value heads than key heads, head dims not powers of two


def delta_inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, H_K, D_K, generator=gen)
    k = torch.randn(length, H_K, D_K, generator=gen)
    v = torch.randn(length, H_V, D_V, generator=gen)
    g = F.logsigmoid(2 * torch.randn(length, H_V, generator=gen) + 2)  # log decay: some near 0, some strong
    beta = torch.sigmoid(torch.randn(length, H_V, generator=gen))
    return q, k, v, g, beta


def random_states(*lead: int, seed: int = 1) -> torch.Tensor:
    return 0.5 * torch.randn(*lead, H_V, D_K, D_V, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("length", [1, 63, 75])
def test_chunked_delta_rule_equals_the_reference_with_states_at_any_positions(length):
    q, k, v, g, beta = delta_inputs(length)
    init = random_states()
    positions = [p for p in (1, 16, 17, 40, 64, 75) if p <= length]  # on and off page and chunk bounds
    out, final, states = delta.chunk_gated_delta_rule(q, k, v, g, beta, init, state_positions=positions)
    want_out, want_final, want_states = reference.chunk_gated_delta_rule(q, k, v, g, beta, init,
                                                                         state_positions=positions)
    torch.testing.assert_close(out, want_out, **OUT_TOL)
    torch.testing.assert_close(final, want_final, **STATE_TOL)
    torch.testing.assert_close(states, want_states, **STATE_TOL)
    assert final.dtype == states.dtype == torch.float32


def test_chunked_delta_rule_from_zeros_without_l2_norm_and_with_a_scale():
    q, k, v, g, beta = delta_inputs(40, seed=3)
    q, k = 0.3 * q, 0.3 * k  # unnormalised keys: keep the recurrence stable
    got = delta.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.7, use_qk_l2norm=False)
    want = reference.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.7, use_qk_l2norm=False)
    torch.testing.assert_close(got[0], want[0], **OUT_TOL)
    torch.testing.assert_close(got[1], want[1], **STATE_TOL)


def test_varlen_delta_rule_equals_a_per_sequence_loop_over_state_slots():
    lengths, used = [75, 1, 0, 33], [5, 0, 3, 6]
    positions = [[16, 64, 75], [1], [], [5, 32]]
    q, k, v, g, beta = delta_inputs(sum(lengths), seed=4)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    pool, view = nan_pool(H_V, D_K, D_V, layer=0)
    view[used] = random_states(len(used))
    want_pool = pool.clone()
    slots = torch.tensor(used)
    out, states = delta.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, view, slots, state_positions=positions)
    want_out, want_states = reference_varlen.chunk_gated_delta_rule_varlen(
        q, k, v, g, beta, cu, want_pool[:, 0], slots, state_positions=positions)
    torch.testing.assert_close(out, want_out, **OUT_TOL)
    torch.testing.assert_close(states, want_states, **STATE_TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **STATE_TOL)


def test_recurrent_delta_rule_equals_the_reference(monkeypatch):
    monkeypatch.setitem(recurrent.TUNE, "step_bv", 32)  # one value block per head: fewer interpreted programs
    q, k, v, g, beta = delta_inputs(20, seed=5)
    init = random_states()
    out, final = recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, init)
    want_out, want_final = reference.recurrent_gated_delta_rule(q, k, v, g, beta, init)
    torch.testing.assert_close(out, want_out, **OUT_TOL)
    torch.testing.assert_close(final, want_final, **STATE_TOL)


def test_decode_steps_update_states_in_place_in_a_batch_and_in_slots():
    q, k, v, g, beta = delta_inputs(3, seed=6)  # three sequences, one token each
    init = random_states(3)
    got, want = init.clone(), init.clone()
    out = recurrent.gated_delta_rule_step(q, k, v, g, beta, got)
    torch.testing.assert_close(out, reference.gated_delta_rule_step(q, k, v, g, beta, want), **OUT_TOL)
    torch.testing.assert_close(got, want, **STATE_TOL)

    pool, view = nan_pool(H_V, D_K, D_V)
    slots = torch.tensor([2, 6, 0])
    view[slots] = init
    want_pool = pool.clone()
    out = recurrent.gated_delta_rule_step_slots(q, k, v, g, beta, view, slots)
    want = reference_varlen.gated_delta_rule_step_slots(q, k, v, g, beta, want_pool[:, 1], slots)
    torch.testing.assert_close(out, want, **OUT_TOL)
    torch.testing.assert_close(pool, want_pool, equal_nan=True, **STATE_TOL)


# ---------------------------------------------------------------- state slots


def test_copy_state_slots_copies_whole_slots_of_every_pool_in_one_call():
    conv_pool, ssm_pool = torch.randn(6, 2, 3, 5), torch.randn(6, 2, 3, 4, 7)
    pools = [conv_pool, ssm_pool, ssm_pool[:, 1]]  # whole pools and a strided per-layer view
    want = [p.clone() for p in (conv_pool, ssm_pool)]
    src, dst = torch.tensor([1, 4, 2]), torch.tensor([3, 0, 5])
    state.copy_state_slots(pools, src, dst)
    reference.copy_state_slots([want[0], want[1], want[1][:, 1]], src, dst)
    torch.testing.assert_close(conv_pool, want[0], **EXACT)
    torch.testing.assert_close(ssm_pool, want[1], **EXACT)


# ---------------------------------------------------------------- validation and dispatch


def _bad_calls():
    q, k, v, g, beta = delta_inputs(4)
    k_cache, v_cache = nan_caches()
    kv = torch.randn(2, H_KV, D)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    return {
        "int32 slots": lambda: attention.store_kv(kv, kv, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32)),
        "query heads": lambda: attention.paged_attention_decode(torch.randn(1, 5, D), k_cache, v_cache,
                                                                torch.zeros(1, 2, dtype=torch.int32),
                                                                torch.ones(1, dtype=torch.int32), 1.0),
        "conv state width": lambda: conv.causal_conv1d(torch.randn(3, CHANNELS), conv_weight(),
                                                       torch.zeros(CHANNELS, WIDTH)),
        "value heads": lambda: delta.chunk_gated_delta_rule(q, k, v[:, :3], g[:, :3], beta[:, :3]),
        "position past the end": lambda: delta.chunk_gated_delta_rule(q, k, v, g, beta, state_positions=[5]),
        "cu_seqlens end": lambda: delta.chunk_gated_delta_rule_varlen(
            q, k, v, g, beta, torch.tensor([0, 3], dtype=torch.int32), random_states(1), torch.tensor([0])),
        "fp64 pool": lambda: delta.chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu, random_states(1).double(),
                                                                 torch.tensor([0])),
        "strided step state": lambda: recurrent.gated_delta_rule_step(q, k, v, g, beta,
                                                                      random_states(4, 2)[:, 0]),
        "slot lengths": lambda: state.copy_state_slots([torch.zeros(4, 2)], torch.tensor([0, 1]), torch.tensor([2])),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_invalid_shapes_and_dtypes_are_refused_with_what_was_expected(case):
    with pytest.raises(ValueError, match="expected"):
        _bad_calls()[case]()


def test_cuda_tensors_dispatch_to_triton_unless_the_reference_is_forced(monkeypatch):
    gpu = ModuleType("cairn.kernels.gpu")  # the real one refuses to load in this interpreted process
    monkeypatch.setitem(sys.modules, "cairn.kernels.gpu", gpu)
    monkeypatch.setattr(triton_common, "INTERPRETED", False)  # as in a process running compiled Triton
    cuda_like = SimpleNamespace(is_cuda=True)
    monkeypatch.delenv("CAIRN_KERNELS", raising=False)
    from cairn.kernels import cpu, cpu_build

    assert kernels._backend(torch.zeros(1)) is reference  # CPU tensors: the C++ kernels where an op has one
    assert kernels._varlen_backend(torch.zeros(1)) is (cpu if cpu_build.library() else reference_varlen)
    assert kernels._backend(cuda_like) is gpu and kernels._varlen_backend(cuda_like) is gpu
    monkeypatch.setenv("CAIRN_KERNELS", "reference")
    assert kernels._backend(cuda_like) is reference
    monkeypatch.delenv("CAIRN_KERNELS")
    kernels.force_reference(True)
    try:
        assert kernels._backend(cuda_like) is reference
    finally:
        kernels.force_reference(False)
    assert kernels._backend(cuda_like) is gpu


def test_cuda_tensors_run_the_reference_with_one_warning_in_an_interpreted_process(monkeypatch):
    monkeypatch.setattr(kernels, "_warned_interpreted", False)
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET"):
        assert kernels._backend(SimpleNamespace(is_cuda=True)) is reference
    assert kernels._warned_interpreted


def test_the_compiled_backend_refuses_to_load_in_an_interpreted_process(monkeypatch):
    monkeypatch.delitem(sys.modules, "cairn.kernels.gpu", raising=False)
    with pytest.raises(ImportError, match="TRITON_INTERPRET"):
        importlib.import_module("cairn.kernels.gpu")


def test_the_engine_running_the_triton_kernels_gives_the_reference_paths_tokens(monkeypatch, tiny_model_dir):
    """Interpreted kernels behind the real dispatch: the engine's strided views, checkpoints taken
    at page boundaries inside prefill segments, restores and decode steps, all through Triton."""
    from cairn.workers import Engine, SamplingParams

    triton_ops = SimpleNamespace(**{name: getattr(module, name) for module in (attention, conv, delta, recurrent, state)
                                    for name in dir(module) if not name.startswith("_")},
                                 argmax_rows=reference.argmax_rows)  # torch's own on a GPU too
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    first = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (150, 37, 1)]
    results = []
    for backend, varlen in ((reference, reference_varlen), (triton_ops, triton_ops)):
        monkeypatch.setattr(kernels, "_backend", lambda tensor, native=False, backend=backend: backend)
        monkeypatch.setattr(kernels, "_varlen_backend", lambda tensor, varlen=varlen: varlen)
        monkeypatch.setattr(kernels, "_fused_backend", lambda tensor: reference_fused)
        engine = Engine.from_pretrained(tiny_model_dir, device="cpu", page_size=16, num_pages=96, max_num_seqs=3,
                                        max_num_batched_tokens=96)
        turn1 = engine.generate(first, params)
        turn2 = engine.generate([p + o.token_ids[:3] + [7, 8] for p, o in zip(first, turn1)], params)
        results.append([(o.token_ids, o.cached_tokens) for o in turn1 + turn2])
    assert results[1] == results[0]
    assert any(cached for _, cached in results[0][len(first):])  # the second turns resumed


def test_decode_state_ops_treat_slot_minus_one_as_a_padding_row_like_the_reference():
    """A decode graph's padding rows carry state slot -1: zeros in, nothing written (the slot
    before it, the pool's last, is untouched too)."""
    g = torch.Generator().manual_seed(4)
    slots = torch.tensor([1, -1, 0], dtype=torch.int64)
    x, w = torch.randn(3, 6, generator=g), torch.randn(6, 4, generator=g)
    first = torch.randn(3, 6, 3, generator=g)
    pools = {name: first.clone() for name in ("triton", "reference")}
    outs = {"triton": conv.causal_conv1d_update_slots(x, w, pools["triton"], slots),
            "reference": reference_varlen.causal_conv1d_update_slots(x, w, pools["reference"], slots)}
    torch.testing.assert_close(outs["triton"], outs["reference"], **OUT_TOL)
    torch.testing.assert_close(pools["triton"], pools["reference"], **EXACT)
    assert torch.equal(pools["triton"][2], first[2])
    q, k = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    v, gate, beta = torch.randn(3, 4, 8, generator=g), -torch.rand(3, 4, generator=g), torch.rand(3, 4, generator=g)
    start = torch.randn(3, 4, 8, 8, generator=g)
    ssm = {name: start.clone() for name in ("triton", "reference")}
    got = recurrent.gated_delta_rule_step_slots(q, k, v, gate, beta, ssm["triton"], slots)
    want = reference_varlen.gated_delta_rule_step_slots(q, k, v, gate, beta, ssm["reference"], slots)
    torch.testing.assert_close(got, want, **OUT_TOL)
    torch.testing.assert_close(ssm["triton"], ssm["reference"], **STATE_TOL)
    assert torch.equal(ssm["triton"][2], start[2])  # the last slot, which -1 would wrap to
