"""A model's own Jinja chat template, rendered with Hugging Face's semantics.

The template comes from `chat_template.jinja` or, failing that, `tokenizer_config.json`'s
`chat_template` in the checkpoint directory. Rendering matches transformers'
`apply_chat_template(..., tokenize=False)`: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, a `tojson` filter that keeps non-ASCII text,
`raise_exception(msg)` and `strftime_now(fmt)`; extra keyword arguments (such as
`enable_thinking`) become template variables, except the names the renderer or Jinja own
(`reserved_names`): the API refuses those. A template error raises `TemplateError`, which the
API turns into a 400: it is the request's messages that the template refused.

`message_starts` marks where the last `HINTED_MESSAGES` messages and the generation prompt start,
where the newest message's content starts (prompts that share everything before it, as users of
one system prompt do, part a few tokens past its role header), where the first message's content
starts (a new conversation parts from its tenant's others there, past the role header, when
their system prompts differ), and, replacing the generation prompt's start when the template
rewrites a past reply (Qwen3.5 drops its think block), where the reply as history renders it
parts from the generation prompt (the next turn's prompt diverges there): these are the
checkpoint hints. A head that falls after whitespace which history continues with more
whitespace moves back to where that whitespace starts: tokenizers merge a run of whitespace
into one token (Qwen's "\n" and "\n\n"), so the next prompt's tokens part there. One full
render plus one per hinted message and three more, so the cost is linear in the conversation.
Earlier messages need no hint: their checkpoints came from earlier turns, and a next turn
diverges near the end.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cairn.cluster.api.prep_pool import check

HINTED_MESSAGES = 8  # messages at the end of a conversation whose starts become checkpoint hints
REPLY = "cairn"  # stands for a reply and a next user turn when finding where history parts from a reply
RENDER_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "tools"})  # what `render` passes itself
JINJA_NAMES = frozenset({"self", "loop", "caller", "varargs", "kwargs", "super", "context"})


class TemplateError(ValueError):
    """The template refused these messages (or is itself broken)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not parse: {e}") from None
        self.source = source
        self._reserved = RENDER_ARGUMENTS | JINJA_NAMES | set(env.globals)

    def reserved_names(self, names: Any) -> list[str]:
        """Those of `names` that a caller may not set as template variables: the renderer's own
        arguments, Jinja's names and globals (`self`, `loop`, `namespace`, `raise_exception`,
        ...), and anything starting with an underscore."""
        return sorted(n for n in names if n in self._reserved or n.startswith("_"))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ChatTemplate":
        model_dir = Path(model_dir)
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.exists():
            return cls(jinja_file.read_text(encoding="utf-8"))
        config = model_dir / "tokenizer_config.json"
        try:
            source = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (FileNotFoundError, json.JSONDecodeError):
            source = None
        if not isinstance(source, str):
            raise TemplateError(f"{model_dir}: no chat_template.jinja and no chat_template in tokenizer_config.json")
        return cls(source)

    def message_starts(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                       tools: list[dict] | None = None, variables: dict[str, Any] | None = None,
                       stop: threading.Event | None = None) -> tuple[str, list[int]]:
        """The rendered text and the character offsets where each of the last `HINTED_MESSAGES`
        messages (and the generation prompt) starts, and, with a generation prompt, where the
        next turn's history parts from it (`_reply_head`): checkpoint hints for the prefix cache. A
        template may render earlier messages differently once later ones exist (dropped
        reasoning); an offset is then the longest common prefix with the full text, so a hint is
        never past the real start. A prefix the template refuses (some refuse a conversation
        without a user turn) gives no hint. `stop` set ends the work between two renders."""
        variables = variables or {}
        text = self._render(messages, add_generation_prompt, tools, variables)
        end = len(messages) + (1 if add_generation_prompt else 0)
        starts, generation = set(), None
        for i in range(max(1, end - HINTED_MESSAGES), end):
            check(stop)
            try:
                prefix = self._render(messages[:i], False, tools, variables)
            except TemplateError:
                continue
            starts.add(common_prefix_len(prefix, text))
            generation = common_prefix_len(prefix, text) if i == len(messages) else generation
        for i in dict.fromkeys((0, len(messages) - 1)) if messages else ():
            if isinstance(messages[i].get("content"), str) and messages[i]["content"]:
                check(stop)  # where the first and the newest message's content start: prompts sharing
                starts.add(self._content_head(messages, i, text, tools, variables))  # all before it part there
        if add_generation_prompt:
            check(stop)
            head = self._reply_head(messages, text, tools, variables)
            if head < len(text):  # (at the end: history keeps the generation prompt, whose end every prompt checkpoints)
                starts.discard(generation)  # the head is at or past it, and a next turn parts there
                starts.add(head)
        return text, sorted(starts)

    def _content_head(self, messages: list[dict[str, Any]], i: int, text: str, tools: list[dict] | None,
                      variables: dict[str, Any]) -> int:
        """Where message i's content starts (after its role header): the conversation with that
        message's content empty parts from `text` there (rendered up to it: the newest message
        without a generation prompt). A refusal gives 0 (no hint past the start)."""
        try:
            return common_prefix_len(self._render(messages[:i] + [dict(messages[i], content="")] + messages[i + 1:],
                                                  False, tools, variables), text)
        except TemplateError:
            return 0

    def _reply_head(self, messages: list[dict[str, Any]], text: str, tools: list[dict] | None,
                    variables: dict[str, Any]) -> int:
        """Where the generation prompt parts from the reply as this template writes it in
        history (a next turn's prompt): with reasoning dropped, a few characters into the
        generation prompt (`<think>` opened there, absent from history). A template refusing
        that conversation gives the text's end."""
        later = messages + [{"role": "assistant", "content": REPLY}, {"role": "user", "content": REPLY}]
        try:
            history = self._render(later, False, tools, variables)
        except TemplateError:
            return len(text)
        head = common_prefix_len(history, text)
        if 0 < head < len(history) and history[head].isspace() and text[head - 1].isspace():
            head = len(text[:head].rstrip())  # the whitespace before it merges with history's into one token
        return head

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **variables: Any) -> str:
        return self._render(messages, add_generation_prompt, tools, variables)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict] | None,
                variables: dict[str, Any]) -> str:
        clash = self.reserved_names(variables)
        if clash:
            raise TemplateError(f"template variables {clash} are reserved")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **variables)
        except TemplateError:
            raise
        except Exception as e:  # a sandbox refusal, a type error, a recursion limit: these messages did it
            raise TemplateError(f"chat template failed on these messages: {type(e).__name__}: {str(e)[:500]}") from None


def common_prefix_len(a: str, b: str, block: int = 4096) -> int:
    """Length of the longest common prefix, comparing blocks in C: linear, unlike a loop over
    characters (`os.path.commonprefix`), which costs a second per few million characters."""
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i + block <= n and a[i:i + block] == b[i:i + block]:
        i += block
    while i < n and a[i] == b[i]:
        i += 1
    return i
