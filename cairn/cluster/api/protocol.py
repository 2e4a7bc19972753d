"""The OpenAI-shaped requests the HTTP API accepts, as pydantic models.

Rules: unknown fields are ignored, as OpenAI does (`extra="ignore"`); known fields are checked
strictly against their JSON types (no "5" for 5, no 1.0 for an int, no NaN or infinity), so
a wrong type is a 400 naming the field. Ranges the engine owns (temperature, top_p, seed, ...)
are checked once, by `SamplingParams`, and their defaults are its own (`DEFAULTS`: a field left
out or null keeps it; the descriptions quote it); the ones only the API knows are checked here,
and so are the size limits (`limits.APILimits`, from the validation context `{"limits": ...}`,
else the defaults): a list over its limit is refused before its items are validated. Fields we
accept but cannot honour (suffix) are refused by the serving layer with a 400 naming them, never
silently dropped. Structured outputs (`response_format`, vLLM's `structured_outputs`, forced and
strict tool calls) are read and checked by `cairn.cluster.api.structured`. Sampling takes OpenAI's fields and vLLM's
extensions (`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`ignore_eos`); `logit_bias` keys are token ids, as strings.

Tools: a definition is `{"type": "function", "function": {"name", "description"?, "parameters"?,
"strict"?}}` with OpenAI's name rule (1 to 64 of `A-Z a-z 0-9 _ -`) and `parameters` a JSON
object (a JSON Schema); anything else is a 400 naming the field (`tools[0].function.name`). An
assistant turn's `tool_calls` items are `{"id"?, "type": "function", "function": {"name",
"arguments"}}`, `arguments` a JSON-object string (the wire form) or an object: templates iterate
it as a mapping, so `for_template` hands them a mapping (a string that is not a JSON object raises
`FieldError`, which the ingress turns into a 400 naming it; parsed on the ingress's threads,
after the size limits).
Responses live in `cairn.cluster.api.responses`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cairn.cluster.api.limits import DEFAULT_LIMITS, APILimits, text_chars
from cairn.workers.sampling_params import DEFAULTS

MAX_N = 16            # choices per request
MAX_LOGPROBS = 20
COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (or with null), as OpenAI's API
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name


def default(name: str) -> str:
    """The default of `SamplingParams`' field `name`, as a description states it."""
    return f"default {DEFAULTS[name]:g}"


def limits_of(info: ValidationInfo) -> APILimits:
    return (info.context or {}).get("limits") or DEFAULT_LIMITS


def count_limited(field: str, limit: str, what: str, kind: type = list):
    """A before-validator of `field` that refuses a list (or a `kind`) with more items than the
    request limit `limit` allows, before its items are validated."""
    def check(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, kind):
            limits_of(info).check_count(limit, len(value), what)
        return value

    return field_validator(field, mode="before")(classmethod(check))


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="send a last chunk with usage for the whole request")


class TextPart(_Request):
    type: Literal["text"] = Field(description="a text part")
    text: str = Field(description="the text")


class ImageURL(_Request):
    url: str = Field(description="a data: URL (base64 PNG, JPEG, WebP, or a GIF's first frame); http(s) and file "
                                 "URLs only under the server's image_url_allow prefixes")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted; images are sized by the "
                                                                            "checkpoint's preprocessor")


class ImagePart(_Request):
    type: Literal["image_url"] = Field(description="an image part (vision-language checkpoints)")
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


def content_text(content: str | list[dict[str, Any]] | None) -> str:
    """A message's text as the chat templates render it: a string as it is, text parts joined
    with nothing between them (OpenAI's SDK sends a system prompt as parts as readily as a
    string: both must compare and share alike)."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content)


class FieldError(ValueError):
    """A value the request models accepted by type but that fails a later check; `field` is its
    path inside the object that raised it (`tool_calls[0].function.arguments`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class FunctionCall(_Request):
    name: str = Field(description="the function called")
    arguments: str | dict[str, Any] = Field(description="its arguments: a JSON object, usually as a string")


class ToolCall(_Request):
    id: str | None = Field(None, description="the call's id, which a tool message's tool_call_id answers")
    type: Literal["function"] = Field("function", description="only function calls")
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates read it: `arguments` a mapping (Qwen3.5's template iterates
        it with `|items`; Qwen3's renders a mapping with `tojson`, as the model wrote it)."""
        call = self.model_dump(exclude_none=True)
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments, parse_constant=_no_constant) if arguments.strip() else {}
            except (ValueError, RecursionError):
                raise FieldError("function.arguments", "is not valid JSON (nor are NaN and Infinity); send "
                                                       "the arguments as a JSON object (a string or an object)") from None
            if not isinstance(arguments, dict):
                raise FieldError("function.arguments", "must be a JSON object")
        call["function"]["arguments"] = arguments
        return call


def _no_constant(name: str) -> Any:
    """json.loads takes NaN and Infinity, which JSON does not (nor the model's call parser)."""
    raise ValueError(f"{name} is not JSON")


class FunctionDefinition(_Request):
    name: str = Field(description="1 to 64 characters of A-Z, a-z, 0-9, _ and -")
    description: str | None = Field(None, description="what the function does, for the model")
    parameters: dict[str, Any] | None = Field(None, description="its arguments as a JSON Schema object")
    strict: bool | None = Field(None, description="true: calls to it are constrained to its parameters' schema")

    @field_validator("name")
    @classmethod
    def _name_is_a_function_name(cls, name: str) -> str:
        if not FUNCTION_NAME.fullmatch(name):
            raise ValueError("a function name is 1 to 64 characters of A-Z, a-z, 0-9, _ and -")
        return name


class Tool(_Request):
    type: Literal["function"] = Field(description="only function tools")
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class NamedFunction(_Request):
    name: str = Field(description="the function to call")


class NamedToolChoice(_Request):
    type: Literal["function"] = Field(description="only function tools")
    function: NamedFunction


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="who speaks; developer is rendered as system")
    content: str | list[ContentPart] | None = Field(None, description="text, or a list of text and image parts")
    name: str | None = Field(None, description="speaker name, passed to the template")
    reasoning_content: str | None = Field(
        None, description="an assistant turn's reasoning, echoed back; the template decides whether to keep it")
    tool_calls: list[ToolCall] | None = Field(
        None, description="an assistant turn's tool calls, for the template")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts(cls, content: Any) -> Any:
        """Text and image parts; say so for other media."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in ("text", "image_url"):
                    raise ValueError(f"part {i} is a {kind!r} part; this server reads text and image_url parts "
                                     f"(video and audio are not supported)")
        return content

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, calls: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        role = info.data.get("role")
        if calls is not None and role != "assistant":
            raise ValueError(f"only an assistant message may carry tool_calls, not a {role} message")
        return calls

    def content_chars(self) -> int:
        """Characters of the content's text (a template renders it whole)."""
        if self.content is None or isinstance(self.content, str):
            return len(self.content or "")
        return sum(len(part.text) for part in self.content if isinstance(part, TextPart))

    def text_chars(self) -> int:
        content = self.content if isinstance(self.content, str) or self.content is None else \
            [part.text for part in self.content if isinstance(part, TextPart)]
        calls = [c.model_dump(exclude_none=True) for c in self.tool_calls or ()]
        return text_chars([content, self.name, self.reasoning_content, self.tool_call_id, calls])

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (developer as system, tool calls' arguments as
        mappings); raises `FieldError` for arguments that are not a JSON object."""
        message = self.model_dump(exclude_none=True)
        if message["role"] == "developer":
            message["role"] = "system"
        if isinstance(self.content, list):  # an image as templates read it: where it is, not its URL
            message["content"] = [p if p["type"] == "text" else {"type": "image"} for p in message["content"]]
        if self.tool_calls is not None:
            calls = []
            for j, call in enumerate(self.tool_calls):
                try:
                    calls.append(call.for_template())
                except FieldError as e:
                    raise FieldError(f"tool_calls[{j}].{e.field}", str(e)) from None
            message["tool_calls"] = calls
        return message


class SamplingFields(_Request):
    """Fields both endpoints share."""

    model: str = Field(description="the served model's name (see GET /v1/models)")
    temperature: float | None = Field(None, description=f"0 = greedy; in [0, 2]; {default('temperature')}")
    top_p: float | None = Field(None, description=f"nucleus sampling mass, in (0, 1]; {default('top_p')}")
    top_k: int | None = Field(None, description=f"sample among the k most likely tokens; 0 or -1 = off; "
                                                 f"{default('top_k')}")
    seed: int | None = Field(None, description="reproducible sampling; choice i uses seed + i")
    stop: str | list[str] | None = Field(None, description="strings that end a choice; never part of its text")
    n: int = Field(1, ge=1, le=MAX_N, description=f"choices to generate, 1..{MAX_N}")
    stream: bool = Field(False, description="server-sent events instead of one JSON body")
    stream_options: StreamOptions | None = Field(None, description="streaming extras (include_usage)")
    min_p: float | None = Field(None, description="keep tokens at least min_p times as likely as the most "
                                                  f"likely one, in [0, 1]; {default('min_p')}")
    presence_penalty: float | None = Field(None, description="subtracted from tokens already in the output, "
                                                             f"in [-2, 2]; {default('presence_penalty')}")
    frequency_penalty: float | None = Field(None, description="times each output token's count, subtracted "
                                                              "from its logit, in [-2, 2]; "
                                                              f"{default('frequency_penalty')}")
    repetition_penalty: float | None = Field(None, description="divides positive (multiplies negative) logits "
                                                               "of prompt and output tokens, in (0, 2]; 1 = off; "
                                                               f"{default('repetition_penalty')}")
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string) -> bias in [-100, 100], "
                                                                  "added to its logit")
    min_tokens: int | None = Field(None, description="tokens to generate before EOS or a stop id may end the "
                                                     f"choice, at most max_tokens; {default('min_tokens')}")
    user: str | None = Field(None, description="end-user id (not used)")
    cache_salt: str | None = Field(None, max_length=1024,
                                   description="requests with different salts never share cached pages")
    ignore_eos: bool = Field(DEFAULTS["ignore_eos"], description="keep generating past end-of-sequence tokens")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end a choice")
    structured_outputs: dict[str, Any] | None = Field(None, description=(
        "vLLM's constraint: one of json (a schema), regex, choice, grammar (Lark or GBNF), json_object"))

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def stop_chars(self) -> int:
        return text_chars([self.stop])

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_within_limits(cls, stop: Any, info: ValidationInfo) -> Any:
        limits = limits_of(info)
        if isinstance(stop, list):
            limits.check_count("max_stop_strings", len(stop), "stop strings")
        for s in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
            if isinstance(s, str):
                limits.check_count("max_stop_string_chars", len(s), "characters in a stop string")
        return stop

    _stop_token_ids_within_limits = count_limited("stop_token_ids", "max_stop_token_ids", "stop token ids")
    _logit_bias_within_limits = count_limited("logit_bias", "max_logit_bias", "logit_bias entries", dict)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="the conversation so far")
    max_tokens: int | None = Field(None, description="deprecated name of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, description="tokens to generate at most; default: "
                                                                "what the context leaves")
    logprobs: bool = Field(False, description="return each token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="alternatives per token (needs logprobs=true)")
    tools: list[Tool] | None = Field(None, description="functions the model may call, passed to the chat template")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none (the template sees no tools), auto (the default with tools), required (one "
                          "call or more), or a named function (one call to it); forced calls match the schemas")
    parallel_tool_calls: bool | None = Field(
        None, description="false: only the model's first call is returned (default: all of them)")
    response_format: dict[str, Any] | None = Field(None, description="{type: text}, {type: json_object} or "
                                                                      "{type: json_schema, json_schema: {name, schema}}")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra template variables, such as enable_thinking")
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant turn's opening")
    continue_final_message: bool = Field(
        False, description="continue the last (assistant) message instead of starting a new turn")

    _messages_within_limits = count_limited("messages", "max_messages", "messages")
    _tools_within_limits = count_limited("tools", "max_tools", "tools")

    @model_validator(mode="after")
    def _text_within_limits(self, info: ValidationInfo) -> "ChatCompletionRequest":
        limits_of(info).check_text({"messages": sum(m.text_chars() for m in self.messages),
                                    "tools": text_chars([t.for_template() for t in self.tools or ()]),
                                    "chat_template_kwargs": text_chars([self.chat_template_kwargs]),
                                    "stop": self.stop_chars()})
        limits_of(info).check_count("max_images", len(self.image_parts()), "images")
        return self

    def image_parts(self) -> list[tuple[str, str]]:
        """(the part's parameter name, its URL) of every image part, in prompt order."""
        return [(f"messages[{i}].content[{j}]", part.image_url.url) for i, m in enumerate(self.messages)
                if isinstance(m.content, list) for j, part in enumerate(m.content) if isinstance(part, ImagePart)]

    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(field name, value) of the output budget the client asked for."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, token ids, or a batch of either")
    max_tokens: int | None = Field(COMPLETION_MAX_TOKENS, description=(
        f"tokens to generate at most; absent or null: {COMPLETION_MAX_TOKENS}, OpenAI's default"))
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="return log-probabilities with this many alternatives")
    echo: bool = Field(False, description="return the prompt before the completion")
    suffix: str | None = Field(None, description="not supported: must be empty")
    best_of: int | None = Field(None, description="not supported beyond n")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts_within_limits(cls, prompt: Any, info: ValidationInfo) -> Any:
        if isinstance(prompt, list) and not all(isinstance(x, int) for x in prompt):
            limits_of(info).check_count("max_prompts", len(prompt), "prompts in the batch")
        return prompt

    @model_validator(mode="after")
    def _text_within_limits(self, info: ValidationInfo) -> "CompletionRequest":
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        limits_of(info).check_text({"prompt": sum(len(p) for p in prompts if isinstance(p, str)),
                                    "stop": self.stop_chars()})
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def requested_max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
