"""The C++ library on a CPU (cairn/kernels/common/native.py) and what runs with it: it builds
where a compiler is; CPU tensors run the C++ kernels, or the torch ops where torch is the chosen
implementation, and the references only when forced; an engine of every family runs no reference
at all; at serving shapes (bf16, head dims of 64) an engine tracks transformers in bf16 and a
resumed prompt answers as a cold one; without the library an engine runs the fallbacks.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from cairn.kernels import attention, conv, delta_rule, moe, norms, sample, state
from cairn.kernels.common import dispatch, native
from tests.kernels.conventions import needs_compiler
from tests.support.paths import REPO

pytestmark = needs_compiler


ROOT = REPO


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


def implementation(package, op: str, tensor) -> str:
    """The module that runs `op` of an op package (`cairn.kernels.<package>`) on `tensor`."""
    return package.OPS.pick(op, tensor).__module__.rsplit(".", 1)[1]


def test_the_library_builds_on_a_machine_with_a_compiler():
    assert native.library(), native.build_error()
    assert implementation(conv, "causal_conv1d_varlen", torch.zeros(1)) == "cpu_ops"


def test_cpu_tensors_run_the_kernels_unless_the_references_are_asked_for(monkeypatch):
    x = torch.zeros(2, 4)
    assert {implementation(norms, "rms_norm", x), implementation(attention, "paged_attention_decode", x),
            implementation(delta_rule, "gated_delta_rule_step_slots", x), implementation(sample, "sample_rows", x)} \
        == {"cpu_ops"}
    # torch is the chosen implementation: oneDNN's matmuls per expert, one indexed write, a gather
    assert {implementation(moe, "fused_moe", x), implementation(attention, "store_kv", x),
            implementation(state, "copy_state_slots", x)} == {"torch_ops"}
    assert implementation(conv, "causal_conv1d", x) == "reference"  # single-sequence: no kernel, not the engine's
    monkeypatch.setenv("CAIRN_KERNELS", "reference")
    assert implementation(norms, "rms_norm", x) == implementation(moe, "fused_moe", x) == "reference"
    monkeypatch.delenv("CAIRN_KERNELS")
    monkeypatch.setattr(dispatch, "_forced", True)  # what kernels.force_reference(True) sets
    assert implementation(attention, "paged_attention_prefill", x) == "reference"
    monkeypatch.setattr(dispatch, "_forced", False)
    assert implementation(attention, "paged_attention_prefill", x) == "cpu_ops"


def test_an_engine_on_a_cpu_runs_no_reference(monkeypatch, demo_model):
    """Every reference function raises: a step of either family (the MoE one too), prefill,
    decode, a checkpoint restored and sampling, runs without touching one."""
    from cairn.workers import Engine, SamplingParams

    for package in (attention, conv, delta_rule, moe, norms, sample, state):
        reference = importlib.import_module(package.__name__ + ".reference")
        for name in [n for n in package.__all__ if hasattr(reference, n) and callable(getattr(reference, n))]:
            monkeypatch.setattr(reference, name, lambda *a, name=name, **k: pytest.fail(f"{name}'s reference ran"))
    dispatch.forget()
    try:
        for arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
            engine = Engine.from_pretrained(demo_model(arch), device="cpu", page_size=16, num_pages=64)
            prompt = list(range(5, 60))
            first = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.8, top_p=0.9, seed=1))[0]
            again = engine.generate([prompt + first.token_ids + [9]], SamplingParams(max_tokens=3, temperature=0))[0]
            assert again.cached_tokens > 0, arch
    finally:
        dispatch.forget()


def test_without_the_library_an_engine_runs_the_fallbacks():
    script = ("import warnings, torch\n"
              "from cairn.kernels import conv\n"
              "from cairn.workers import Engine, SamplingParams\n"
              "from cairn.workers.demo import demo_model_dir\n"
              "e = Engine.from_pretrained(demo_model_dir('tiny', 'qwen3_5'))\n"
              "out = e.generate([[5, 6, 7] * 30], SamplingParams(max_tokens=3, temperature=0))[0]\n"
              "assert conv.OPS.pick('causal_conv1d_varlen', torch.zeros(1)).__module__ == 'cairn.kernels.conv.reference'\n"
              "print(len(out.token_ids))\n")
    env = dict(os.environ, CAIRN_NATIVE_CPU="0")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("3")


def test_the_engine_in_bf16_at_serving_shapes_tracks_transformers_in_bf16(serving_shaped):
    from cairn.workers import Engine
    from tests.support.checkpoints import hf_reference_model

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

