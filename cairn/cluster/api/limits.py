"""What one request may ask of the ingress before any engine sees it.

Rendering, tokenizing and hashing cost time linear in what a request carries, on threads every
request shares, so each request's share is bounded, and checked while its body is parsed: a
list over its limit is refused before its items are built, the total text once it is parsed,
and both before anything is rendered, tokenized or hashed. `APILimits` holds the numbers
(`APIOptions.api_limits`, `cairn.cluster.api.api_options`); the request models read
them from the validation context (`protocol`), and without one they apply the defaults.

A request over a limit is refused in OpenAI's error shape with code `limit_exceeded`; `param`
names the field and the message gives the value and the limit by name. Sizes are 413 (split
the request or shorten it): messages, tools, completion prompts in a batch, engine requests
(choices times prompts) and the total text.
Lists of parameters are 400 (fix the value): stop strings and their length, stop token ids,
logit_bias entries (refused as unsupported unless empty, but counted first). Images: their count
is a size (413); one image's bytes and pixels are 400s naming its content part
(`cairn.cluster.api.prompt_images`). An image's URL is not text: its characters count nowhere.

Total text counts the characters of every string a request carries into the template or the
tokenizer: message contents and their parts, reasoning, names, tool call ids and tool calls
(keys too), tool definitions, chat_template_kwargs values, text prompts and stop strings.
Token-id prompts are bounded by the model's context length, checked before they are hashed.
`prepare_threads`, `prepare_threads_per_tenant` and `prepare_wait_s` size the pool that renders
and tokenizes (`prep_pool`); `grammar_threads`, `grammar_compile_s` and `max_grammar_chars`
bound grammar compiles (`structured`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

LIMIT_EXCEEDED = "limit_exceeded"  # the pydantic error type, and the code clients see


class APILimits(BaseModel):
    """Per-request bounds on the ingress's work, and the pool that does it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_messages: int = Field(2048, ge=1, description=(
        "messages in one chat request (413). Long agent sessions reach a few hundred; a request "
        "is rendered 1 + 8 times (`chat_template`), and 2,048 messages take a fraction of a second"))
    max_text_chars: int = Field(4_000_000, ge=1, description=(
        "characters of all text one request carries (413). A 256k-token context holds about 1M "
        "characters of prose; 4M leaves room for dense code and whitespace while one request's "
        "tokenization stays within a few seconds of one core (off the event loop)"))
    max_tools: int = Field(128, ge=0, description="tool definitions in one chat request (413); OpenAI's own limit")
    max_prompts: int = Field(64, ge=1, description=(
        "prompts in one /v1/completions batch (413); each is tokenized and hashed, and becomes "
        "n engine requests"))
    max_engine_requests: int = Field(64, ge=1, description=(
        "engine requests one HTTP request makes, choices times prompts (413): an engine runs 64 "
        "sequences at once by default, and one request should not take them all"))
    max_stop_strings: int = Field(16, ge=0, description=(
        "stop strings per request (400); each is matched against every generated token"))
    max_stop_string_chars: int = Field(256, ge=1, description=(
        "characters of one stop string (400): matching holds back and compares up to this much "
        "text per token, on the event loop"))
    max_stop_token_ids: int = Field(256, ge=0, description=(
        "stop_token_ids per request (400): a model's end tokens are a handful; 256 covers every "
        "special token of common tokenizers"))
    max_logit_bias: int = Field(1024, ge=0, description=(
        "logit_bias entries (400, checked before logit_bias is refused as unsupported)"))
    prepare_threads: int = Field(4, ge=1, description=(
        "threads that render and tokenize, shared by all requests; a request uses one at a time"))
    prepare_threads_per_tenant: int | None = Field(None, ge=1, description=(
        "of those, the most one tenant holds at once (with keys); default: half, at least one"))
    prepare_wait_s: float = Field(5.0, gt=0, description=(
        "longest a request waits for a thread before a 503 with Retry-After (the server is busy)"))

    max_images: int = Field(16, ge=0, description=(
        "images in one chat request (413): each is decoded, resized and encoded by the vision tower"))
    max_image_bytes: int = Field(20 << 20, ge=1, description=(
        "bytes of one image as sent (decoded from base64, or fetched; 400)"))
    max_image_pixels: int = Field(4096 * 4096, ge=1, description=(
        "pixels of one image before resizing, read from its header before it is decoded (400): a "
        "decompression bomb is refused unread"))

    max_grammar_chars: int = Field(262_144, ge=1, description=(
        "characters of one request's compiled grammar (structured outputs, forced tool calls; "
        "400): what one compile may be asked to read"))
    grammar_compile_s: float = Field(5.0, gt=0, description=(
        "longest a grammar may take to compile before the request gets a 400"))
    grammar_threads: int = Field(2, ge=1, description=(
        "threads that compile grammars, apart from those that render prompts"))

    def check_count(self, limit: str, count: int, what: str) -> None:
        """Raises the limit error if `count` exceeds the limit named `limit`."""
        allowed = getattr(self, limit)
        if count > allowed:
            raise limit_error(limit, f"{count} {what}; this server accepts at most {allowed} ({limit})")

    def check_text(self, chars_by_field: dict[str, int]) -> None:
        """The total text of a request; `param` names the field that carries the most."""
        total = sum(chars_by_field.values())
        if total > self.max_text_chars:
            param = max(chars_by_field, key=chars_by_field.__getitem__)
            raise limit_error("max_text_chars", f"the request carries {total} characters of text ({param}: "
                                                f"{chars_by_field[param]}); this server accepts at most "
                                                f"{self.max_text_chars} (max_text_chars)", param)


DEFAULT_LIMITS = APILimits()
SIZE_LIMITS = frozenset({"max_messages", "max_text_chars", "max_tools", "max_prompts", "max_engine_requests",
                         "max_images"})


def limit_error(limit: str, message: str, param: str | None = None) -> PydanticCustomError:
    """A validation error that `errors.from_validation` turns into a 413 or a 400 naming `param`
    (or the field being validated)."""
    return PydanticCustomError(LIMIT_EXCEEDED, message,
                               {"status": 413 if limit in SIZE_LIMITS else 400, "param": param, "limit": limit})


def text_chars(values: Iterable[Any]) -> int:
    """Characters of every string in JSON-like values (dict keys included), without recursion."""
    total, stack = 0, list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v)
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total
