"""`cairn generate` prints the engine's completion; the chat template renders as transformers does."""

import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from cluster.api.chat_template import ChatTemplate, TemplateError
from tests.support.checkpoints import HUB_REPO
from workers import Engine, SamplingParams

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
     {"role": "user", "content": "How tall is a cairn? 日本語 🙂"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"},
     {"role": "user", "content": "y"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
     {"role": "tool", "content": "{\"temp\": 3}"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_chat_template_renders_exactly_like_transformers(tiny_model_dir, messages, kwargs):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ChatTemplate.from_dir(tiny_model_dir).render(messages, add_generation_prompt=True, **kwargs) == want


def test_a_template_that_raises_gives_template_error():
    with pytest.raises(TemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([])
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% for %}")


def run_cli(*args, env_home):
    env = dict(os.environ, CAIRN_HOME=str(env_home))
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("by", ["directory", "hugging face id"])
def test_generate_prints_the_engines_greedy_completion(tiny_model_dir, tmp_path, by, request):
    """By its directory, or by its id from a Hugging Face cache, offline (conftest's `hf_hub`)."""
    model = str(tiny_model_dir)
    if by == "hugging face id":
        request.getfixturevalue("hf_hub")  # HF_HOME: a cache holding the tiny demo model as HUB_REPO
        model = HUB_REPO
    proc = run_cli("generate", "--model", model, "--prompt", "A cairn is", "--max-tokens", "12", env_home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = tok.encode("A cairn is", add_special_tokens=False).ids
    out = Engine.from_pretrained(tiny_model_dir).generate([ids], SamplingParams(max_tokens=12, temperature=0))[0]
    assert proc.stdout == tok.decode(out.token_ids, skip_special_tokens=False) + "\n"


def test_generate_without_model_writes_and_uses_the_demo_model(tmp_path):
    proc = run_cli("generate", "--prompt", "hello", "--chat", "--max-tokens", "4", env_home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "demo-tiny" / "config.json").exists()


def test_generate_rejects_bad_sampling_values_with_a_message(tiny_model_dir, tmp_path):
    proc = run_cli("generate", "--model", str(tiny_model_dir), "--prompt", "x", "--temperature", "7",
                   env_home=tmp_path)
    assert proc.returncode == 2 and "temperature" in proc.stderr
