"""A tool call's arguments as the model writes them, for calls a grammar guarantees will parse.

`OpenCall(fmt, tools)` reads one `<tool_call>` block's body as it arrives (`feed`), and gives
the function's name once it is written (`name`) and the arguments' text in fragments as they are
decided; `close()` ends the block and returns the last fragment. The fragments concatenate to the
call's arguments (`arguments`), a JSON object's text:
- `qwen3_json`: the `arguments` value exactly as the model wrote it (OpenAI's arguments are the
  model's own text), each character as soon as it arrives; fragments written before the name are
  held until the name is known.
- `qwen3_xml`: the parameters as `json.dumps` writes the object `tool_call_formats.parse_xml_call`
  makes of them: `{"key": value, ...}`. A string parameter's text streams character by character
  (escaped as JSON; the newline before `</parameter>` and any text that may be the start of the
  closing tag held until decided); a value of any other type goes out whole at its closing tag,
  typed by the tool's schema.
Only for constrained output (`tool_calls`): text a grammar did not shape could stop being a call
after it was announced, and a stream cannot take a call back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from cairn.cluster.api.reasoning import partial_tag_len
from cairn.cluster.api.tool_call_formats import typed_value

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>")
_CLOSE_FUNCTION = re.compile(r"\s*</function>")
_CLOSE_PARAMETER = "\n</parameter>"


class OpenCall:
    def __init__(self, fmt: str, tools: Mapping[str, Any]):
        self._reader = _JsonBody() if fmt == "qwen3_json" else _XmlBody(tools)

    @property
    def name(self) -> str | None:
        return self._reader.name

    @property
    def arguments(self) -> str:
        return self._reader.written

    def feed(self, text: str) -> str:
        """The arguments' next fragment ('' while undecided, or while the name is unknown)."""
        return self._reader.take(self._reader.feed(text))

    def close(self) -> str:
        return self._reader.take(self._reader.close())


class _Body:
    def __init__(self):
        self.name: str | None = None
        self.written = ""  # fragments given out
        self._held = ""    # fragments decided before the name

    def take(self, fragment: str) -> str:
        self._held += fragment
        if self.name is None:
            return ""
        out, self._held = self._held, ""
        self.written += out
        return out

    def feed(self, text: str) -> str:
        raise NotImplementedError

    def close(self) -> str:
        return ""


class _JsonBody(_Body):
    """`{"name": NAME, "arguments": VALUE}`: a character scanner tracking strings and depth."""

    def __init__(self):
        super().__init__()
        self._depth, self._in_string, self._escaped = 0, False, False
        self._key, self._token = None, ""  # the member being read at depth 1, a string's raw text
        self._expect_key, self._in_arguments, self._value_depth = True, False, 0

    def feed(self, text: str) -> str:
        out = []
        for c in text:
            if self._in_arguments:
                if not out and not self.written and not self._held and c.isspace() and self._value_depth == 0 \
                        and not self._in_string:
                    continue  # whitespace before the value
                out.append(c)
            self._scan(c)
        return "".join(out)

    def _scan(self, c: str) -> None:
        if self._in_string:
            self._token += c
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                self._string_ended()
            return
        if c == '"':
            self._in_string, self._token = True, c
        elif c in "{[":
            self._depth += 1
            if self._in_arguments:
                self._value_depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._in_arguments:
                self._value_depth -= 1
                if self._value_depth == 0:
                    self._in_arguments = False
        elif self._depth == 1 and c == ":":
            self._expect_key = False
            self._in_arguments = self._key == "arguments"
        elif self._depth == 1 and c == ",":
            self._expect_key, self._in_arguments = True, False

    def _string_ended(self) -> None:
        if self._depth != 1:
            if self._in_arguments and self._value_depth == 0:  # a string as the whole value
                self._in_arguments = False
            return
        value = json.loads(self._token)
        if self._expect_key:
            self._key = value
        elif self._key == "name" and isinstance(value, str):
            self.name = value


class _XmlBody(_Body):
    """`<function=NAME>` then `<parameter=KEY>\\nVALUE\\n</parameter>` blocks, then `</function>`."""

    def __init__(self, tools: Mapping[str, Any]):
        super().__init__()
        self._tools, self._buf = tools, ""
        self._key: str | None = None     # the parameter being read
        self._string = False             # its value streams as a JSON string
        self._value = ""                 # its text so far (a string's: what was not given out)
        self._started = False            # a string value's first character (a newline to drop) seen
        self._count, self._ended = 0, False

    def _properties(self) -> Mapping[str, Any]:
        schema = self._tools.get(self.name or "")
        props = schema.get("properties") if isinstance(schema, dict) else None
        return props if isinstance(props, dict) else {}

    def feed(self, text: str) -> str:
        self._buf += text
        out = []
        while not self._ended:
            if self.name is None:
                m = _FUNCTION.match(self._buf)
                if m is None:
                    break
                self.name, self._buf = m[1], self._buf[m.end():]
            elif self._key is None:
                m = _PARAMETER.match(self._buf)
                if m is not None:
                    self._key, self._buf = m[1], self._buf[m.end():]
                    declared = self._properties().get(self._key)
                    types = declared.get("type") if isinstance(declared, dict) else None
                    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
                    self._string = bool(types) and all(t == "string" for t in types)
                    self._value, self._started = "", False
                    out.append(("{" if self._count == 0 else ", ") + json.dumps(self._key, ensure_ascii=False) + ": ")
                    if self._string:
                        out.append('"')
                    self._count += 1
                    continue
                m = _CLOSE_FUNCTION.match(self._buf)
                if m is None:
                    break
                out.append("{}" if self._count == 0 else "}")
                self._ended, self._buf = True, self._buf[m.end():]
            else:
                out.append(self._read_value())
                if self._key is not None:
                    break
        return "".join(out)

    def _read_value(self) -> str:
        """What the value being read adds; ends the parameter at its closing tag."""
        if not self._started and self._buf:
            self._started = True
            self._buf = self._buf[1:] if self._buf.startswith("\n") else self._buf
        closing = self._buf.find("</parameter>")
        if closing >= 0:  # the value ends before it (and before the newline the template puts there)
            text = self._buf[:closing]
            text = text[:-1] if text.endswith("\n") else text
            self._buf = self._buf[closing + len("</parameter>"):]
            self._value += text
            key, self._key = self._key, None
            if self._string:
                return json.dumps(text, ensure_ascii=False)[1:-1] + '"'
            return json.dumps(typed_value(self._value, self._properties().get(key)), ensure_ascii=False)
        keep = max(partial_tag_len(self._buf, "</parameter>"), 1 if self._buf.endswith("\n") else 0)
        keep = max(keep, partial_tag_len(self._buf, _CLOSE_PARAMETER))
        ready, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        if self._string:
            return json.dumps(ready, ensure_ascii=False)[1:-1]
        self._value += ready
        return ""
