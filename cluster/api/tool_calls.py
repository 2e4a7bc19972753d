"""Tool calls out of a choice's content, as it streams: `ToolCallParser`.

The parser sits after the reasoning parser (`reasoning`): only content is searched, so a call
the model drafts while thinking stays reasoning. It finds `<tool_call>…</tool_call>` blocks and
hands each body to its model family's format (`tool_call_formats`). Rules:
- A block is a call only if it closes and its format parses it into a function the request
  offered. Anything else (bad JSON, an unknown key or function, a tag never closed, a tag opened
  twice) is content, exactly as written. Nothing the model writes raises.
- A call is given out whole once its closing tag arrived, so a stream never announces a call
  that then fails to parse. Streaming sends it as two deltas: `index`, `id`, `type` and
  `function.name` with empty arguments, then `index` and the arguments in one fragment; the
  fragments concatenate to the non-streamed arguments.
- Text that could be the start of `<tool_call>` is held back until the next piece decides it;
  trailing whitespace of the content is held until more content follows. When the choice ends,
  held whitespace is dropped if it made calls (content is null when there is nothing else) and
  given out if not: without calls the content is the text as generated.
- `max_calls` (1 for `parallel_tool_calls: false`) keeps the first calls and drops later ones.
Each call gets a fresh id, `call_` and 24 hex digits.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.api.reasoning import partial_tag_len
from cluster.api.tool_call_formats import PARSERS

START, END = "<tool_call>", "</tool_call>"


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class FoundCall:
    """One call the model made: the function's name and its arguments as JSON object text."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)

    def message(self) -> dict[str, Any]:
        """As an item of a response message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def deltas(self, index: int) -> list[dict[str, Any]]:
        """As streamed `tool_calls` items: the call's head, then its arguments."""
        return [{"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}},
                {"index": index, "function": {"arguments": self.arguments}}]


class ToolCallParser:
    def __init__(self, fmt: str, tools: Mapping[str, Any], max_calls: int | None = None):
        """`fmt`: a format of `tool_call_formats.PARSERS`; `tools`: each offered function's name
        and its parameters' JSON Schema."""
        if fmt not in PARSERS:
            raise ValueError(f"expected a tool-call format of {sorted(PARSERS)}, got {fmt!r}")
        self._parse, self._tools, self._max_calls = PARSERS[fmt], tools, max_calls
        self.found = 0          # calls parsed, kept or not
        self._buf = ""          # undecided: a possible opening tag, or an open block
        self._in_block = False  # `_buf` starts with START
        self._scanned = 0       # `_buf` searched up to here (a block's tags are not searched twice)
        self._space = ""        # trailing whitespace of the content, held

    def push(self, text: str) -> tuple[str, list[FoundCall]]:
        """(content, calls) that `text` adds."""
        self._buf += text
        content: list[str] = []
        calls: list[FoundCall] = []
        while True:
            if not self._in_block:
                start = self._buf.find(START)
                if start < 0:
                    keep = len(self._buf) - partial_tag_len(self._buf, START)
                    content.append(self._buf[:keep])
                    self._buf = self._buf[keep:]
                    break
                content.append(self._buf[:start])
                self._buf, self._in_block, self._scanned = self._buf[start:], True, len(START)
            since = max(len(START), self._scanned - len(END))
            end = self._buf.find(END, since)
            reopened = self._buf.find(START, since, end if end >= 0 else len(self._buf))
            if reopened >= 0:  # the first tag opened nothing: it is text, up to the second
                content.append(self._buf[:reopened])
                self._buf, self._scanned = self._buf[reopened:], len(START)
                continue
            if end < 0:
                self._scanned = len(self._buf)
                break
            block, self._buf, self._in_block = self._buf[:end + len(END)], self._buf[end + len(END):], False
            parsed = self._parse(block[len(START):-len(END)], self._tools)
            if parsed is None:
                content.append(block)
                continue
            self.found += 1
            if self._max_calls is None or self.found <= self._max_calls:
                calls.append(FoundCall(*parsed))
        return self._content("".join(content)), calls

    def flush(self) -> str:
        """The content still held when the choice ends (an unclosed block is content)."""
        text, self._buf, self._space, self._in_block = self._space + self._buf, "", "", False
        return text.rstrip() if self.found else text

    def _content(self, text: str) -> str:
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        return body
