"""The Qwen3.5 demo checkpoints (`cairn demo-model --arch qwen3_5 | qwen3_5_moe`): transformers
loads every tensor of them offline and computes what cairn's engine computes, and their chat
template follows Qwen3.5's conventions (thinking opened by the generation prompt, XML tool calls)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from cairn.workers import Engine, SamplingParams
from cairn.workers.demo import write_demo_model
from tests.support.paths import REPO

ARCHS = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
USER_1 = {"role": "user", "content": "What is the capital of France?"}
USER_2 = {"role": "user", "content": "And of Japan?"}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def demo(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, write_demo_model(tmp_path_factory.mktemp(request.param), size="tiny", arch=request.param)


def test_transformers_loads_every_tensor_and_computes_what_the_engine_does(demo) -> None:
    arch, path = demo
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == ARCHS[arch]
    with safe_open(path / "model.safetensors", "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    if arch == "qwen3_5_moe":  # published fused experts, as the file stores them
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in stored)
    loaded = model.state_dict()
    assert set(stored) == set(loaded) and all(torch.equal(loaded[n], stored[n]) for n in stored)

    ids = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    engine = Engine.from_pretrained(path, num_pages=16, max_num_seqs=1)
    torch.testing.assert_close(engine.prompt_logits(ids), expected, atol=2e-4, rtol=1e-4)
    top2 = expected.topk(2, dim=-1).values
    assert ((top2[:, 0] - top2[:, 1]) > 1e-3).float().mean() > 0.9  # greedy has a winner
    out = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out.token_ids == ref


def test_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected arch in"):
        write_demo_model(tmp_path / "x", arch="llama")


def render(tok, messages: list[dict], **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_generation_prompt_opens_thinking_and_the_next_turn_drops_it(demo) -> None:
    tok = AutoTokenizer.from_pretrained(demo[1])
    prompt_1 = render(tok, [USER_1], add_generation_prompt=True)
    assert prompt_1.endswith("<|im_start|>assistant\n<think>\n")
    assert render(tok, [USER_1], add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    answer = {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."}
    turn_1 = render(tok, [USER_1, answer])
    assert turn_1 == prompt_1 + "France's capital is Paris.\n</think>\n\nParis.<|im_end|>\n"
    prompt_2 = render(tok, [USER_1, answer, USER_2], add_generation_prompt=True)
    assert "France's capital" not in prompt_2 and "<|im_start|>assistant\nParis.<|im_end|>" in prompt_2


def test_tool_calls_render_as_qwen3_5_xml(demo) -> None:
    tok = AutoTokenizer.from_pretrained(demo[1])
    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    messages = [USER_1, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "18C"}]
    text = render(tok, messages, tools=tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "get_weather"' in text
    assert ("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n") in text


def test_cairn_demo_model_arch_flag_writes_that_architecture(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "cairn.cluster.cli", "demo-model", str(out), "--arch", "qwen3_5_moe", "--seed", "3"],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    same = write_demo_model(tmp_path / "py", size="tiny", seed=3, arch="qwen3_5_moe")
    assert (out / "model.safetensors").read_bytes() == (same / "model.safetensors").read_bytes()
    assert (out / "config.json").read_text() == (same / "config.json").read_text()
