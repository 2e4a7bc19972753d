"""The OpenAI-shaped bodies the HTTP API returns: completions, chunks, models, usage, errors.

`usage.prompt_tokens_details.cached_tokens` is always present, 0 included: it is the number of
prompt tokens whose computation the prefix cache skipped (design rule 5).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class ErrorInfo(BaseModel):
    message: str = Field(description="what went wrong, for a person")
    type: str = Field(description="error class: invalid_request_error, authentication_error, ...")
    param: str | None = Field(None, description="the request field at fault, as a dotted path")
    code: str | None = Field(None, description="machine-readable reason")


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens served from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


# ---- chat --------------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = Field(None, description="text the model generated inside <think>…</think>")
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="the calls the model made: id, type function, function {name, arguments as JSON text}")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


def _now() -> int:
    return int(time.time())


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(
        None, description="a call's head (index, id, type, name, empty arguments), or its arguments (index)")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None

    def sse(self) -> str:
        """One server-sent event; a delta lists only the keys it carries, as OpenAI's do."""
        body = self.model_dump(mode="json")
        for choice in body["choices"]:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return _sse(body)


# ---- completions -------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A completion, or (streaming) one chunk of it: OpenAI uses one shape for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None

    def sse(self) -> str:
        return _sse(self.model_dump(mode="json"))


# ---- models ------------------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "cairn"
    max_model_len: int | None = Field(None, description="prompt + output tokens the model allows")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# characters JSON leaves raw that common line readers split on (Python's str.splitlines, which
# httpx's `aiter_lines` uses; U+2028/9 in JavaScript): escaped, one event stays one line
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(body: dict) -> str:
    text = json.dumps(body, ensure_ascii=False, separators=(',', ':')).translate(_LINE_BREAKING)
    return f"data: {text}\n\n"


DONE = "data: [DONE]\n\n"
