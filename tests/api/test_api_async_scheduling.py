"""Async scheduling as a client sees it: the official openai client against two servers over real
HTTP, one engine with `async_scheduling` off and one with it on, gets the same answers: streamed
and not, usage with cached_tokens on a repeat, a stop string, n > 1 seeded sampling, structured
outputs (a JSON schema) and a constrained tool call. Streaming sends accepted tokens only: the
streamed text equals the whole answer. (The engine-level equalities are
tests/workers/test_async_scheduling.py.)"""

import json

import openai
import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You answer questions about stone piles, briefly and kindly."},
            {"role": "user", "content": "How do I build a cairn that lasts through the winter storms?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def clients(demo_model):
    model = demo_model("qwen3_5")
    engines = [EngineFront.from_pretrained(model, num_pages=512, max_num_seqs=8, page_size=8, async_scheduling=on)
               for on in (False, True)]
    with BackgroundServer(build_app(LocalEngineClient(engines[0]), model, APIOptions(served_model_name=MODEL))) as a, \
            BackgroundServer(build_app(LocalEngineClient(engines[1]), model, APIOptions(served_model_name=MODEL))) as b:
        yield [openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120) for s in (a, b)]
    assert engines[1].engine.async_steps.overlapped_steps > 0, "the async engine planned steps ahead"
    assert engines[0].engine.async_steps.overlapped_steps == 0


def both(clients, **params) -> list:
    return [c.chat.completions.create(model=MODEL, **params) for c in clients]


def answer(r) -> list:
    return [(c.message.content, c.finish_reason, [(t.function.name, t.function.arguments)
                                                  for t in c.message.tool_calls or []]) for c in r.choices]


def streamed(client, **params) -> tuple[str, str, object]:
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                **params):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


def test_answers_usage_and_streams_are_the_same(clients):
    params = dict(messages=MESSAGES, temperature=0, max_tokens=20, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True, **NO_THINKING})
    off, on = both(clients, **params)
    assert off.choices[0].message.content and answer(on) == answer(off)
    assert [t.token for t in on.choices[0].logprobs.content] == [t.token for t in off.choices[0].logprobs.content]
    assert on.usage.completion_tokens == off.usage.completion_tokens == 20
    again_off, again_on = both(clients, **params)  # a repeat resumes from the cache alike
    assert again_on.usage.prompt_tokens_details.cached_tokens == again_off.usage.prompt_tokens_details.cached_tokens > 0
    for client in clients:
        text, finish, usage = streamed(client, **params)
        assert (text, finish, usage.completion_tokens) == (off.choices[0].message.content, "length", 20)


def test_a_stop_string_cuts_alike_streamed_and_not(clients):
    params = dict(messages=MESSAGES, temperature=0, max_tokens=24, extra_body={"ignore_eos": True, **NO_THINKING})
    text = both(clients, **params)[0].choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"no stop string to cut at in {text!r}"
    off, on = both(clients, stop=[stop], **params)
    assert answer(on) == answer(off) and off.choices[0].finish_reason == "stop"
    assert streamed(clients[1], stop=[stop], **params)[:2] == (off.choices[0].message.content, "stop")


def test_n_seeded_choices_are_the_same(clients):
    off, on = both(clients, messages=MESSAGES, n=3, temperature=1.0, seed=7, max_tokens=9,
                   extra_body={"ignore_eos": True, **NO_THINKING})
    assert answer(on) == answer(off)
    assert len({c.message.content for c in on.choices}) > 1
    assert on.usage.completion_tokens == off.usage.completion_tokens == 27


def test_structured_outputs_and_a_constrained_tool_call_are_the_same(clients):
    ask = [{"role": "user", "content": "Describe a cairn for me."}]
    off, on = both(clients, messages=ask, n=2, temperature=1.0, seed=5, max_tokens=120, extra_body=NO_THINKING,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert answer(on) == answer(off)
    for c in on.choices:
        if c.finish_reason == "stop":
            assert set(json.loads(c.message.content)) == {"name", "age"}
    off, on = both(clients, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
                   tool_choice="required", temperature=0.8, seed=3, max_tokens=120, extra_body=NO_THINKING)
    assert answer(on) == answer(off)
    assert on.choices[0].message.tool_calls and on.choices[0].message.tool_calls[0].function.name == "get_weather"
