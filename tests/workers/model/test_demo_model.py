"""The demo checkpoint: transformers loads it offline, its tokenizer and chat template behave
like Qwen3's (an earlier turn's reasoning is dropped), and `cairn demo-model` writes it."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3NextConfig, Qwen3NextForCausalLM

from cairn.workers.demo import write_demo_model
from tests.support.paths import REPO

# conftest.py sets HF_HUB_OFFLINE=1 before anything imports huggingface_hub: nothing from a hub.

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir  # conftest's session-wide `write_demo_model(..., "tiny", seed=0)`


@pytest.fixture(scope="module")
def tok(tiny_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Qwen3NextForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


@pytest.fixture
def one_thread():
    """Tiny matmuls run ~100x slower when intra-op threads contend for shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in tensors.items()}


# --- checkpoint ---------------------------------------------------------------------------

def test_tiny_checkpoint_writes_and_loads_offline_quickly(tmp_path: Path) -> None:
    start = time.perf_counter()
    out = write_demo_model(tmp_path / "m", size="tiny")
    written = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    loaded = time.perf_counter()
    print(f"tiny: write {written - start:.3f}s, load {loaded - written:.3f}s")
    assert out == tmp_path / "m"
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    assert len(tok) == model.config.vocab_size == 512
    assert loaded - start < 5.0  # generous: the timing printed above is the informative part


def test_config_spells_out_the_hybrid_layout(tiny_dir: Path, tok) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_next"
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["num_experts"] == 0 and config["tie_word_embeddings"] is False
    assert config["rope_parameters"] == {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert config["pad_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    # Every Qwen3-Next field is written, none left to transformers' defaults.
    assert set(Qwen3NextConfig.__annotations__) <= set(config)
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [config["eos_token_id"], config["pad_token_id"]]


def test_file_holds_exactly_the_tensors_transformers_builds(tiny_dir: Path, model) -> None:
    stored = file_tensors(tiny_dir)
    assert shapes(stored) == shapes(Qwen3NextForCausalLM(model.config).state_dict())
    assert all(t.dtype == torch.float32 for t in stored.values())
    # And loading used them all: nothing was left to transformers' random init.
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], stored[name]) for name in stored)


def test_forward_gives_finite_confident_context_dependent_logits(model, one_thread) -> None:
    ids = torch.randint(0, 500, (2, 128), generator=torch.Generator().manual_seed(0))
    changed_first = ids.clone()
    changed_first[:, 0] = (changed_first[:, 0] + 1) % 500
    with torch.no_grad():
        logits, logits_changed = model(ids).logits, model(changed_first).logits
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    assert ((top2[..., 0] - top2[..., 1]) > 1e-3).float().mean() > 0.95  # greedy has a winner
    assert logits.std(dim=-1).min() > 0.5  # far from uniform
    # The first token still moves the logits 127 tokens later: a cached prefix matters.
    assert (logits[:, -1] - logits_changed[:, -1]).abs().max() > 1e-2


def test_same_seed_writes_identical_files_and_another_seed_other_weights(tmp_path: Path) -> None:
    a, b = write_demo_model(tmp_path / "a", seed=0), write_demo_model(tmp_path / "b", seed=0)
    c = write_demo_model(tmp_path / "c", seed=1)
    for name in [p.name for p in a.iterdir()]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wc = file_tensors(a), file_tensors(c)
    for name in ("model.embed_tokens.weight", "model.layers.0.linear_attn.A_log", "lm_head.weight"):
        assert not torch.equal(wa[name], wc[name]), name
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def byte_tokenizer_with_controls_at(first_id: int):
    """A byte-level BPE without merges whose control tokens sit at ids from `first_id` up, past
    a gap (as Qwen's sit above its padding rows): a vocabulary not the demo's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)} | {t: first_id + i for i, t in enumerate(CONTROL_TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in CONTROL_TOKENS[:3]])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in CONTROL_TOKENS[3:]])
    return tokenizer


def test_a_callers_vocabulary_sets_the_embedding_rows_and_the_token_ids(tmp_path: Path) -> None:
    out = write_demo_model(tmp_path / "v", tokenizer=byte_tokenizer_with_controls_at(900), vocab_size=1024)
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 1024 and config["eos_token_id"] == 902  # <|im_end|>
    assert file_tensors(out)["lm_head.weight"].shape[0] == 1024
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids(CONTROL_TOKENS) == list(range(900, 909))
    text = "<|im_start|>user\nhé<|im_end|>"
    assert tok.decode(tok.encode(text)) == text
    logits = AutoModelForCausalLM.from_pretrained(out)(torch.tensor([tok.encode(text)])).logits
    assert logits.shape[-1] == 1024 and torch.isfinite(logits).all()


def test_a_callers_vocabulary_needs_rows_for_every_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="leaves out ids"):
        write_demo_model(tmp_path / "a", tokenizer=byte_tokenizer_with_controls_at(900), vocab_size=905)
    with pytest.raises(ValueError, match="vocab_size"):
        write_demo_model(tmp_path / "b", tokenizer=byte_tokenizer_with_controls_at(900))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_unknown_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        write_demo_model(tmp_path, size="huge")


def test_bench_size_is_a_3_to_1_hybrid_of_tens_of_millions_of_parameters(tmp_path: Path) -> None:
    out = write_demo_model(tmp_path / "bench", size="bench")
    config = json.loads((out / "config.json").read_text())
    types = config["layer_types"]
    assert config["num_hidden_layers"] == len(types) >= 8
    assert types.count("linear_attention") == 3 * types.count("full_attention")
    assert all((t == "full_attention") == (i % 4 == 3) for i, t in enumerate(types))
    with safe_open(out / "model.safetensors", "pt") as f:
        n_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert 20e6 <= n_params <= 100e6
    assert len(AutoTokenizer.from_pretrained(out)) == config["vocab_size"] == 4096


# --- tokenizer ----------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.text())
def test_tokenizer_round_trips_any_unicode_text(tok, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_control_tokens_are_single_ids_at_the_top_of_the_vocab(tok) -> None:
    ids = [tok.encode(t, add_special_tokens=False) for t in CONTROL_TOKENS]
    assert ids == [[i] for i in range(512 - len(CONTROL_TOKENS), 512)]
    encoded = tok.encode("a<think>b</think><tool_call>{}</tool_call><|im_end|>",
                         add_special_tokens=False)
    assert tok.convert_tokens_to_ids("<think>") in encoded
    # Only the three special tokens vanish under skip_special_tokens; the tags stay for parsers.
    assert tok.decode(encoded, skip_special_tokens=True) == "a<think>b</think><tool_call>{}</tool_call>"
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)


# --- chat template ------------------------------------------------------------------------

def render(tok, messages: list[dict], **kwargs) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER_1 = {"role": "user", "content": "What is the capital of France?"}
USER_2 = {"role": "user", "content": "And of Japan?"}


@pytest.mark.parametrize("answer", [
    {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."},
    {"role": "assistant", "content": "<think>\nFrance's capital is Paris.\n</think>\n\nParis."},
], ids=["reasoning_content", "think_in_content"])
def test_next_turn_drops_the_previous_answers_reasoning(tok, answer: dict) -> None:
    prompt_1 = render(tok, [SYSTEM, USER_1], add_generation_prompt=True)
    turn_1 = render(tok, [SYSTEM, USER_1, answer])
    prompt_2 = render(tok, [SYSTEM, USER_1, answer, USER_2], add_generation_prompt=True)

    # Turn 1 as the model produced it: its prompt, then the thinking, then the answer.
    assert turn_1[:len(prompt_1)] == prompt_1
    assert ("<think>\nFrance's capital is Paris.\n</think>\n\nParis.<|im_end|>"
            in tok.decode(turn_1))
    # Turn 2 rewrites history: the reasoning is gone, the answer stays.
    assert "France's capital" not in tok.decode(prompt_2)
    assert "Paris.<|im_end|>" in tok.decode(prompt_2)
    shared = common_prefix(prompt_2, turn_1)
    assert len(prompt_1) - 10 <= shared < len(turn_1)
    assert shared <= len(prompt_1)  # turn 2 leaves turn 1's tokens where the thinking began


def test_without_thinking_the_next_turn_diverges_a_few_tokens_before_the_prompt_end(tok) -> None:
    prompt_1 = render(tok, [USER_1], add_generation_prompt=True, enable_thinking=False)
    answer = {"role": "assistant", "content": "Paris."}
    prompt_2 = render(tok, [USER_1, answer, USER_2], add_generation_prompt=True,
                      enable_thinking=False)
    shared = common_prefix(prompt_2, prompt_1)
    assert len(prompt_1) - 10 <= shared < len(prompt_1)  # the empty think block is dropped


def test_generation_prompt_opens_an_assistant_turn_with_optional_empty_thinking(tok) -> None:
    def text(**kwargs) -> str:
        return tok.apply_chat_template([USER_1], tokenize=False, add_generation_prompt=True,
                                       **kwargs)

    assert text() == ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert text(enable_thinking=True) == text()
    assert text(enable_thinking=False) == text() + "<think>\n\n</think>\n\n"


def test_tool_calls_and_results_render_qwen3_style(tok) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris and Lyon?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call it twice.", "tool_calls": calls},
        {"role": "tool", "content": "18C, sunny"},
        {"role": "tool", "content": "20C, cloudy"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    system_turn = text.split("<|im_end|>")[0]
    assert system_turn.startswith("<|im_start|>system\n") and '"name": "get_weather"' in system_turn
    # Tool calling continues the same user query, so this turn keeps its reasoning.
    assert ('<|im_start|>assistant\n<think>\nCall it twice.\n</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
            '<|im_end|>\n') in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response>\n"
                         "<tool_response>\n20C, cloudy\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


# --- CLI ----------------------------------------------------------------------------------

def test_cairn_demo_model_command_writes_the_checkpoint_and_prints_its_path(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "cairn.cluster.cli", "demo-model", str(out), "--size", "tiny", "--seed", "3"],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    same = write_demo_model(tmp_path / "py", size="tiny", seed=3)
    assert (out / "model.safetensors").read_bytes() == (same / "model.safetensors").read_bytes()
    assert AutoTokenizer.from_pretrained(out).chat_template


def test_cli_module_imports_neither_ray_nor_torch() -> None:
    code = "import sys, cairn.cluster.cli; print(sorted({'ray', 'torch'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
