"""The official openai client, sync and async, streaming and not, against the API over real
HTTP on loopback: chat, completions, models, usage with cached_tokens, logprobs, stop strings,
n > 1; and, through a scripted engine, reasoning split from content, multi-byte characters
split across tokens, and the API key."""

import asyncio
import json

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.chat_template import ChatTemplate
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from tests.support.checkpoints import byte_tokens, with_template
from tests.support.fake_clients import ScriptedClient, background_apps
from cairn.workers import EngineFront

MODEL = "tiny"
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
MESSAGES = [{"role": "system", "content": "You answer questions about stone piles, briefly and kindly."},
            {"role": "user", "content": "How do I build a cairn that lasts through the winter storms?"}]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return EngineFront.from_pretrained(tiny_model_dir, num_pages=512, max_num_seqs=16)


@pytest.fixture(scope="module")
def server(tiny_model_dir, engine):
    with BackgroundServer(build_app(LocalEngineClient(engine), tiny_model_dir,
                                    APIOptions(served_model_name=MODEL))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def stream_text(stream):
    content, reasoning, finish, usage, chunks = "", "", {}, None, []
    for chunk in stream:
        chunks.append(chunk)
        usage = chunk.usage or usage
        for c in chunk.choices:
            content += getattr(c.delta, "content", None) or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return content, reasoning, finish, usage, chunks


# ---- the real engine ---------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_chat_reports_usage_and_a_repeat_is_served_from_the_cache(client, tiny_model_dir, tok):
    messages = [{"role": "user", "content": "Tell me everything about cairns on mountain ridges. " * 4}]
    first = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    prompt = tok.encode(ChatTemplate.from_dir(tiny_model_dir).render(messages), add_special_tokens=False).ids
    assert first.usage.prompt_tokens == len(prompt)
    assert first.usage.completion_tokens == 12 and first.choices[0].finish_reason == "length"
    assert first.usage.total_tokens == len(prompt) + 12
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(prompt) - 16 - 8
    assert again.choices[0].message.content == first.choices[0].message.content


def test_chat_streaming_concatenates_to_the_non_streamed_answer(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    content, reasoning, finish, usage, chunks = stream_text(stream)
    msg = whole.choices[0].message
    assert content == (msg.content or "") and reasoning == (getattr(msg, "reasoning_content", None) or "")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finish == {0: "length"} and chunks[-1].choices == []
    assert usage.completion_tokens == 12 and usage.prompt_tokens == whole.usage.prompt_tokens
    again = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)  # resumes where the stream did
    assert usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens > 0


def test_completions_text_token_ids_batch_and_echo(client, tok):
    text = "A cairn is a pile of stones"
    one = client.completions.create(model=MODEL, prompt=text, **GREEDY)
    assert one.usage.prompt_tokens == len(tok.encode(text).ids) and one.usage.completion_tokens == 12
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    by_ids = client.completions.create(model=MODEL, prompt=tok.encode(text).ids, **GREEDY)
    assert by_ids.choices[0].text == one.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=text, echo=True, **GREEDY)
    assert echoed.choices[0].text == text + one.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[text, "Stones"], n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == one.choices[0].text  # greedy: n copies agree
    assert batch.usage.completion_tokens == 4 * 12
    assert batch.usage.prompt_tokens == len(tok.encode(text).ids) + len(tok.encode("Stones").ids)


def test_completions_stream_equals_non_stream(client):
    whole = client.completions.create(model=MODEL, prompt="Stones stacked high", **GREEDY)
    parts = list(client.completions.create(model=MODEL, prompt="Stones stacked high", stream=True,
                                           stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.text for p in parts for c in p.choices) == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == 12 and parts[-1].choices == []


def test_chat_logprobs_have_the_requested_alternatives(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens == 12
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0 and isinstance(e.bytes, list)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy picks the most likely
    streamed = [e for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                                              top_logprobs=3, stream=True, **GREEDY)
                for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completion_logprobs_in_the_legacy_shape(client):
    out = client.completions.create(model=MODEL, prompt="Stones", logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert all(len(d) <= 2 for d in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    assert all(v <= 0 for v in lp.token_logprobs)


def _stop_inside(text: str) -> tuple[str, int]:
    for k in range(max(1, len(text) // 3), len(text) - 3):
        stop = text[k:k + 3]
        if text.find(stop) == k and stop.strip():
            return stop, k
    raise AssertionError(f"the demo model's greedy answer has no stop string to cut at: {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_completion_stops_before_a_stop_string(client, stream):
    params = dict(GREEDY, max_tokens=24)
    text = client.completions.create(model=MODEL, prompt="Stones stacked high", **params).choices[0].text
    stop, k = _stop_inside(text)
    if stream:
        pieces = [(c.text, c.finish_reason) for p in client.completions.create(
            model=MODEL, prompt="Stones stacked high", stop=[stop], stream=True, **params) for c in p.choices]
        got, finish = "".join(t for t, _ in pieces), [f for _, f in pieces if f][0]
        assert not any(stop in t for t, _ in pieces)
    else:
        out = client.completions.create(model=MODEL, prompt="Stones stacked high", stop=stop, **params)
        got, finish = out.choices[0].text, out.choices[0].finish_reason
    assert got == text[:k] and finish == "stop"


def test_chat_stop_string_cuts_content_streamed_and_not(client):
    params = dict(GREEDY, max_tokens=24)
    msg = client.chat.completions.create(model=MODEL, messages=MESSAGES, **params).choices[0].message
    stop, k = _stop_inside((msg.content or ""))
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=[stop, "\x00never"], **params)
    content, _, finish, _, _ = stream_text(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stop=[stop], stream=True, **params))
    assert whole.choices[0].message.content == content == msg.content[:k]
    assert whole.choices[0].finish_reason == finish[0] == "stop"


def test_n_choices_are_indexed_seeded_and_summed(client):
    params = dict(model=MODEL, messages=MESSAGES, n=3, temperature=1.0, seed=7, max_tokens=5,
                  extra_body={"ignore_eos": True})
    a, b = client.chat.completions.create(**params), client.chat.completions.create(**params)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # seed + i
    assert a.usage.completion_tokens == 15 and a.usage.prompt_tokens == b.usage.prompt_tokens
    _, _, finish, usage, _ = stream_text(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **params))
    assert finish == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 15


def test_async_client_streams_and_not(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        chat, comp = await asyncio.gather(
            aclient.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY),
            aclient.completions.create(model=MODEL, prompt="Stones", **GREEDY))
        text = ""
        async for chunk in await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                                 **GREEDY):
            text += "".join((c.delta.content or "") for c in chunk.choices)
        models = await aclient.models.list()
        await aclient.close()
        return chat, comp, text, models

    chat, comp, text, models = asyncio.run(main())
    assert chat.usage.completion_tokens == comp.usage.completion_tokens == 12
    assert text == chat.choices[0].message.content and models.data[0].id == MODEL


def test_metrics_report_requests_latency_and_tokens(server, client):
    messages = [{"role": "user", "content": "Count the stones in the old wall by the river, twice. " * 3}]
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    body = httpx.get(server.url + "/metrics").text
    for name in ("cairn_requests_total{", "cairn_time_to_first_token_seconds_bucket", "cairn_prefix_hit_ratio",
                 "cairn_e2e_request_latency_seconds_count", "cairn_cached_tokens_total",
                 "cairn_generated_tokens_total", "cairn_engine_pages_held", "cairn_engine_checkpoints_stored"):
        assert name in body, name
    cached = float(next(line.split()[1] for line in body.splitlines() if line.startswith("cairn_cached_tokens_total")))
    assert cached > 0


# ---- a scripted engine: exact tokens in, exact text out --------------------------------------
@pytest.fixture(scope="module")
def thinking_dir(tiny_model_dir, tmp_path_factory):
    """The demo tokenizer with a template whose generation prompt opens <think> itself."""
    source = (tiny_model_dir / "chat_template.jinja").read_text()
    forced = source.replace(r"{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}",
                            r"{{- '<think>\n\n</think>\n\n' -}}{%- else -%}{{- '<think>\n' -}}{%- endif -%}")
    assert forced != source
    return with_template(tiny_model_dir, tmp_path_factory.mktemp("thinking"), forced)


@pytest.fixture(scope="module")
def scripted(tiny_model_dir, thinking_dir):
    fake = ScriptedClient()
    named = APIOptions(served_model_name=MODEL)
    with background_apps(build_app(fake, tiny_model_dir, named), build_app(fake, thinking_dir, named),
                         build_app(fake, tiny_model_dir, named, api_key="sekrit")) as (plain, thinking, locked):
        yield fake, plain, thinking, locked


def scripted_chat(url, **kw):
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    whole = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, **kw).choices[0].message
    content, reasoning, _, _, chunks = stream_text(c.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, stream=True, **kw))
    assert content == (whole.content or "") and reasoning == (getattr(whole, "reasoning_content", None) or "")
    return whole, chunks


@pytest.mark.parametrize("split_tags", [False, True])
def test_reasoning_is_split_from_content_even_when_tags_split_across_tokens(scripted, tok, split_tags):
    fake, plain, _, _ = scripted
    parts = ["<think>", "Stones first.\nThen height.", "</think>", "\n\nStack them wide."]
    fake.script = [t for p in parts for t in (byte_tokens(tok, p) if split_tags else tok.encode(p).ids)]
    msg, chunks = scripted_chat(plain.url)
    assert msg.reasoning_content == "Stones first.\nThen height." and msg.content == "\n\nStack them wide."
    assert not any("<" in (getattr(c.delta, "reasoning_content", None) or "") + (c.delta.content or "")
                   for ch in chunks for c in ch.choices)


def test_a_generation_prompt_that_opens_think_makes_output_reasoning_until_it_closes(scripted, tok):
    fake, _, thinking, _ = scripted
    fake.script = tok.encode("weighing stones</think>\n\nWide base.").ids
    msg, _ = scripted_chat(thinking.url)
    assert msg.reasoning_content == "weighing stones" and msg.content == "\n\nWide base."
    assert fake.requests[-1].prompt.endswith("<think>\n")
    fake.script = tok.encode("no answer yet").ids  # thinking cut off by max_tokens stays reasoning
    msg, _ = scripted_chat(thinking.url)
    assert msg.reasoning_content == "no answer yet" and not msg.content


def test_multibyte_characters_split_across_tokens_stream_whole(scripted, tok):
    fake, plain, _, _ = scripted
    text = "héllo 🙂 日本語 ok"
    fake.script = byte_tokens(tok, text)
    msg, chunks = scripted_chat(plain.url)
    assert msg.content == text
    pieces = [c.delta.content for ch in chunks for c in ch.choices if c.delta.content]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces) and len(pieces) > 5


def test_the_ingress_hashes_pages_and_marks_message_starts(scripted, tok):
    fake, plain, _, _ = scripted
    fake.script = tok.encode("ok").ids
    scripted_chat(plain.url, extra_body={"cache_salt": "tenant-a"})
    req = fake.requests[-1]
    assert len(req.page_hashes) == len(req.prompt_token_ids) // 16
    assert req.hash_root == fake.spec.hash_root("tenant-a") != fake.spec.hash_root(None)
    assert req.page_hashes == fake.spec.page_hashes(req.prompt_token_ids, req.hash_root)
    assert req.messages[1]["role"] == "user"
    user = req.prompt.index("<|im_start|>user")
    starts = [len(tok.encode(req.prompt[:c]).ids) for c in (req.prompt.index("\n") + 1, user,
                                                            req.prompt.index("\n", user) + 1,
                                                            req.prompt.rindex("<|im_start|>assistant"))]
    assert req.checkpoint_hints == starts  # the system prompt's content, the user's message, its content, the reply


def test_api_key_is_required_on_v1_when_set(scripted, tok):
    fake, _, _, locked = scripted
    fake.script = tok.encode("ok").ids
    wrong = openai.OpenAI(base_url=locked.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert httpx.get(locked.url + "/v1/models").status_code == 401  # no Authorization header at all
    good = openai.OpenAI(base_url=locked.url + "/v1", api_key="sekrit", max_retries=0)
    assert good.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message.content == "ok"
    assert httpx.get(locked.url + "/health").status_code == 200  # outside /v1: open
    assert httpx.get(locked.url + "/ready").status_code == 200


def test_requests_with_different_cache_salts_never_share_pages(client):
    messages = [{"role": "user", "content": "Which lichens grow on the north side of old cairns? " * 4}]

    def cached(salt):
        out = client.chat.completions.create(model=MODEL, messages=messages, extra_body={"cache_salt": salt,
                                                                                         "ignore_eos": True},
                                             temperature=0, max_tokens=4)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, other salt: nothing shared
    assert cached("tenant-a") > 0


def test_stop_strings_split_across_tokens_are_held_back_and_released(scripted, tok):
    fake, plain, _, _ = scripted
    fake.script = byte_tokens(tok, "rock ST and STONE pile")
    msg, chunks = scripted_chat(plain.url, stop=["STONE"])
    pieces = [c.delta.content for ch in chunks for c in ch.choices if c.delta.content]
    assert msg.content == "".join(pieces) == "rock ST and " and not any("STO" in p for p in pieces)
    fake.script = byte_tokens(tok, "rock ST and STON")  # a partial match at the end is released
    msg, _ = scripted_chat(plain.url, stop=["STONE"])
    assert msg.content == "rock ST and STON"


def test_messages_reach_the_template_with_reasoning_tool_calls_and_kwargs(scripted, tok, tiny_model_dir):
    fake, plain, _, _ = scripted
    fake.script = tok.encode("ok").ids
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "weather in Oslo?"}]},
                {"role": "assistant", "content": "", "reasoning_content": "call the tool",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 3}"}]
    c = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", max_retries=0)
    c.chat.completions.create(model=MODEL, messages=messages, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}, "some_future_field": {"x": 1}})
    as_template_sees_them = [dict(messages[0], role="system"), *messages[1:]]
    want = ChatTemplate.from_dir(tiny_model_dir).render(as_template_sees_them, enable_thinking=False)
    prompt = fake.requests[-1].prompt
    assert prompt == want and "<tool_call>" in prompt and prompt.endswith("<think>\n\n</think>\n\n")


def test_the_api_key_can_come_from_the_environment(tiny_model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setenv("CAIRN_API_KEY", "from-env")
    with TestClient(build_app(ScriptedClient(), tiny_model_dir, APIOptions(served_model_name=MODEL))) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_continue_final_message_extends_the_assistant_turn(scripted, tok):
    fake, plain, _, _ = scripted
    fake.script = tok.encode(" stones.").ids
    c = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", max_retries=0)
    out = c.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "What is a cairn?"}, {"role": "assistant", "content": "A pile of"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    prompt = fake.requests[-1].prompt
    assert prompt.endswith("A pile of") and prompt.count("<|im_start|>assistant") == 1
    assert out.choices[0].message.content == " stones."


def test_a_completion_without_max_tokens_or_with_null_generates_openais_default_of_16(scripted, tok):
    fake, plain, _, _ = scripted
    fake.script = byte_tokens(tok, "stones " * 10)  # 70 tokens on offer
    for extra, want in [({}, 16), ({"max_tokens": None}, 16), ({"max_tokens": 20}, 20)]:
        r = httpx.post(plain.url + "/v1/completions", json={"model": MODEL, "prompt": "A cairn", **extra}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == want, (extra, r.text)
        assert fake.requests[-1].params.max_tokens == want
    chat = httpx.post(plain.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": None})
    assert chat.json()["usage"]["completion_tokens"] == 70, "chat's null: what the context leaves, as OpenAI"


def test_a_stream_of_text_with_unicode_line_separators_reads_line_by_line(scripted, tok):
    """JSON leaves U+0085, U+2028 and U+2029 raw, and Python's line readers (httpx's aiter_lines,
    str.splitlines) break lines there: each event must stay one line, whatever the model writes."""
    fake, plain, _, _ = scripted
    text = "a\x85b\u2028c\u2029d"
    fake.script = byte_tokens(tok, text)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "stream": True}
    got = ""
    with httpx.stream("POST", plain.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    got += choice["delta"].get("content") or ""
    assert got == text
