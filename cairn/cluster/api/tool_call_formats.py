"""Each model family's tool-call format: one `<tool_call>` block's body into a call, or None.

The formats, as each family's chat template teaches the model to write a call:
- `qwen3_json` (Qwen3, Qwen3-Next, the demo model): `<tool_call>\\n{"name": NAME, "arguments":
  {...}}\\n</tool_call>`. The body is one JSON object with `name` and `arguments` (an object,
  or a string holding one; absent means none) and no other key.
- `qwen3_xml` (Qwen3.5 / 3.6, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE
  \\n</parameter>\\n...</function>\\n</tool_call>`. Nothing but whitespace around the function and
  between its parameters; a parameter given twice is malformed. The one newline the template
  puts on each side of a VALUE is not part of it. A VALUE is read by the type the tool's JSON
  Schema gives its parameter: `string` stays text as written; `integer`, `number`, `boolean`,
  `object`, `array` and `null` are read as JSON (booleans also as True/False, which the
  template's `| string` writes), and a value that does not read as one of its types stays text;
  a parameter the schema does not type is JSON if it parses as JSON, else text.
- `none`: no parsing.
`detect_format` reads the template's source: one that writes `<function=` is qwen3_xml, one that
writes `<tool_call>` is qwen3_json, any other none. `tool_call_parser` (`APIOptions`, `cairn serve
--tool-call-parser`) is `auto` (that detection), a format's name, or `none`.

A body is a call only if it parses and names a function the request offered; anything else is
None, never an exception: the caller keeps such text as content. Arguments come out as a JSON
object's text written as `json.dumps` writes it, which is the templates' `tojson`: a call echoed
back renders as the model wrote it. NaN and infinities are not JSON and make a body malformed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

TOOL_CALL_PARSERS = ("auto", "qwen3_json", "qwen3_xml", "none")
FormatParser = Callable[[str, Mapping[str, Any]], "tuple[str, str] | None"]

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def detect_format(template_source: str | None) -> str:
    source = template_source or ""
    if "<function=" in source:
        return "qwen3_xml"
    return "qwen3_json" if "<tool_call>" in source else "none"


def resolve_format(setting: str, template_source: str | None) -> str:
    """The format `setting` names for a model whose chat template is `template_source`."""
    if setting not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser: expected one of {', '.join(TOOL_CALL_PARSERS)}, got {setting!r}")
    return detect_format(template_source) if setting == "auto" else setting


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(text: str) -> Any:
    """Raises ValueError for anything but strict JSON."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _arguments_text(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def parse_json_call(body: str, tools: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a qwen3_json body, or None."""
    try:
        call = _json(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or set(call) - {"name", "arguments"} or call.get("name") not in tools:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _json(arguments)
        except ValueError:
            return None
    return (call["name"], _arguments_text(arguments)) if isinstance(arguments, dict) else None


def parse_xml_call(body: str, tools: Mapping[str, Any]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a qwen3_xml body, or None. `tools` maps each offered
    function's name to its parameters' JSON Schema."""
    function = _FUNCTION.fullmatch(body)
    if function is None or function[1] not in tools:
        return None
    name, inner = function[1], function[2]
    schema = tools[name] if isinstance(tools[name], dict) else {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    arguments: dict[str, Any] = {}
    at = 0
    while (parameter := _PARAMETER.match(inner, at)) is not None:
        key, value = parameter[1], parameter[2]
        if key in arguments:
            return None
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = typed_value(value, properties.get(key))
        at = parameter.end()
    return (name, _arguments_text(arguments)) if not inner[at:].strip() else None


def typed_value(text: str, schema: Any) -> Any:
    """A qwen3_xml parameter's text as the value its JSON Schema `schema` types it."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    types = [declared] if isinstance(declared, str) else \
        [t for t in declared if isinstance(t, str)] if isinstance(declared, list) else []
    if types and all(t == "string" for t in types):
        return text
    if "boolean" in types and text.strip() in ("True", "False"):
        return text.strip() == "True"
    try:
        value = _json(text)
    except ValueError:
        return text
    known = [_JSON_TYPES[t] for t in types if t in _JSON_TYPES]
    return value if not known or any(is_type(value) for is_type in known) else text


PARSERS: dict[str, FormatParser] = {"qwen3_json": parse_json_call, "qwen3_xml": parse_xml_call}
