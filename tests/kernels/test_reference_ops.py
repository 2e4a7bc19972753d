"""The torch reference ops agree with their own token-by-token forms, with plain attention, and with
transformers' Qwen3-Next implementation, at odd shapes in fp32. Buffers an op writes into start as
NaN, so reading an unwritten slot fails loudly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from cairn.kernels import (
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    copy_state_slots,
    gated_delta_rule_step,
    paged_attention_decode,
    paged_attention_prefill,
    recurrent_gated_delta_rule,
    store_kv,
)

H_K, H_V, D_K, D_V = 2, 6, 24, 20  # more value heads than key heads, odd head dims, D_k != D_v
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(autouse=True)
def the_references():
    """CPU tensors run the C++ kernels where they have one (tests/kernels/test_cpu_kernels.py holds them to
    these references): here, the references themselves."""
    from cairn import kernels
    kernels.force_reference(True)
    yield
    kernels.force_reference(False)


def delta_inputs(length: int, seed: int = 0, heads: tuple[int, int] = (H_K, H_V)):
    """q, k, v, g, beta shaped like one Gated DeltaNet sequence (g: log decay, some near 0, some strong)."""
    gen = torch.Generator().manual_seed(seed)
    h_k, h_v = heads
    q = torch.randn(length, h_k, D_K, generator=gen)
    k = torch.randn(length, h_k, D_K, generator=gen)
    v = torch.randn(length, h_v, D_V, generator=gen)
    g = F.logsigmoid(2 * torch.randn(length, h_v, generator=gen) + 2)
    beta = torch.sigmoid(torch.randn(length, h_v, generator=gen))
    return q, k, v, g, beta


def random_state(*lead: int, seed: int = 1) -> torch.Tensor:
    return 0.5 * torch.randn(*lead, H_V, D_K, D_V, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- gated delta rule


@pytest.mark.parametrize("length", [1, 63, 75, 130])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_delta_rule_equals_its_token_by_token_recurrence(length, chunk_size, with_state):
    q, k, v, g, beta = delta_inputs(length)
    init = random_state() if with_state else None
    out, final, states = chunk_gated_delta_rule(q, k, v, g, beta, init, chunk_size=chunk_size)
    want_out, want_final = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    torch.testing.assert_close(out, want_out, **TOL)
    torch.testing.assert_close(final, want_final, **TOL)
    assert final.dtype == torch.float32 and states.shape == (0, H_V, D_K, D_V)


def test_states_at_requested_positions_equal_the_recurrence_after_that_many_tokens():
    q, k, v, g, beta = delta_inputs(75)
    init = random_state()
    positions = [1, 16, 17, 40, 64, 75]  # on and off the chunk grid, and p == T
    out, final, states = chunk_gated_delta_rule(q, k, v, g, beta, init, chunk_size=16, state_positions=positions)
    assert states.shape == (len(positions), H_V, D_K, D_V)
    for p, state in zip(positions, states):
        _, want = recurrent_gated_delta_rule(q[:p], k[:p], v[:p], g[:p], beta[:p], init)
        torch.testing.assert_close(state, want, **TOL)
    plain_out, plain_final, _ = chunk_gated_delta_rule(q, k, v, g, beta, init, chunk_size=16)
    torch.testing.assert_close(out, plain_out, **TOL)
    torch.testing.assert_close(final, plain_final, **TOL)


@given(data=st.data(), length=st.integers(1, 90), chunk_size=st.integers(1, 70))
@settings(max_examples=20, deadline=None)
def test_any_chunking_and_positions_agree_with_the_recurrence_run_in_segments(data, length, chunk_size):
    positions = sorted(data.draw(st.sets(st.integers(1, length), max_size=4)))
    q, k, v, g, beta = delta_inputs(length, seed=length)
    out, final, states = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size,
                                                state_positions=positions)
    state, start, outs = None, 0, []
    for end in positions + [length]:
        if end == start:
            continue
        part, state = recurrent_gated_delta_rule(q[start:end], k[start:end], v[start:end], g[start:end],
                                                 beta[start:end], state)
        outs.append(part)
        if end in positions:
            torch.testing.assert_close(states[positions.index(end)], state, **TOL)
        start = end
    torch.testing.assert_close(out, torch.cat(outs), **TOL)
    torch.testing.assert_close(final, state, **TOL)


@pytest.mark.parametrize("positions", [[0], [76], [-1], [5, 5], [10, 3]])
def test_state_positions_outside_the_sequence_or_out_of_order_are_refused(positions):
    q, k, v, g, beta = delta_inputs(75)
    with pytest.raises(ValueError, match="expected"):
        chunk_gated_delta_rule(q, k, v, g, beta, state_positions=positions)


@pytest.mark.parametrize("length", [1, 63, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_and_recurrent_forms_match_transformers(length, with_state):
    q, k, v, g, beta = delta_inputs(length, seed=7)
    init = random_state() if with_state else None
    hf_args = [x[None] for x in (q, k, v, g, beta)]
    hf_init = None if init is None else init[None]
    hf_chunk, hf_chunk_final = torch_chunk_gated_delta_rule(
        *hf_args, chunk_size=64, initial_state=hf_init, output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_rec, hf_rec_final = torch_recurrent_gated_delta_rule(
        *hf_args, initial_state=hf_init, output_final_state=True, use_qk_l2norm_in_kernel=True)

    out, final, _ = chunk_gated_delta_rule(q, k, v, g, beta, init)
    torch.testing.assert_close(out, hf_chunk[0], **TOL)
    torch.testing.assert_close(final, hf_chunk_final[0], **TOL)
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, init)
    torch.testing.assert_close(out, hf_rec[0], **TOL)
    torch.testing.assert_close(final, hf_rec_final[0], **TOL)


def test_an_explicit_scale_scales_the_output_and_leaves_the_state_alone():
    q, k, v, g, beta = delta_inputs(20)
    out, final, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    out3, final3, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=3 * D_K ** -0.5)
    torch.testing.assert_close(out3, 3 * out, **TOL)
    torch.testing.assert_close(final3, final, **TOL)


def test_decode_steps_equal_the_recurrence_for_a_batch_of_sequences_with_their_own_states():
    batch, length = 3, 9
    seqs = [delta_inputs(length, seed=10 + b) for b in range(batch)]
    init = random_state(batch)
    state = init.clone()
    stepped = []
    for t in range(length):
        q, k, v, g, beta = (torch.stack([s[i][t] for s in seqs]) for i in range(5))
        stepped.append(gated_delta_rule_step(q, k, v, g, beta, state))
    stepped = torch.stack(stepped, dim=1)  # [B, T, H_v, D_v]
    for b, (q, k, v, g, beta) in enumerate(seqs):
        want_out, want_final = recurrent_gated_delta_rule(q, k, v, g, beta, init[b])
        torch.testing.assert_close(stepped[b], want_out, **TOL)
        torch.testing.assert_close(state[b], want_final, **TOL)


def test_outputs_come_back_in_the_value_dtype_and_states_stay_fp32():
    q, k, v, g, beta = (x.bfloat16() for x in delta_inputs(10))
    out, final, states = chunk_gated_delta_rule(q, k, v, g, beta, state_positions=[5])
    assert out.dtype == torch.bfloat16 and final.dtype == states.dtype == torch.float32
    assert recurrent_gated_delta_rule(q, k, v, g, beta)[0].dtype == torch.bfloat16


# ---------------------------------------------------------------- causal conv1d

CHANNELS, WIDTH = 10, 4


def conv_inputs(length: int, seed: int = 0, lead: tuple[int, ...] = ()):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, length, CHANNELS, generator=gen), torch.randn(CHANNELS, WIDTH, generator=gen)


@pytest.mark.parametrize("length", [1, 2, 75])
def test_conv_on_a_fresh_sequence_equals_transformers_and_keeps_the_last_inputs_as_state(length):
    x, weight = conv_inputs(length)
    out, state = causal_conv1d(x, weight, None)
    want = causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    torch.testing.assert_close(out, want, **TOL)
    padded = torch.cat((torch.zeros(CHANNELS, WIDTH - 1), x.t()), dim=1)
    assert state.dtype == torch.float32
    torch.testing.assert_close(state, padded[:, -(WIDTH - 1):], atol=0, rtol=0)


@pytest.mark.parametrize("split", [1, 2, 40, 74])
def test_splitting_a_sequence_in_two_calls_with_the_carried_state_equals_one_call(split):
    x, weight = conv_inputs(75)
    whole, whole_state = causal_conv1d(x, weight, None)
    first, state = causal_conv1d(x[:split], weight, None)
    second, state = causal_conv1d(x[split:], weight, state)
    torch.testing.assert_close(torch.cat((first, second)), whole, **TOL)
    torch.testing.assert_close(state, whole_state, atol=0, rtol=0)


def test_conv_update_token_by_token_equals_causal_conv1d_for_a_batch_with_their_own_states():
    batch, length = 3, 7
    x, weight = conv_inputs(length, lead=(batch,))
    init = torch.randn(batch, CHANNELS, WIDTH - 1)
    state = init.clone()
    stepped = torch.stack([causal_conv1d_update(x[:, t], weight, state) for t in range(length)], dim=1)
    for b in range(batch):
        want_out, want_state = causal_conv1d(x[b], weight, init[b])
        torch.testing.assert_close(stepped[b], want_out, **TOL)
        torch.testing.assert_close(state[b], want_state, atol=0, rtol=0)


def test_conv_output_follows_x_dtype_and_state_follows_the_state_dtype():
    x, weight = conv_inputs(5)
    out, state = causal_conv1d(x.bfloat16(), weight, torch.zeros(CHANNELS, WIDTH - 1, dtype=torch.float64))
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float64


# ---------------------------------------------------------------- paged KV and attention

PAGE, NUM_PAGES, H_Q, H_KV, D = 8, 40, 6, 2, 12
GARBAGE = [-1, 2**30, 39]  # past a sequence's pages: negative, out of range, an unused NaN page


def nan_caches(dtype=torch.float32):
    shape = (NUM_PAGES, PAGE, H_KV, D)
    return torch.full(shape, math.nan, dtype=dtype), torch.full(shape, math.nan, dtype=dtype)


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


def test_bf16_prefill_on_cpu_is_the_fp32_attention_to_bf16_accuracy():
    """The CPU's one exception to fp32 math: bf16 caches and queries attend in bf16 (oneDNN's
    flash kernel), over a cached prefix and the new tokens, as close to fp32 as bf16 allows."""
    query, k_cache, v_cache, table, cu, lens, _ = paged_batch(BATCH)
    query, k_cache, v_cache = (x.bfloat16() for x in (query, k_cache, v_cache))
    out = paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    want = paged_attention_prefill(query.float(), k_cache.float(), v_cache.float(), table, cu, lens, SCALE)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_decode_equals_the_prefill_output_of_each_sequence_last_token():
    query, k_cache, v_cache, table, cu, lens, _ = paged_batch(BATCH)
    prefill = paged_attention_prefill(query, k_cache, v_cache, table, cu, lens, SCALE)
    last = (cu[1:] - 1).long()
    out = paged_attention_decode(query[last], k_cache, v_cache, table, lens, SCALE)
    torch.testing.assert_close(out, prefill[last], **TOL)


# ---------------------------------------------------------------- state slots


def test_copy_state_slots_copies_whole_slots_and_leaves_the_others_untouched():
    conv, ssm = torch.randn(6, 3, 5), torch.randn(6, 2, 3, 4)
    before = [conv.clone(), ssm.clone()]
    copy_state_slots([conv, ssm], torch.tensor([1, 4]), torch.tensor([3, 0]))
    for pool, old in zip((conv, ssm), before):
        assert torch.equal(pool[3], old[1]) and torch.equal(pool[0], old[4])
        assert torch.equal(pool[[1, 2, 4, 5]], old[[1, 2, 4, 5]])


# ---------------------------------------------------------------- validation


def _bad_calls():
    q, k, v, g, beta = delta_inputs(4)
    x, weight = conv_inputs(4)
    k_cache, v_cache = nan_caches()
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    kv = torch.randn(2, H_KV, D)
    return {
        "key head dim": lambda: store_kv(torch.randn(2, H_KV, D + 1), kv, k_cache, v_cache, torch.tensor([0, 1])),
        "int32 slots": lambda: store_kv(kv, kv, k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32)),
        "query heads": lambda: paged_attention_prefill(torch.randn(2, 5, D), k_cache, v_cache, table, cu, lens, 1.0),
        "int64 table": lambda: paged_attention_prefill(torch.randn(2, H_Q, D), k_cache, v_cache, table.long(), cu,
                                                       lens, 1.0),
        "cu_seqlens end": lambda: paged_attention_prefill(torch.randn(3, H_Q, D), k_cache, v_cache, table, cu, lens,
                                                          1.0),
        "decode seq_lens": lambda: paged_attention_decode(torch.randn(2, H_Q, D), k_cache, v_cache, table, lens[:1],
                                                          1.0),
        "conv state width": lambda: causal_conv1d(x, weight, torch.zeros(CHANNELS, WIDTH)),
        "conv update channels": lambda: causal_conv1d_update(torch.randn(2, CHANNELS + 1), weight,
                                                             torch.zeros(2, CHANNELS, WIDTH - 1)),
        "value heads": lambda: chunk_gated_delta_rule(q, k, torch.randn(4, 3, D_V), g[:, :3], beta[:, :3]),
        "initial state": lambda: chunk_gated_delta_rule(q, k, v, g, beta, torch.zeros(H_V, D_V, D_K)),
        "empty sequence": lambda: chunk_gated_delta_rule(q[:0], k[:0], v[:0], g[:0], beta[:0]),
        "fp64 step state": lambda: gated_delta_rule_step(q, k, v, g, beta, random_state(4).double()),
        "slot lengths": lambda: copy_state_slots([torch.zeros(4, 2)], torch.tensor([0, 1]), torch.tensor([2])),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_invalid_shapes_and_dtypes_are_refused_with_what_was_expected(case):
    with pytest.raises(ValueError, match="expected"):
        _bad_calls()[case]()
