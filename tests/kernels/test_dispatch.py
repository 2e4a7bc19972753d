"""Which implementation runs where (cairn/kernels/common/dispatch.py): CUDA tensors the Triton
modules (sampling: torch ops), unless the references are forced, and the references with one
warning in a process whose triton is interpreted; an engine whose CPU tensors are routed as CUDA's
runs the interpreted Triton kernels behind the real dispatch and gives the references' tokens;
the decode state ops' padding rows (slot -1).
"""

from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from cairn import kernels
from cairn.kernels import attention, conv, delta_rule, moe, norms, sample, state
from cairn.kernels.attention import triton_ops as attention_triton
from cairn.kernels.common import dispatch, triton_helpers
from cairn.kernels.common.dispatch import Ops
from cairn.kernels.conv import reference as conv_ref
from cairn.kernels.conv import triton_ops as conv_triton
from cairn.kernels.delta_rule import reference as delta_rule_ref
from cairn.kernels.delta_rule import triton_chunk as delta_rule_chunk
from cairn.kernels.delta_rule import triton_recurrent as delta_rule_recurrent
from tests.kernels.conventions import EXACT, STATE_TOL, TOL, triton_interpreted

pytestmark = [triton_interpreted, pytest.mark.usefixtures("nan_filled_buffers")]


def test_the_kernels_under_test_are_interpreted():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for kernel in (attention_triton._prefill_kernel, delta_rule_chunk._chunk_scan_kernel, conv_triton._conv_fwd_kernel):
        kernel = getattr(kernel, "kernel", kernel)  # an autotuned kernel runs its first config, fixed
        assert isinstance(kernel, InterpretedFunction)


CUDA_LIKE = SimpleNamespace(device=SimpleNamespace(type="cuda"))  # what a pick reads of a tensor


@pytest.fixture(autouse=True)
def fresh_picks():
    dispatch.forget()
    yield
    dispatch.forget()


def implementation(package, op: str, tensor) -> str:
    return package.OPS.pick(op, tensor).__module__.removeprefix("cairn.kernels.")


def test_cuda_tensors_dispatch_to_triton_unless_the_reference_is_forced(monkeypatch):
    monkeypatch.setattr(triton_helpers, "INTERPRETED", False)  # as in a process running compiled Triton
    monkeypatch.delenv("CAIRN_KERNELS", raising=False)
    assert [implementation(attention, "paged_attention_decode", CUDA_LIKE),
            implementation(delta_rule, "chunk_gated_delta_rule_varlen", CUDA_LIKE),
            implementation(delta_rule, "gated_delta_rule_step_slots", CUDA_LIKE),
            implementation(moe, "fused_moe", CUDA_LIKE), implementation(norms, "rms_norm", CUDA_LIKE),
            implementation(state, "copy_state_slots", CUDA_LIKE), implementation(sample, "sample_rows", CUDA_LIKE)] \
        == ["attention.triton_ops", "delta_rule.triton_chunk", "delta_rule.triton_recurrent", "moe.triton_ops",
            "norms.triton_ops", "state.triton_ops", "sample.torch_ops"]
    monkeypatch.setenv("CAIRN_KERNELS", "reference")
    assert implementation(attention, "store_kv", CUDA_LIKE) == "attention.reference"
    monkeypatch.delenv("CAIRN_KERNELS")
    kernels.force_reference(True)
    try:
        assert implementation(moe, "fused_moe", CUDA_LIKE) == "moe.reference"
    finally:
        kernels.force_reference(False)
    assert implementation(moe, "fused_moe", CUDA_LIKE) == "moe.triton_ops"


def test_cuda_tensors_run_the_reference_with_one_warning_in_an_interpreted_process(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_interpreted", False)
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET"):
        assert implementation(conv, "causal_conv1d_varlen", CUDA_LIKE) == "conv.reference"
    assert dispatch._warned_interpreted


def test_the_engine_running_the_triton_kernels_gives_the_reference_paths_tokens(monkeypatch, tiny_model_dir):
    """Interpreted kernels behind the real dispatch (CPU tensors routed as CUDA's): the engine's
    strided views, checkpoints taken at page boundaries inside prefill segments, restores and
    decode steps, all through Triton; the row ops and the experts stay on their references (too
    slow interpreted; tests/kernels/norms and moe hold them to it)."""
    from cairn.workers import Engine, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    first = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (150, 37, 1)]
    results = []
    for triton in (False, True):
        with contextlib.ExitStack() as stack:
            if triton:
                monkeypatch.setattr(dispatch, "triton_compiled", lambda: True)
                for package in (norms, moe):
                    monkeypatch.setattr(package, "OPS", Ops(cuda=(), cpu=(), fallback=package.OPS.fallback))
                stack.enter_context(dispatch.routed_as("cuda"))
            else:
                kernels.force_reference(True)
                stack.callback(kernels.force_reference, False)
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
    outs = {"triton": conv_triton.causal_conv1d_update_slots(x, w, pools["triton"], slots),
            "reference": conv_ref.causal_conv1d_update_slots(x, w, pools["reference"], slots)}
    torch.testing.assert_close(outs["triton"], outs["reference"], **TOL)
    torch.testing.assert_close(pools["triton"], pools["reference"], **EXACT)
    assert torch.equal(pools["triton"][2], first[2])
    q, k = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    v, gate, beta = torch.randn(3, 4, 8, generator=g), -torch.rand(3, 4, generator=g), torch.rand(3, 4, generator=g)
    start = torch.randn(3, 4, 8, 8, generator=g)
    ssm = {name: start.clone() for name in ("triton", "reference")}
    got = delta_rule_recurrent.gated_delta_rule_step_slots(q, k, v, gate, beta, ssm["triton"], slots)
    want = delta_rule_ref.gated_delta_rule_step_slots(q, k, v, gate, beta, ssm["reference"], slots)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(ssm["triton"], ssm["reference"], **STATE_TOL)
    assert torch.equal(ssm["triton"][2], start[2])  # the last slot, which -1 would wrap to

