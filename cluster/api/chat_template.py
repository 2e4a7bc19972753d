"""A model's own Jinja chat template, rendered with Hugging Face's semantics.

The template comes from `chat_template.jinja` or, failing that, `tokenizer_config.json`'s
`chat_template` in the checkpoint directory. Rendering matches transformers'
`apply_chat_template(..., tokenize=False)`: a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, a `tojson` filter that keeps non-ASCII text,
`raise_exception(msg)` and `strftime_now(fmt)`; extra keyword arguments (such as
`enable_thinking`) become template variables. A template error raises `TemplateError`, which
the API turns into a 400: it is the request's messages that the template refused.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
                       **kwargs: Any) -> tuple[str, list[int]]:
        """The rendered text and the character offsets where each message (and the generation
        prompt) starts: checkpoint hints for the prefix cache. A template may render earlier
        messages differently once later ones exist (dropped reasoning); an offset is then the
        longest common prefix with the full text, so a hint is never past the real start."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        starts = []
        for i in range(1, len(messages) + (1 if add_generation_prompt else 0)):
            prefix = self.render(messages[:i], add_generation_prompt=False, **kwargs)
            n = len(os.path.commonprefix([prefix, text]))
            starts.append(n)
        return text, sorted(set(starts))

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **kwargs: Any) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **kwargs)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateError(f"chat template failed on these messages: {e}") from None
