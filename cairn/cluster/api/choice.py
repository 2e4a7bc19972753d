"""One choice of a response: the engine's tokens becoming the text a client sees.

Each output from the engine goes, token by token, through the detokenizer (whole characters
only), the stop matcher (cuts before a stop string, holds a possible partial one) and, for
chat, the reasoning parser (a reasoning model) and then, on the content, the tool-call parser (a
request with tools). `update` returns what this output adds, so
streaming sends exactly the increments and a non-streaming response the sum of them: the two
always agree. A choice that hit a stop string is finished at once (`finished`); the caller
then stops its engine request. `num_tokens` counts the tokens the choice consumed, up to and
including the one that completed a stop string. A choice that made tool calls and stopped on
its own ends with finish_reason "tool_calls" (OpenAI's); one cut at its length keeps "length".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cairn.cluster.api.reasoning import ReasoningParser
from cairn.cluster.api.stop_strings import StopMatcher
from cairn.cluster.api.text_tokenizer import TextTokenizer
from cairn.cluster.api.tool_calls import FoundCall, ToolCallParser
from cairn.workers import RequestOutput, TokenLogprob

MIN_LOGPROB = -9999.0  # what a -inf log-probability is reported as (JSON has no infinity)


@dataclass
class PlacedLogprob:
    """A generated token's logprobs and where its text starts in the choice's text."""
    logprob: TokenLogprob
    text_offset: int


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    logprobs: list[PlacedLogprob] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # streamed items (ToolCallParser.take_deltas)
    finish_reason: str | None = None

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.logprobs or self.tool_calls or self.finish_reason)


class Choice:
    def __init__(self, index: int, tokenizer: TextTokenizer, prompt_token_ids: Sequence[int],
                 stops: Sequence[str] = (), reasoning: ReasoningParser | None = None,
                 tools: ToolCallParser | None = None):
        self.index = index
        self._detok = tokenizer.detokenizer(prompt_token_ids)
        self._stop = StopMatcher(stops)
        self._reasoning = reasoning
        self._tools = tools
        self.num_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.reasoning = ""
        self.content = ""
        self.logprobs: list[PlacedLogprob] = []
        self.tool_calls: list[FoundCall] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: RequestOutput) -> Delta:
        if self.finished:
            return Delta()
        self.cached_tokens = out.cached_tokens
        delta, visible = Delta(), []
        first = out.num_output_tokens - len(out.new_token_ids)
        for j, token in enumerate(out.new_token_ids):
            offset = len(self._detok.text)
            visible.append(self._stop.push(self._detok.push([token])))
            self.num_tokens = first + j + 1
            if out.new_logprobs is not None and j < len(out.new_logprobs):
                delta.logprobs.append(PlacedLogprob(out.new_logprobs[j], offset))
            if self._stop.stopped:
                delta.finish_reason = "stop"
                break
        if out.finished and not self._stop.stopped:
            visible.append(self._stop.push(self._detok.flush()))
            visible.append(self._stop.flush())
            delta.finish_reason = "stop" if self._stop.stopped else out.finish_reason
        text = "".join(visible)
        if self._reasoning is None:
            delta.content = text
        else:
            delta.reasoning, delta.content = self._reasoning.push(text)
            if delta.finish_reason:
                r, c = self._reasoning.flush()
                delta.reasoning, delta.content = delta.reasoning + r, delta.content + c
        if self._tools is not None:
            delta.content, _ = self._tools.push(delta.content)
            if delta.finish_reason:
                delta.content += self._tools.flush()
            delta.tool_calls = self._tools.take_deltas()
            self.tool_calls = list(self._tools.calls)
        if delta.finish_reason == "stop" and self.tool_calls:
            delta.finish_reason = "tool_calls"
        self.finish_reason = delta.finish_reason
        self.reasoning += delta.reasoning
        self.content += delta.content
        self.logprobs += delta.logprobs
        return delta
