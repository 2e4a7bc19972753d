"""Tool calling: definitions and history into the template, the model's calls out as `tool_calls`.

The parsers against tables of well-formed and malformed output and a property that a stream cut
anywhere gives what the whole text gives; a scripted engine behind the real HTTP API and the
official client, streamed and not, for both formats (the demo template's Qwen3 JSON and a
Qwen3.5-style XML template); every refusal a 400 naming its field; and an agent loop of ten tool
rounds on the real engine that keeps its cache."""

import json

import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.chat_template import ChatTemplate
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.cluster.api.tool_call_formats import detect_format, resolve_format, typed_value
from cairn.cluster.api.tool_calls import ToolCallParser
from tests.support.checkpoints import byte_tokens, with_template
from tests.support.fake_clients import OneTokenClient, ScriptedClient, background_apps
from cairn.workers import EngineFront

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "where": {"type": "object"}, "note": {"type": ["string", "null"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]

# A template of our own in the Qwen3.5 style: tools as JSON, calls as <function=...> with one
# <parameter=...> per argument, iterating `arguments` as a mapping (`|items`), as Qwen3.5's does.
XML_TEMPLATE = """{%- if tools -%}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call a function like this:
<tool_call>
<function=NAME>
<parameter=NAME>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}<|im_start|>assistant
{{ m.content or '' }}{% for call in m.tool_calls or [] %}
<tool_call>
<function={{ call.function.name }}>
{% for key, value in call.function.arguments | items %}<parameter={{ key }}>
{{ value | tojson if value is mapping or (value is sequence and value is not string) else value | string }}
</parameter>
{% endfor %}</function>
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' -%}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""


def json_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def xml_call(name: str, arguments: dict[str, str]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def parse(fmt: str, text: str, pieces: list[int] | None = None, max_calls: int | None = None):
    """(content, [(name, arguments)]) of `text` pushed in pieces of the given sizes (whole: None)."""
    parser = ToolCallParser(fmt, SCHEMAS, max_calls)
    content, calls, at = [], [], 0
    for size in pieces or [len(text)]:
        c, found = parser.push(text[at:at + size])
        content.append(c)
        calls += found
        at += size
    c, found = parser.push(text[at:])
    content += [c, parser.flush()]
    return "".join(content), [(call.name, json.loads(call.arguments)) for call in calls + found]


# ---- the parsers -------------------------------------------------------------------------------
CALL = json_call("get_weather", {"city": "Oslo"})
WELL_FORMED = [  # (format, model output, content, calls)
    ("qwen3_json", CALL, "", [("get_weather", {"city": "Oslo"})]),
    ("qwen3_json", "Let me look.\n\n" + CALL + "\n", "Let me look.", [("get_weather", {"city": "Oslo"})]),
    ("qwen3_json", CALL + "\n" + json_call("get_time", {}), "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("qwen3_json", '<tool_call>{"name": "get_time"}</tool_call>', "", [("get_time", {})]),
    ("qwen3_json", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>',
     "", [("get_weather", {"city": "Rome"})]),
    ("qwen3_json", "A " + CALL + " B", "A  B", [("get_weather", {"city": "Oslo"})]),
    ("qwen3_xml", xml_call("get_weather", {"city": "Oslo", "days": "3", "metric": "true", "hours": "[9, 12]",
                                           "where": '{"lat": 59.9}', "note": "null"}), "",
     [("get_weather", {"city": "Oslo", "days": 3, "metric": True, "hours": [9, 12], "where": {"lat": 59.9},
                       "note": None})]),
    ("qwen3_xml", xml_call("get_weather", {"city": "123", "days": "x", "metric": "False", "note": "n/a"}), "",
     [("get_weather", {"city": "123", "days": "x", "metric": False, "note": "n/a"})]),
    ("qwen3_xml", xml_call("get_weather", {"city": "two\nlines\n", "extra": "[1]", "other": "plain words"}), "",
     [("get_weather", {"city": "two\nlines\n", "extra": [1], "other": "plain words"})]),
    ("qwen3_xml", "Checking.\n" + xml_call("get_time", {}), "Checking.", [("get_time", {})]),
]
MALFORMED = [  # (format, model output): all of it stays content
    ("qwen3_json", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n{\"name\": \"launch_rockets\", \"arguments\": {}}\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}, \"why\": 1}\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": [1]}\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"not json\"}\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": NaN}}\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n[\"get_time\"]\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n{\"name\": 5}\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n" + "[" * 100000 + "\n</tool_call>"),
    ("qwen3_json", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}"),  # never closed
    ("qwen3_json", "<tool_call>"),
    ("qwen3_json", "<tool_call"),
    ("qwen3_json", "</tool_call> and <tool_response>"),
    ("qwen3_json", "A <tool_call> is written like <tool_call>{...}</tool_call>."),
    ("qwen3_xml", "<tool_call>\n<function=launch_rockets>\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\nOslo\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\nsure: <function=get_time>\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n"
                  "</parameter>\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=get_time>\n</function>\n<function=get_time>\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=get_time>"),
]


@pytest.mark.parametrize("fmt,text,content,calls", WELL_FORMED)
def test_calls_are_parsed_whole_or_cut_anywhere(fmt, text, content, calls):
    assert parse(fmt, text) == (content, calls)
    assert parse(fmt, text, [1] * len(text)) == (content, calls)  # one character at a time


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_text_that_only_looks_like_a_call_stays_content_as_written(fmt, text):
    assert parse(fmt, text) == (text, [])
    assert parse(fmt, text, [3] * (len(text) // 3)) == (text, [])


def test_a_closed_call_after_a_malformed_one_is_still_a_call():
    bad = "<tool_call>\n{oops}\n</tool_call>"
    assert parse("qwen3_json", bad + "\n" + CALL) == (bad, [("get_weather", {"city": "Oslo"})])
    draft = "<tool_call> draft " + CALL
    assert parse("qwen3_json", draft) == ("<tool_call> draft", [("get_weather", {"city": "Oslo"})])


def test_max_calls_keeps_the_first_call():
    text = CALL + "\n" + json_call("get_time", {}) + "\nDone."
    assert parse("qwen3_json", text, max_calls=1) == ("\n\nDone.", [("get_weather", {"city": "Oslo"})])


STREAMED = [  # (format, model output: text, calls and text, as a tool grammar allows)
    ("qwen3_json", "Checking. " + json_call("get_weather", {"city": "Oslo, by the fjord", "days": 3}) + "\n"
     + json_call("get_time", {})),
    ("qwen3_xml", "Checking.\n" + xml_call("get_weather", {"city": "Oslo\n\"north\"", "days": "3",
                                                           "hours": "[9, 12]", "note": "a long note, word by word"})
     + "\n" + xml_call("get_time", {})),
]


@pytest.mark.parametrize("fmt,text", STREAMED)
@pytest.mark.parametrize("size", [1, 2, 5])
def test_constrained_calls_stream_their_arguments_as_written(fmt, text, size):
    """Fed a few characters at a time (tokens), a call is announced once its name is written and
    its arguments grow fragment by fragment; the fragments concatenate to the call's arguments,
    which are those the whole-call parser gives (XML) or the model's own text (JSON)."""
    parser = ToolCallParser(fmt, SCHEMAS, stream_arguments=True)
    content, items = "", []
    for at in range(0, len(text), size):
        c, _ = parser.push(text[at:at + size])
        content += c
        items += parser.take_deltas()
    content += parser.flush()
    items += parser.take_deltas()
    whole = ToolCallParser(fmt, SCHEMAS)
    want_content, _ = whole.push(text)
    assert content == want_content + whole.flush() == "Checking."
    assert [c.name for c in parser.calls] == [c.name for c in whole.calls] == ["get_weather", "get_time"]
    for index, (streamed, parsed) in enumerate(zip(parser.calls, whole.calls)):
        mine = [i for i in items if i["index"] == index]
        assert mine[0] == {"index": index, "id": streamed.id, "type": "function",
                           "function": {"name": streamed.name, "arguments": ""}}
        fragments = [i["function"]["arguments"] for i in mine[1:]]
        assert "".join(fragments) == streamed.arguments
        assert json.loads(streamed.arguments) == json.loads(parsed.arguments)
        if fmt == "qwen3_xml":
            assert streamed.arguments == parsed.arguments
        if index == 0:  # a string argument arrives piece by piece (a whole call would be one fragment)
            assert len(fragments) >= 12 // size


def test_a_streamed_call_cut_off_keeps_what_it_wrote():
    parser = ToolCallParser("qwen3_xml", SCHEMAS, stream_arguments=True)
    parser.push("<tool_call>\n<function=get_weather>\n<parameter=city>\nOs")
    head = parser.take_deltas()
    assert head[0]["function"]["name"] == "get_weather"
    assert parser.flush() == ""
    assert "".join(i["function"]["arguments"] for i in head[1:] + parser.take_deltas()) == parser.calls[0].arguments
    assert parser.calls[0].arguments.startswith('{"city": "Os')


def test_values_follow_their_schema_type_and_untyped_ones_try_json():
    assert typed_value("007", {"type": "string"}) == "007"
    assert typed_value("7", {"type": "integer"}) == 7 and typed_value("7.5", {"type": "integer"}) == "7.5"
    assert typed_value("7.5", {"type": "number"}) == 7.5 and typed_value("true", {"type": "number"}) == "true"
    assert typed_value("{\"a\": 1}", None) == {"a": 1} and typed_value("hello there", {}) == "hello there"
    assert typed_value("NaN", {"type": "number"}) == "NaN" and typed_value("Infinity", None) == "Infinity"
    assert typed_value("null", {"type": ["integer", "null"]}) is None
    assert typed_value("[1", {"type": "array"}) == "[1"


def test_the_format_is_read_from_the_template_unless_one_is_named(tiny_model_dir):
    assert detect_format(ChatTemplate.from_dir(tiny_model_dir).source) == "qwen3_json"
    assert detect_format(XML_TEMPLATE) == "qwen3_xml" and detect_format("{{ messages }}") == "none"
    assert resolve_format("none", XML_TEMPLATE) == "none" and resolve_format("qwen3_json", None) == "qwen3_json"
    with pytest.raises(ValueError, match="tool_call_parser"):
        resolve_format("hermes", None)


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", "\n", " ", "  \n", "Sure, ", "x",
                          '{"name": "get_time", "arguments": {}}', '{"name": "get_weather"', ', "arguments": ',
                          '{"city": "Oslo"}}', "<function=get_time>", "</function>", "<parameter=city>",
                          "</parameter>", "{", "}", "<think>", "\u00e9\U0001f642", CALL, json_call("get_time", {}),
                          xml_call("get_weather", {"city": "Oslo", "days": "2"}), xml_call("get_time", {})])


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(parts=st.lists(PIECES, max_size=14), cuts=st.lists(st.integers(0, 12), max_size=20),
       fmt=st.sampled_from(["qwen3_json", "qwen3_xml"]))
def test_any_output_cut_anywhere_parses_as_the_whole_and_without_calls_is_returned_as_is(parts, cuts, fmt):
    text = "".join(parts)
    whole = parse(fmt, text)
    assert parse(fmt, text, cuts) == whole
    if not whole[1]:
        assert whole[0] == text


# ---- through the HTTP API, with a scripted engine ----------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def xml_model_dir(tiny_model_dir, tmp_path_factory):
    return with_template(tiny_model_dir, tmp_path_factory.mktemp("xml-tools"), XML_TEMPLATE)


@pytest.fixture(scope="module")
def servers(tiny_model_dir, xml_model_dir):
    fake = ScriptedClient()
    named = APIOptions(served_model_name=MODEL)
    with background_apps(build_app(fake, tiny_model_dir, named), build_app(fake, xml_model_dir, named),
                         build_app(fake, tiny_model_dir, APIOptions(served_model_name=MODEL, tool_call_parser="none"))
                         ) as (qwen3, qwen35, raw):
        yield fake, {"qwen3": qwen3.url, "qwen3.5": qwen35.url, "none": raw.url}


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)


def both_ways(url: str, **kw):
    """The non-streamed message and finish_reason, and the stream's chunks and what they add up to."""
    c, messages = client_of(url), kw.pop("messages", ASK)
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, **kw)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, stream=True, **kw))
    return whole.choices[0], chunks


def streamed_calls(chunks) -> tuple[str, list[dict], str | None]:
    """Content, calls (by index: id, name, concatenated arguments) and the finish reason of a stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for item in choice.delta.tool_calls or []:
                call = calls.setdefault(item.index, {"id": None, "name": None, "arguments": ""})
                if item.id is not None:
                    assert call["id"] is None and item.type == "function" and item.function.arguments == ""
                    call["id"], call["name"] = item.id, item.function.name
                else:
                    assert call["id"] is not None and item.function.name is None  # the head came first
                call["arguments"] += item.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("split", [False, True])
def test_a_call_comes_back_as_tool_calls_streamed_and_not(servers, tok, split):
    fake, urls = servers
    text = "<think>The user wants weather.</think>\n\n" + json_call("get_weather", {"city": "Oslo", "days": 2})
    fake.script = byte_tokens(tok, text) if split else tok.encode(text).ids
    choice, chunks = both_ways(urls["qwen3"], tools=TOOLS)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "The user wants weather."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    content, calls, finish = streamed_calls(chunks)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert "<tool_call>" in fake.requests[-1].prompt and '"name": "get_weather"' in fake.requests[-1].prompt


def test_text_and_two_calls_and_the_clients_own_stream_helper(servers, tok):
    fake, urls = servers
    text = "Let me check both.\n" + json_call("get_weather", {"city": "Oslo"}) + "\n" + json_call("get_time", {})
    fake.script = byte_tokens(tok, text)
    choice, chunks = both_ways(urls["qwen3"], tools=TOOLS)
    assert choice.message.content == "Let me check both." and choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    content, calls, _ = streamed_calls(chunks)
    assert content == "Let me check both."
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments)
                                                            for c in choice.message.tool_calls]
    with client_of(urls["qwen3"]).chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS,
                                                          max_tokens=400) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    one, _ = both_ways(urls["qwen3"], tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"]


def test_qwen35_xml_calls_are_typed_by_the_tool_schema(servers, tok):
    fake, urls = servers
    fake.script = byte_tokens(tok, xml_call("get_weather", {"city": "Oslo", "days": "3", "metric": "true"}))
    choice, chunks = both_ways(urls["qwen3.5"], tools=TOOLS)
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 3, "metric": True}
    assert streamed_calls(chunks)[1][0]["arguments"] == call.function.arguments
    assert "<function=NAME>" in fake.requests[-1].prompt  # the template's own instructions


def test_history_with_calls_renders_through_a_template_that_iterates_arguments_as_a_mapping(servers, tok):
    fake, urls = servers
    fake.script = tok.encode("It is 3 degrees.").ids
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2, \"where\": {\"lat\": 59.9}}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3C, snow"}]
    for name, url in urls.items():
        choice, _ = both_ways(url, tools=TOOLS, messages=history)
        assert choice.message.content == "It is 3 degrees." and choice.finish_reason == "stop"
        prompt = fake.requests[-1].prompt
        if name == "qwen3.5":
            assert ("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
                    "</parameter>\n<parameter=where>\n{\"lat\": 59.9}\n</parameter>\n</function>") in prompt
        else:
            assert '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "where": {"lat": 59.9}}}' in prompt


def test_the_qwen35_demo_models_template_gets_xml_parsing_and_argument_mappings(demo_model):
    model_dir = demo_model("qwen3_5")
    assert detect_format(ChatTemplate.from_dir(model_dir).source) == "qwen3_xml"
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    fake = ScriptedClient()
    # its generation prompt opens <think>: the call comes after the reasoning closes
    fake.script = tok.encode("Bergen next.\n</think>\n\n" + xml_call("get_weather", {"city": "Bergen", "days": "4"})).ids
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 2}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "3C, snow"}]
    with BackgroundServer(build_app(fake, model_dir, APIOptions(served_model_name=MODEL))) as server:
        choice, chunks = both_ways(server.url, tools=TOOLS, messages=history)
    assert "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>" in fake.requests[-1].prompt
    [call] = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Bergen", "days": 4}
    assert choice.message.reasoning_content == "Bergen next.\n" and choice.message.content is None
    assert streamed_calls(chunks)[1][0]["arguments"] == call.function.arguments


def test_tool_choice_none_hides_the_tools_and_a_none_parser_returns_calls_as_text(servers, tok):
    fake, urls = servers
    fake.script = tok.encode(CALL).ids
    choice, _ = both_ways(urls["qwen3"], tools=TOOLS, tool_choice="none")
    assert choice.message.content == CALL and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert "get_weather" not in fake.requests[-1].prompt
    choice, _ = both_ways(urls["none"], tools=TOOLS)
    assert choice.message.content == CALL and not choice.message.tool_calls
    assert "get_weather" in fake.requests[-1].prompt  # the tools were shown: only parsing is off
    choice, _ = both_ways(urls["qwen3"])  # no tools: nothing to call
    assert choice.message.content == CALL and not choice.message.tool_calls


def test_a_malformed_call_streams_as_content_and_completions_never_parse(servers, tok):
    """Calls parsed as written (the content is constrained instead, so the tool calls are not:
    the scripted engine writes what a model could): a malformed one stays content."""
    fake, urls = servers
    bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"\n</tool_call>"
    fake.script = byte_tokens(tok, bad)
    choice, chunks = both_ways(urls["qwen3"], tools=TOOLS, response_format={"type": "json_object"})
    assert choice.message.content == bad and not choice.message.tool_calls and choice.finish_reason == "stop"
    assert streamed_calls(chunks) == (bad, [], "stop")
    fake.script = tok.encode(CALL).ids
    out = client_of(urls["qwen3"]).completions.create(model=MODEL, prompt="Weather?", max_tokens=400)
    assert out.choices[0].text == CALL and out.choices[0].finish_reason == "stop"


# ---- refusals ----------------------------------------------------------------------------------
def function(**fields):
    return [{"type": "function", "function": {"name": "f", **fields}}]


BAD = [  # (what the request adds, the field the 400 names, the code)
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name", None),
    ({"tools": function(name=5)}, "tools[0].function.name", None),
    ({"tools": function(name="get weather")}, "tools[0].function.name", None),
    ({"tools": function(name="f" * 65)}, "tools[0].function.name", None),
    ({"tools": function(name="")}, "tools[0].function.name", None),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", None),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type", None),
    ({"tools": function(parameters="{}")}, "tools[0].function.parameters", None),
    ({"tools": function(parameters=[1])}, "tools[0].function.parameters", None),
    ({"tools": function(description=5)}, "tools[0].function.description", None),
    ({"tools": TOOLS + [TIME]}, "tools[2].function.name", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", None),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", None),
]
CALL_HISTORY = [  # (an assistant turn's tool call, the field the 400 names)
    ({"id": "c", "type": "function", "function": {"name": "f", "arguments": "{city: Oslo}"}},
     "messages[1].tool_calls[0].function.arguments"),
    ({"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}},
     "messages[1].tool_calls[0].function.arguments"),
    ({"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 100000}},
     "messages[1].tool_calls[0].function.arguments"),
    ({"id": "c", "type": "function", "function": {"name": "f", "arguments": 5}},
     "messages[1].tool_calls[0].function.arguments"),
    ({"id": "c", "type": "function", "function": {"arguments": "{}"}}, "messages[1].tool_calls[0].function.name"),
    ({"id": "c", "type": "retrieval", "function": {"name": "f", "arguments": "{}"}}, "messages[1].tool_calls[0].type"),
]


@pytest.fixture(scope="module")
def api(tiny_model_dir):
    with TestClient(build_app(OneTokenClient(), tiny_model_dir, APIOptions(served_model_name=MODEL))) as c:
        yield c


def post(api, **fields):
    return api.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 1, **fields})


@pytest.mark.parametrize("fields,param,code", BAD)
def test_a_bad_tool_definition_or_choice_is_a_400_naming_the_field(api, fields, param, code):
    r = post(api, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    assert r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize("call,param", CALL_HISTORY)
def test_a_tool_call_in_history_that_is_not_json_object_arguments_is_a_400_naming_it(api, call, param):
    r = post(api, messages=ASK + [{"role": "assistant", "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": "c", "content": "ok"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_what_openai_accepts_is_accepted(api):
    for fields in [{"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}, {"tools": TOOLS, "tool_choice": "none"},
                   {"tools": function(strict=True, parameters={"type": "object"})}, {"tool_choice": "none"},
                   {"tools": TOOLS, "parallel_tool_calls": False}, {"tools": []},
                   {"tools": TOOLS, "tool_choice": "required"},
                   {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                   {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": ""}},
                       {"id": "d", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]},
                       {"role": "tool", "tool_call_id": "c", "content": "noon"}]}]:
        assert post(api, **fields).status_code == 200, fields


# ---- an agent loop on the real engine keeps its cache -------------------------------------------
def test_ten_tool_rounds_each_resume_within_2_tokens_of_the_previous_prompts_end(tiny_model_dir):
    engine = EngineFront.from_pretrained(tiny_model_dir, num_pages=1024)
    with BackgroundServer(build_app(LocalEngineClient(engine), tiny_model_dir,
                                    APIOptions(served_model_name=MODEL))) as server:
        client = client_of(server.url)
        messages = [{"role": "system", "content": "You plan hikes to stone cairns and check the weather first."},
                    {"role": "user", "content": "Plan ten stops along the ridge, checking each one's weather."}]
        prompts, cached = [], []
        for k in range(10):
            out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8,
                                                 temperature=0, extra_body={"ignore_eos": True})
            prompts.append(out.usage.prompt_tokens)
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
            call_id = f"call_{k}"
            messages.append({"role": "assistant", "content": out.choices[0].message.content or "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": f"stop {k}", "days": k})}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"Stop {k}: {k} degrees, wind."})
    assert cached[0] == 0
    for k in range(1, 10):
        assert prompts[k - 1] - 2 <= cached[k] < prompts[k], (k, prompts, cached)  # a reply ends inside a page
