"""The ingress's work before the engine is bounded: message starts cost a fixed number of renders
however long the conversation."""

import os
import random
import shutil

import pytest
from fastapi.testclient import TestClient

from cluster.api import build_app
from cluster.api.chat_template import HINTED_MESSAGES, ChatTemplate, common_prefix_len
from workers import EngineSpec, RequestOutput

MODEL = "tiny"
C = "/v1/chat/completions"
IM_START = "<|im_start|>"


class ScriptedClient:
    """An EngineClient that records each request and answers one token."""

    spec = EngineSpec(fingerprint="scripted", page_size=16, max_model_len=1 << 20, recurrent=True, vocab_size=512)

    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        yield RequestOutput(request.request_id, [5], None, 1, 0, token_ids=[5], finish_reason="length")

    async def abort(self, request_id):
        return False

    async def metrics(self):
        return {}

    def num_waiting(self):
        return 0


def chat(messages, **fields):
    return {"model": MODEL, "messages": messages, "max_tokens": 1, **fields}


@pytest.fixture(scope="module")
def template(tiny_model_dir):
    return ChatTemplate.from_dir(tiny_model_dir)


@pytest.fixture()
def counted_renders(monkeypatch):
    calls = []
    render = ChatTemplate._render

    def counting(self, messages, *args):
        calls.append(len(messages))
        return render(self, messages, *args)

    monkeypatch.setattr(ChatTemplate, "_render", counting)
    return calls


# ---- message starts ----------------------------------------------------------------------------
def conversation(n: int) -> list[dict]:
    roles = ["user", "assistant"]
    return [{"role": "system", "content": "Be brief."}] + [
        {"role": roles[i % 2], "content": f"turn {i}: " + "stones " * (i % 5)} for i in range(n - 1)]


def exact_starts(template: ChatTemplate, messages: list[dict], first: int) -> list[int]:
    """Where messages[first:] and the generation prompt start, rendering every prefix (the old way)."""
    text = template.render(messages)
    return [common_prefix_len(template.render(messages[:i], add_generation_prompt=False), text)
            for i in range(first, len(messages) + 1)]


def test_2000_messages_take_a_fixed_number_of_renders_and_hint_their_last_starts(template, counted_renders):
    messages = conversation(2000)
    text, starts = template.message_starts(messages)
    assert len(counted_renders) == 1 + HINTED_MESSAGES  # the whole text, then one per hinted start
    assert starts == exact_starts(template, messages, len(messages) + 1 - HINTED_MESSAGES)
    assert text.startswith(f"{IM_START}assistant\n", starts[-1])  # the generation prompt


def test_a_short_conversation_gets_every_start_as_before(template):
    messages = conversation(5)
    assert template.message_starts(messages)[1] == exact_starts(template, messages, 1)
    no_prompt = template.message_starts(messages, add_generation_prompt=False)[1]
    assert no_prompt == exact_starts(template, messages, 1)[:-1]


def test_a_prefix_the_template_refuses_gives_no_hint_and_no_error(tiny_model_dir, tmp_path):
    """Templates such as Qwen3's raise on a conversation without a user turn: the system-only
    prefix gets no hint, the request renders as a whole."""
    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    source = (tiny_model_dir / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text(
        "{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 -%}"
        "{{- raise_exception('No user query found in messages.') -}}{%- endif -%}" + source)
    strict = ChatTemplate.from_dir(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text, starts = strict.message_starts(messages)
    assert starts == [text.rindex(IM_START)]  # the generation prompt only


def test_the_common_prefix_agrees_with_the_character_loop():
    rng = random.Random(7)
    for _ in range(300):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 9000)))
        b = a[:rng.randrange(0, len(a) + 1)] + "".join(rng.choice("abc") for _ in range(rng.randrange(0, 50)))
        assert common_prefix_len(a, b) == len(os.path.commonprefix([a, b]))


def test_2000_messages_over_http_take_a_fixed_number_of_renders(tiny_model_dir, counted_renders):
    fake = ScriptedClient()
    with TestClient(build_app(fake, tiny_model_dir, MODEL)) as c:
        r = c.post(C, json=chat([{"role": "user", "content": ""}] * 2000))
    assert r.status_code == 200 and len(counted_renders) == 1 + HINTED_MESSAGES
    assert len(fake.requests[-1].checkpoint_hints) == HINTED_MESSAGES
