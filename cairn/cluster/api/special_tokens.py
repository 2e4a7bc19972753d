"""Special tokens stay the template's: text a client sends never becomes a control token.

A tokenizer splits its special tokens (`<|im_start|>`, `<|im_end|>`, ...) out of any text, so a
client who types `<|im_start|>system` into a message would open a real system turn. By default
the ingress prevents it. Before rendering, each occurrence of a special token's string in the
request's strings (message contents and parts, reasoning, names, tool calls, tool definitions,
template variables; dict keys too) becomes a placeholder: a lone surrogate code point, which no
JSON text can carry, so it cannot collide with the request (nor with the template's source,
which is checked). After rendering, the text is split at the special tokens that remain, the
template's own; each piece between them has its placeholders turned back into the strings they
stand for and is tokenized with special tokens read as plain text (`TextTokenizer.encode_pieces`),
which is how the tokenizer itself treats the text between special tokens. The prompt text that
reaches the engine has the real strings, and message offsets are mapped back to it.

A request with no special-token string in its text is tokenized exactly as before. Added tokens
that are not special (`<think>`, `<tool_call>`) are left alone: templates and parsers read them as
text. `APIOptions(special_tokens_in_content=True)` turns all of this off.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cairn.cluster.api.api_errors import bad_request

SURROGATES = range(0xD800, 0xE000)


def trie_pattern(words: list[str]) -> str:
    """A regex matching any of `words`, longest first at each position, in time linear in the
    text (one trie walk per position) however many words there are."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, Any]) -> str:
        ends = "" in node
        alts = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 and not ends else "(?:" + "|".join(alts) + ")"
        return body + "?" if ends else body

    return emit(trie)


class SpecialTokens:
    """The tokenizer's special tokens (string -> id) and the placeholders that may stand for them."""

    def __init__(self, ids: Mapping[str, int], template_source: str = ""):
        self.ids = dict(ids)
        self.pattern = re.compile(trie_pattern([w for w in self.ids if w])) if self.ids else None
        self.placeholders = [chr(c) for c in SURROGATES if chr(c) not in template_source]

    def masking(self) -> "Masking":
        return Masking(self)


@dataclass
class Unmasked:
    """A rendered prompt with its placeholders undone: the real text, its pieces in order (start,
    end, special token id or None for text), and where placeholders shifted offsets."""

    text: str
    pieces: list[tuple[int, int, int | None]]
    _masked_ends: list[int] = field(default_factory=list)
    _shifts: list[int] = field(default_factory=list)

    def real_offset(self, masked_offset: int) -> int:
        """An offset in the masked text, as an offset in the real text."""
        k = bisect_right(self._masked_ends, masked_offset)
        return masked_offset + (self._shifts[k - 1] if k else 0)


class Masking:
    """One request's placeholders: `mask` its values, render, then `unmask` the text."""

    def __init__(self, specials: SpecialTokens):
        self._specials = specials
        self.literal: dict[str, str] = {}  # placeholder -> the special token's string
        self._placeholder: dict[str, str] = {}

    @property
    def used(self) -> bool:
        return bool(self.literal)

    def mask(self, value: Any) -> Any:
        """A copy of a JSON-like value with every special-token string in its strings replaced."""
        if self._specials.pattern is None:
            return value
        if isinstance(value, str):
            return self._specials.pattern.sub(self._stand_in, value)
        if isinstance(value, dict):
            return {self.mask(k): self.mask(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.mask(v) for v in value]
        return value

    def _stand_in(self, match: re.Match[str]) -> str:
        token = match.group()
        if token not in self._placeholder:
            free = self._specials.placeholders
            if len(self.literal) >= len(free):
                raise bad_request(f"the request's text holds more than {len(free)} different special-token "
                                  f"strings", "messages")
            stand_in = free[len(self.literal)]
            self._placeholder[token], self.literal[stand_in] = stand_in, token
        return self._placeholder[token]

    def unmask(self, masked: str) -> Unmasked:
        """Splits `masked` at the template's special tokens and undoes the placeholders."""
        assert self._specials.pattern is not None
        marks = re.compile(self._specials.pattern.pattern + "|[" + "".join(self.literal) + "]")
        parts: list[str] = []
        pieces: list[tuple[int, int, int | None]] = []
        masked_ends, shifts = [], []
        at_masked = at_real = piece_start = 0
        for m in marks.finditer(masked):
            gap = masked[at_masked:m.start()]
            parts.append(gap)
            at_real += len(gap)
            token = m.group()
            literal = self.literal.get(token)
            if literal is not None:
                parts.append(literal)
                at_real += len(literal)
                masked_ends.append(m.end())
                shifts.append(at_real - m.end())
            else:
                if at_real > piece_start:
                    pieces.append((piece_start, at_real, None))
                parts.append(token)
                pieces.append((at_real, at_real + len(token), self._specials.ids[token]))
                at_real += len(token)
                piece_start = at_real
            at_masked = m.end()
        parts.append(masked[at_masked:])
        at_real += len(masked) - at_masked
        if at_real > piece_start:
            pieces.append((piece_start, at_real, None))
        return Unmasked("".join(parts), pieces, masked_ends, shifts)
