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
- With `stream_arguments` (the output is constrained to well-formed calls by `tool_grammar`:
  every request with tools unless its content is constrained instead), a call is announced as soon as its function's name is written, and its
  arguments follow in fragments as the model writes them (`tool_arguments.OpenCall`), so a client
  sees a long argument grow token by token. A call cut off by the choice's end (its length)
  keeps the arguments written so far, streamed or not.
- Text that could be the start of `<tool_call>` is held back until the next piece decides it;
  trailing whitespace of the content is held until more content follows. When the choice ends,
  held whitespace is dropped if it made calls (content is null when there is nothing else) and
  given out if not: without calls the content is the text as generated.
- `max_calls` (1 for `parallel_tool_calls: false`) keeps the first calls and drops later ones.
Each call gets a fresh id, `call_` and 24 hex digits. `take_deltas()` returns the streamed
`tool_calls` items since the last call to it; `calls` holds the calls kept so far.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cairn.cluster.api.reasoning import partial_tag_len
from cairn.cluster.api.tool_arguments import OpenCall
from cairn.cluster.api.tool_call_formats import PARSERS

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

    def head(self, index: int) -> dict[str, Any]:
        """The streamed `tool_calls` item that announces the call."""
        return {"index": index, "id": self.id, "type": "function", "function": {"name": self.name, "arguments": ""}}


def arguments_item(index: int, fragment: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": fragment}}


class ToolCallParser:
    def __init__(self, fmt: str, tools: Mapping[str, Any], max_calls: int | None = None,
                 stream_arguments: bool = False):
        """`fmt`: a format of `tool_call_formats.PARSERS`; `tools`: each offered function's name
        and its parameters' JSON Schema."""
        if fmt not in PARSERS:
            raise ValueError(f"expected a tool-call format of {sorted(PARSERS)}, got {fmt!r}")
        self._fmt, self._parse, self._tools, self._max_calls = fmt, PARSERS[fmt], tools, max_calls
        self._stream_arguments = stream_arguments
        self.calls: list[FoundCall] = []   # kept, in order
        self._deltas: list[dict[str, Any]] = []
        self._open: OpenCall | None = None  # the call being written (stream_arguments)
        self._open_id, self._fed = "", 0
        self.found = 0          # calls parsed, kept or not
        self._buf = ""          # undecided: a possible opening tag, or an open block
        self._in_block = False  # `_buf` starts with START
        self._scanned = 0       # `_buf` searched up to here (a block's tags are not searched twice)
        self._space = ""        # trailing whitespace of the content, held

    def take_deltas(self) -> list[dict[str, Any]]:
        out, self._deltas = self._deltas, []
        return out

    def _keeps(self) -> bool:
        """Whether the call being found is kept (`max_calls`)."""
        return self._max_calls is None or self.found <= self._max_calls

    def _feed_open(self, upto: int) -> None:
        """Gives the open call its block's text up to `upto` (in `_buf`)."""
        fragment = self._open.feed(self._buf[self._fed:upto])
        self._fed = upto
        if self._open.name is not None and not self._open_id:
            self.found += 1
            self._open_id = _call_id()
            if self._keeps():
                self._deltas.append(FoundCall(self._open.name, "", self._open_id).head(len(self.calls)))
        if fragment and self._open_id and self._keeps():
            self._deltas.append(arguments_item(len(self.calls), fragment))

    def _close_open(self) -> None:
        fragment = self._open.close()
        if self._open_id and self._keeps():
            if fragment:
                self._deltas.append(arguments_item(len(self.calls), fragment))
            self.calls.append(FoundCall(self._open.name, self._open.arguments, self._open_id))
        self._open, self._open_id, self._fed = None, "", 0

    def _text_before_call(self, content: list[str]) -> int:
        """Moves the text before the next opening tag to `content`; the tag's index in `_buf`, or
        -1 (then only a possible start of the tag stays held in `_buf`)."""
        start = self._buf.find(START)
        if start < 0:
            keep = len(self._buf) - partial_tag_len(self._buf, START)
            content.append(self._buf[:keep])
            self._buf = self._buf[keep:]
            return -1
        content.append(self._buf[:start])
        return start

    def push(self, text: str) -> tuple[str, list[FoundCall]]:
        """(content, calls) that `text` adds: the calls completed by it."""
        if self._stream_arguments:
            return self._push_streaming(text)
        self._buf += text
        content: list[str] = []
        calls: list[FoundCall] = []
        while True:
            if not self._in_block:
                start = self._text_before_call(content)
                if start < 0:
                    break
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
            if self._keeps():
                call = FoundCall(*parsed)
                self._deltas += [call.head(len(self.calls)), arguments_item(len(self.calls), call.arguments)]
                self.calls.append(call)
                calls.append(call)
        return self._content("".join(content)), calls

    def _push_streaming(self, text: str) -> tuple[str, list[FoundCall]]:
        """`push` for output a grammar keeps to well-formed calls: a block is a call from its name on."""
        self._buf += text
        content: list[str] = []
        before = len(self.calls)
        while True:
            if self._open is None:
                start = self._text_before_call(content)
                if start < 0:
                    break
                self._buf = self._buf[start + len(START):]
                self._open, self._fed = OpenCall(self._fmt, self._tools), 0
            end = self._buf.find(END)
            if end < 0:
                self._feed_open(len(self._buf) - partial_tag_len(self._buf, END))
                break
            self._feed_open(end)
            self._close_open()
            self._buf = self._buf[end + len(END):]
        return self._content("".join(content)), self.calls[before:]

    def flush(self) -> str:
        """The content still held when the choice ends (an unclosed block is content; with
        `stream_arguments`, a call cut off keeps what it wrote)."""
        if self._open is not None:
            self._feed_open(len(self._buf))
            self._buf = ""
            if self._open_id:
                self._close_open()
            self._open = None
        text, self._buf, self._space, self._in_block = self._space + self._buf, "", "", False
        return text.rstrip() if self.found else text

    def _content(self, text: str) -> str:
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        return body
