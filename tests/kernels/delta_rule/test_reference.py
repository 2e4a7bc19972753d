"""The reference of the gated delta rule (cairn/kernels/delta_rule/reference.py, the contract every
implementation is held to) against its token-by-token recurrence and transformers' Qwen3-Next implementation, at odd shapes in fp32. Buffers an op writes into start as NaN,
so reading an unwritten slot fails loudly. The ops run through `cairn.kernels` with the references
forced.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from cairn.kernels import (
    chunk_gated_delta_rule,
    gated_delta_rule_step,
    recurrent_gated_delta_rule,
)
from tests.kernels.conventions import TOL

H_K, H_V, D_K, D_V = 2, 6, 24, 20  # more value heads than key heads, odd head dims, D_k != D_v


pytestmark = pytest.mark.usefixtures("the_references")


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

