"""The grammar of a model family's tool calls (Lark, with llguidance's inline `%json`): forced and
strict calls match their schemas, and any call is well formed (so that its arguments can stream).

`tool_grammar(fmt, tools, mode, parallel)`: `tools` maps each offered function's name to
(parameters schema, strict). The modes:
- `required`: the output is one call or more (one with `parallel` false), each to any function;
- `named`: one call to the function named by `mode`'s `name`;
- `auto`: free text with calls among it, every call well formed; a strict function's arguments
  match its schema, another function's are any JSON object.
In `required` and `named` every function's arguments match its schema, strict or not (what a
client forcing a call parses). Calls are written as each family's template writes them (see
`tool_call_formats`): `qwen3_json` a JSON object `{"name", "arguments"}` in a `<tool_call>`
block; `qwen3_xml` a `<function=NAME>` block with one `<parameter=P>` block per argument, in the
schema's order, required ones always there, a string's value as text without `</parameter>`
(within its schema's pattern or length bounds), any other type's as JSON of its schema. Calls are separated by one newline. With `tag_ids`
(the ids of `<tool_call>` and `</tool_call>` where the tokenizer has them as tokens of their own,
as Qwen's do) the tags are those tokens, which is how the model writes them; else their text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

START, END = "<tool_call>", "</tool_call>"
CONSTRAINED_FORMATS = ("qwen3_json", "qwen3_xml")  # the formats a grammar can hold calls to
_TEXT = r"/(.|\n)+/ & ~/(.|\n)*<tool_call>(.|\n)*/"           # text with no call in it
# a string parameter's text and its closing tag (the lexer is greedy: a value that stopped
# before a closing tag could not be told from one that goes on, so the tag is part of it)
_NO_EARLY_CLOSE = r"~/(.|\n)*<\/parameter>(.|\n)(.|\n)+/"
_XML_VALUE = r"/(.|\n)*\n<\/parameter>\n/ & " + _NO_EARLY_CLOSE


def _literal(text: str) -> str:
    return json.dumps(text)


def _json(schema: Any) -> str:
    return "%json " + json.dumps(schema if isinstance(schema, dict) else {"type": "object"})


def _json_call(name: str, schema: Any, terminals: list[str]) -> str:
    body = {"type": "object", "properties": {"name": {"const": name}, "arguments": schema or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}
    return f"tag_start {_literal(chr(10))} {_json(body)} {_literal(chr(10))} tag_end"


_CLOSE = _literal("\n</parameter>\n")


def _string_terminal(schema: dict[str, Any], terminals: list[str]) -> str | None:
    """A terminal for a string value with a pattern or length bounds, and its closing tag."""
    pattern, low, high = schema.get("pattern"), schema.get("minLength"), schema.get("maxLength")
    if isinstance(pattern, str):
        body = pattern.removeprefix("^").removesuffix("$").replace("/", "\\/")
    elif isinstance(low, int) or isinstance(high, int):
        body = f"(.|\\n){{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}}"
    else:
        return None
    name = f"XML_VALUE_{len(terminals)}"
    terminals.append(f"{name}: /({body})\\n<\\/parameter>\\n/ & {_NO_EARLY_CLOSE}")
    return name


def _xml_value(schema: Any, terminals: list[str]) -> str:
    """A parameter's value and its closing tag (new terminals go to `terminals`)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or not schema or (types == "string" and "enum" not in schema
                                                      and "const" not in schema):
        bounded = _string_terminal(schema, terminals) if isinstance(schema, dict) else None
        return bounded or "XML_VALUE"
    if types == "string":
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return "(" + " | ".join(_literal(v) for v in values if isinstance(v, str)) + f") {_CLOSE}"
    return f"{_json(schema)} {_CLOSE}"


def _xml_call(name: str, schema: Any, terminals: list[str]) -> str:
    parts = ["tag_start", _literal(f"\n<function={name}>\n")]
    properties = schema.get("properties") if isinstance(schema, dict) else None
    required = set(schema.get("required") or ()) if isinstance(schema, dict) else set()
    if isinstance(properties, dict) and properties:
        for key, sub in properties.items():
            item = f"{_literal(f'<parameter={key}>' + chr(10))} {_xml_value(sub, terminals)}"
            parts.append(item if key in required else f"({item})?")
    else:  # no schema: any parameters, as text
        parts.append(f"({_literal('<parameter=')} /[^>\\n]+/ {_literal('>' + chr(10))} XML_VALUE)*")
    parts += [_literal("</function>\n"), "tag_end"]
    return " ".join(parts)


def tool_grammar(fmt: str, tools: Mapping[str, tuple[Any, bool]], mode: str, parallel: bool = True,
                 name: str | None = None, tag_ids: tuple[int, int] | None = None) -> str:
    """The Lark grammar (see the module's docstring); raises ValueError for a format it cannot
    constrain."""
    write = {"qwen3_json": _json_call, "qwen3_xml": _xml_call}.get(fmt)
    if write is None:
        raise ValueError(f"tool calls in format {fmt!r} cannot be constrained")
    chosen = {name: tools[name]} if mode == "named" else tools
    rules: list[str] = []
    terminals: list[str] = []
    for i, (fn, (schema, strict)) in enumerate(chosen.items()):
        constrained = mode != "auto" or strict
        rules.append(f"call_{i}: {write(fn, schema if constrained else {'type': 'object'}, terminals)}")
    lines = ["call: " + " | ".join(f"call_{i}" for i in range(len(rules)))] + rules
    if mode == "auto":
        lines.insert(0, "start: TEXT? (call TEXT?)*" if parallel else "start: TEXT? (call TEXT?)?")
        lines.append(f"TEXT: {_TEXT}")
    else:
        lines.insert(0, "start: call (\"\\n\" call)*" if parallel and mode == "required" else "start: call")
    if fmt == "qwen3_xml":
        lines += [f"XML_VALUE: {_XML_VALUE}"] + terminals
    start, end = (f"<[{tag_ids[0]}]>", f"<[{tag_ids[1]}]>") if tag_ids else (_literal(START), _literal(END))
    lines += [f"tag_start: {start}", f"tag_end: {end}"]
    return "\n".join(lines) + "\n"
