"""Structured outputs and forced tool calls through the official `openai` client, on the real engine
with the demo models' random weights: whatever the weights say, a constrained answer parses and
validates. Bad constraints are 400s naming the field, and a good request succeeds after each.
"""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront

MODEL = "tiny"
ASK = [{"role": "user", "content": "Describe a cairn for me."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "kind": {"enum": ["stone", "slate"]}},
          "required": ["name", "age", "kind"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def client(request, demo_model):
    model = demo_model(request.param)
    engine = EngineFront.from_pretrained(model, num_pages=512, max_num_seqs=16)
    with BackgroundServer(build_app(LocalEngineClient(engine), model, APIOptions(served_model_name=MODEL))) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **fields):
    extra = {**NO_THINKING, **fields.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL, messages=ASK, extra_body=extra, **{"max_tokens": 200, **fields})


def test_response_format_json_schema_validates(client):
    r = chat(client, n=3, temperature=1.0, seed=5, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_and_vllms_structured_outputs(client):
    r = chat(client, temperature=0.7, seed=1, response_format={"type": "json_object"}, max_tokens=400)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a free object may run long on random weights; what came is a JSON object's start
        assert r.choices[0].message.content.lstrip().startswith("{")
    r = chat(client, extra_body={"structured_outputs": {"regex": r"[a-c]{3}-[0-9]{2}"}}, temperature=1.0, seed=2)
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", r.choices[0].message.content)
    r = chat(client, extra_body={"structured_outputs": {"choice": ["north", "south"]}}, temperature=1.0, seed=3)
    assert r.choices[0].message.content in ("north", "south")
    r = chat(client, extra_body={"structured_outputs": {"grammar": 'start: "go " ("left" | "right")'}})
    assert r.choices[0].message.content in ("go left", "go right")
    r = chat(client, extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert " " not in r.choices[0].message.content.replace(json.loads(r.choices[0].message.content)["name"], "")
    r = client.completions.create(model=MODEL, prompt="A number:", max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", r.choices[0].text)


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_forced_tool_calls_validate_and_stream_their_arguments_token_by_token(client):
    fragments_per_call = []
    for choice, names in [("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})]:
        for seed in range(3):
            fields = dict(tools=[WEATHER, TIME], tool_choice=choice, temperature=1.0, seed=seed, max_tokens=300)
            r = chat(client, **fields)
            assert r.choices[0].finish_reason == "tool_calls", (choice, seed)
            whole = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
            finish, parts = None, {}
            for chunk in chat(client, stream=True, **fields):
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    for d in c.delta.tool_calls or ():
                        part = parts.setdefault(d.index, ["", []])
                        part[0] += (d.function.name or "") if d.function else ""
                        if d.function and d.function.arguments:
                            part[1].append(d.function.arguments)
            streamed = [(name, "".join(frags)) for name, frags in parts.values()]
            assert finish == "tool_calls" and streamed == whole, (choice, seed)  # the same seed, the same calls
            fragments_per_call += [len(frags) for _, frags in parts.values()]
            for name, arguments in whole:
                assert name in names
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            if isinstance(choice, dict):
                assert len(whole) == 1
    assert max(fragments_per_call) > 3  # arguments arrive as they are written, not in one piece


def test_parallel_tool_calls_false_makes_one_call(client):
    for seed in range(3):
        r = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                 temperature=1.0, seed=seed, max_tokens=300)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


def test_strict_tools_under_auto_constrain_every_call_made(client):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for seed in range(4):
        r = chat(client, tools=[strict], temperature=1.0, seed=seed, max_tokens=120)
        for name, arguments in calls_of(r.choices[0].message):
            assert name == "get_weather"
            jsonschema.validate(arguments, SCHEMAS[name])


BAD = [  # (what the request adds, the field the 400 names)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"extra_body": {"structured_outputs": {"regex": "((a{1000}){1000}){1000}"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"regex": "("}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"jsonn": {}}}}, "structured_outputs.jsonn"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs.regex"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 300}}, "min_tokens"),
]


@pytest.mark.parametrize("fields,param", BAD)
def test_a_bad_constraint_is_a_400_naming_the_field_and_changes_nothing(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **fields)
    assert e.value.body["param"] == param, e.value.body
    r = chat(client, extra_body={"structured_outputs": {"choice": ["fine"]}})
    assert r.choices[0].message.content == "fine"


def test_tool_grammars_compile_for_a_tokenizer_whose_tags_sit_past_its_count(tmp_path):
    """Qwen's tokenizers count fewer tokens than their highest added id (<tool_call> is 151657 in a
    tokenizer of 151,652): the ingress's grammar check must take every id the model can emit."""
    import asyncio

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from cairn.cluster.api.limits import DEFAULT_LIMITS
    from cairn.cluster.api.structured import GrammarCompiler
    from cairn.cluster.api.text_tokenizer import TextTokenizer
    from cairn.cluster.api.tool_grammar import tool_grammar

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tags = ["<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    vocab.update({t: 200 + 3 * i for i, t in enumerate(tags)})  # ids past the count, with gaps, as Qwen's
    tok = Tokenizer(models.WordLevel(vocab, unk_token="~"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tags[0], special=True)])
    tok.add_tokens(tags[1:])
    text = TextTokenizer(tok)
    assert text.tokenizer.get_vocab_size() < 212 and text.tokenizer.token_to_id("</tool_call>") == 212
    compiler = GrammarCompiler(text, 100, DEFAULT_LIMITS)  # a model vocabulary smaller still
    grammar = tool_grammar("qwen3_json", {"f": ({"type": "object"}, False)}, "auto", tag_ids=compiler.tag_ids)

    async def never() -> None:
        await asyncio.Event().wait()

    import llguidance

    asyncio.run(compiler.check("tools", llguidance.LLMatcher.grammar_from_lark(grammar), never))
