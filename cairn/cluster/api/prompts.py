"""Requests into prompts: token ids, the text they came from, and checkpoint hints.

A chat request goes through the model's chat template (`chat_template`), which reports where the
last messages and the generation prompt start; `tokenizer` turns those character offsets into
token positions, the checkpoint hints. The template gets the request's tools (none with
`tool_choice` none) and tool calls with their arguments as mappings (arguments that are not a
JSON object are a 400 naming them). Special-token strings in anything the client wrote stay
text (`special_tokens`) unless the server was built with `special_tokens_in_content`. Completion
prompts are tokenized as written, special tokens included: there the client writes the whole
prompt; token-id prompts are checked against the vocabulary before anything hashes them. A chat
opening with one of the server's `public_system_prompts` reports how many tokens that system
message renders to (`public_tokens`), sent as a string or as text parts: every tenant shares
their whole pages. A text longer than the context could hold whatever its tokens (`max_model_len`
tokens of `TextTokenizer.max_chars_per_token` characters) is refused before it is tokenized
(400 `context_length_exceeded`), and so, before it is even rendered, is one whose messages (but
the assistant's) or tools alone are that long. A chat's image parts are read and preprocessed
before it is rendered, and each image's token expanded after it is tokenized (`prompt_images`).
This is the ingress's pre-engine work: it runs on a `prep_pool` thread, after the size limits
(`limits`) have been checked, and stops between its steps once its `stop` event is set.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cairn.cluster.api.chat_template import ChatTemplate, TemplateError
from cairn.cluster.api.api_errors import bad_request
from cairn.cluster.api.limits import text_chars
from cairn.cluster.api.image_sources import ImageSources
from cairn.cluster.api.prep_pool import check
from cairn.cluster.api.prompt_images import PromptImages
from cairn.cluster.api.protocol import ChatCompletionRequest, CompletionRequest, FieldError, content_text
from cairn.cluster.api.reasoning import ReasoningParser
from cairn.cluster.api.special_tokens import SpecialTokens
from cairn.cluster.api.text_tokenizer import TextTokenizer


@dataclass
class Prepared:
    """One prompt ready for the engine: token ids, the text and messages they came from,
    checkpoint hints (token positions), and whether its generation prompt opened <think> or
    closed it (an empty thinking block: the model answers at once)."""

    ids: list[int]
    text: str | None
    hints: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    opens_think: bool = False
    public_tokens: int = 0  # a public system prompt's tokens at the start, which every tenant shares
    closes_think: bool = False
    images: list = field(default_factory=list)  # its images (ImageInput), their tokens expanded in `ids`
    keys: list[int] | None = None  # with images: `ids` as the cache keys them (prompt_images.keys)


class Prompts:
    def __init__(self, tokenizer: TextTokenizer, template: ChatTemplate | None, vocab_size: int,
                 special_tokens_in_content: bool = False, public_system_prompts: Sequence[str] = (),
                 max_model_len: int | None = None, images: PromptImages | None = None):
        self.tokenizer, self.template, self.vocab_size = tokenizer, template, vocab_size
        self.images = images or PromptImages(None, None, ImageSources(), 1)  # none: a text-only model
        per_token = tokenizer.max_chars_per_token
        # a text longer than this is more than max_model_len - 1 tokens, whatever it says
        self.max_fitting_chars = (max_model_len - 1) * per_token if max_model_len and per_token else None
        self.public_system_prompts = frozenset(public_system_prompts)
        self.reasoning_model = tokenizer.has_tokens("<think>", "</think>")
        self.specials = None if special_tokens_in_content else \
            SpecialTokens(tokenizer.special_tokens(), template.source if template is not None else "")

    def chat(self, req: ChatCompletionRequest, stop: threading.Event | None = None) -> Prepared:
        if self.template is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        self._fits_before_rendering(req)
        loaded = self.images.load(req, stop)  # a bad image is refused before anything is rendered
        messages = []
        for i, m in enumerate(req.messages):
            try:
                messages.append(m.for_template())
            except FieldError as e:
                raise bad_request(f"messages[{i}].{e.field}: {e}", f"messages[{i}].{e.field}") from None
        add_generation_prompt = req.add_generation_prompt and not req.continue_final_message
        if req.continue_final_message and messages[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")
        variables = dict(req.chat_template_kwargs or {})
        clash = self.template.reserved_names(variables)
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {clash}: the renderer or Jinja own these "
                              f"names (use the request's own fields for messages, tools and "
                              f"add_generation_prompt)", "chat_template_kwargs")
        masking = self.specials.masking() if self.specials is not None else None
        shown = messages
        tools = [t.for_template() for t in req.tools] if req.tools and req.tool_choice != "none" else None
        if masking is not None:
            shown, tools, variables = masking.mask(messages), masking.mask(tools), masking.mask(variables)
        try:
            text, starts = self.template.message_starts(shown, add_generation_prompt, tools, variables, stop)
        except TemplateError as e:
            raise bad_request(str(e), "messages", "template_error") from None
        if req.continue_final_message:
            final = content_text(shown[-1].get("content"))
            cut = text.rfind(final) if final else -1
            text = text[:cut + len(final)] if cut >= 0 else text
        check(stop)
        gen_start = starts[-1] if starts else 0
        opens = self.reasoning_model and ReasoningParser.prompt_opens_think(text[gen_start:])
        closes = self.reasoning_model and not opens and "</think>" in text[gen_start:]
        if masking is not None and masking.used:
            unmasked = masking.unmask(text)
            text, starts = unmasked.text, [unmasked.real_offset(c) for c in starts]
            self._fits(len(text), "messages")
            ids, ends = self.tokenizer.encode_pieces(text, unmasked.pieces)
        else:
            self._fits(len(text), "messages")
            ids, ends = self.tokenizer.encode_with_ends(text)
        public = self._public_prefix(messages, text)
        positions = self.tokenizer.token_positions(ends, starts + [public])  # hints, then the public prefix's end
        ids, positions, images = self.images.place(ids, positions, loaded)
        return Prepared(ids, text, positions[:-1], messages, opens, positions[-1] if public else 0, closes, images,
                        self.images.keys(ids, images) if images else None)

    def _fits_before_rendering(self, req: ChatCompletionRequest) -> None:
        """What the template surely renders, over the limit, is refused before it is rendered: the
        text of every message but the assistant's (whose thinking a template may drop), and the
        tools when the template renders tools (as JSON, which only adds to them)."""
        if self.max_fitting_chars is None:
            return
        sure = sum(m.content_chars() for m in req.messages if m.role != "assistant")
        if req.tools and req.tool_choice != "none" and "tools" in self.template.source:
            sure += text_chars([t.for_template() for t in req.tools])
        self._fits(sure, "messages")

    def _fits(self, chars: int, param: str) -> None:
        """Refuses, before tokenizing it, a text of `chars` characters too long for the context
        whatever its tokens."""
        limit = self.max_fitting_chars
        if limit is not None and chars > limit:
            raise bad_request(f"the prompt is {chars} characters; this model's context holds at most {limit} "
                              f"(max_model_len - 1 tokens of at most {self.tokenizer.max_chars_per_token} "
                              f"characters each): refused before tokenizing", param, "context_length_exceeded")

    def _public_prefix(self, messages: list[dict[str, Any]], text: str) -> int:
        """Characters of `text` that render a public system prompt opening the conversation (0:
        none). One more render, of that message alone; used only if it is a prefix of `text`."""
        first = messages[0] if messages else {}
        content = first.get("content")
        if first.get("role") != "system" or content_text(content) not in self.public_system_prompts or \
                (isinstance(content, list) and any(p.get("type") != "text" for p in content)):  # an image: not shared
            return 0
        try:
            alone = self.template.render([first], add_generation_prompt=False)
        except TemplateError:
            return 0
        return len(alone) if text.startswith(alone) else 0

    def completion(self, req: CompletionRequest, stop: threading.Event | None = None) -> list[Prepared]:
        prompts = req.prompts()
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for p in prompts:
            check(stop)
            if isinstance(p, str):
                self._fits(len(p), "prompt")
                out.append(Prepared(self.tokenizer.encode(p, add_special_tokens=True), p))
            else:
                if not all(0 <= t < self.vocab_size for t in p):  # before they are hashed
                    raise bad_request(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")
                out.append(Prepared(list(p), None))
            if not out[-1].ids:
                raise bad_request("prompt must hold at least one token", "prompt")
        return out
