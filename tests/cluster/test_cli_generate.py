"""`cairn generate` prints the engine's completion (greedy unless told otherwise; its --help, and
serve's, state the API's default temperature); the chat template renders as transformers does."""

import os
import subprocess

import pytest
from tokenizers import Tokenizer

from cairn.cluster.api.chat_template import ChatTemplate, TemplateError
from tests.support.checkpoints import HUB_REPO
from tests.support.foreign_shell import cairn_script, foreign_shell, shadowed_imports
from cairn.workers import Engine, SamplingParams

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
    """The `cairn` console script, run as a user would: from a folder outside the checkout, with
    other distributions' `kernels`, `workers`, `cluster`, ... first on the path. It must import
    none of them (issue 37: Hugging Face's `kernels` shadowed cairn's here)."""
    shell = env_home / "shell"
    env = foreign_shell(shell, dict(os.environ, CAIRN_HOME=str(env_home)))
    proc = subprocess.run([cairn_script(), *args], capture_output=True, text=True, env=env, cwd=shell, timeout=120)
    assert shadowed_imports(shell) == [], f"cairn imported another distribution's {shadowed_imports(shell)}"
    return proc


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


@pytest.mark.parametrize("command,stated", [
    ("generate", "(default: 0, greedy, so a debugging run is reproducible; the API's default is {t})"),
    ("serve", "gets its default: temperature {t}, top_p"),
])
def test_help_states_the_apis_default_temperature_from_sampling_params(monkeypatch, capsys, command, stated):
    from cairn.cluster.cli import main
    from cairn.workers.sampling_params import DEFAULTS

    for t in (DEFAULTS["temperature"], 0.7):  # 0.7: read from the one definition, not written again
        monkeypatch.setitem(DEFAULTS, "temperature", t)
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0 and stated.format(t=f"{t:g}") in " ".join(capsys.readouterr().out.split())
