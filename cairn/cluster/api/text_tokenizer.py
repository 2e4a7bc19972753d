"""The model's tokenizer as the API uses it: text to ids, ids back to text piece by piece.

`TextTokenizer.encode_with_ends` also returns where each token ends in the text (characters),
which turns the chat template's message offsets into token positions (checkpoint hints): a
hint counts the tokens that end at or before the offset, so it is never past the real start.
`encode_pieces` tokenizes a text already split at its special tokens, reading special-token
strings inside the pieces as plain text (`special_tokens`: how client text is kept from
becoming control tokens).

`max_chars_per_token` bounds the characters one token covers, so a text that cannot fit a
context is known before it is tokenized (`prompts`).

`Detokenizer` turns a stream of token ids into text increments. A byte-level tokenizer splits
multi-byte UTF-8 characters across tokens; an increment never ends in a half character (no
U+FFFD for an incomplete sequence): the bytes wait for the token that completes them, and
`flush` gives out whatever is left when the stream ends. Text is decoded over a short window
of earlier tokens, so tokenizers whose pieces depend on their neighbours (leading spaces)
decode as they would in one piece.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import Encoding, Tokenizer, decoders

REPLACEMENT = "\ufffd"


@lru_cache(maxsize=1)
def byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the byte each character of a token stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TextTokenizer":
        return cls(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")))

    @cached_property
    def _as_text(self) -> Tokenizer:
        """A copy that reads special-token strings as plain text (a flag of the tokenizer, so
        not to be toggled on the one every thread shares)."""
        copy = Tokenizer.from_str(self.tokenizer.to_str())
        copy.encode_special_tokens = True
        return copy

    @cached_property
    def max_chars_per_token(self) -> int | None:
        """At most how many characters of the text one token covers, normalization included:
        the longest piece of the vocabulary or added token (a byte-level piece is one character
        per byte, and a character is at least one byte), times 3 after a composing normalizer
        (NFC, NFKC: Hangul jamo compose three to one). None for a normalizer that may drop text,
        about which nothing is certain."""
        spec = json.loads(self.tokenizer.to_str())
        factor = _normalizer_factor(spec.get("normalizer"))
        if factor is None:
            return None
        pieces = [*self.tokenizer.get_vocab(with_added_tokens=False), *self._added.values()]
        return factor * max((len(p) if self._byte_level else len(p.encode()) for p in pieces), default=1)

    def special_tokens(self) -> dict[str, int]:
        """Each special token's string and id (the control tokens, not every added token)."""
        return {self._added[i]: i for i in self._special}

    def has_tokens(self, *contents: str) -> bool:
        return all(self.tokenizer.token_to_id(c) is not None for c in contents)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._encode(text, add_special_tokens).ids

    def _encode(self, text: str, add_special_tokens: bool) -> Encoding:
        # encode_batch lets go of the GIL while it works (encode does not), so a long prompt
        # tokenized on a pool thread does not stall the event loop
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def encode_with_ends(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of `text` and, per token, the character offset where it ends."""
        enc = self._encode(text, False)
        ends, last = [], 0
        for _, end in enc.offsets:
            last = max(last, end)
            ends.append(last)
        return enc.ids, ends

    def encode_pieces(self, text: str, pieces: Sequence[tuple[int, int, int | None]]) -> tuple[list[int], list[int]]:
        """Like `encode_with_ends` for `text` cut into pieces (start, end, special token id or None):
        a special piece is its one token, a text piece is tokenized on its own with any
        special-token string in it read as plain text."""
        spans = [(start, end) for start, end, special in pieces if special is None]
        encoded = iter(self._as_text.encode_batch([text[a:b] for a, b in spans], add_special_tokens=False))
        ids: list[int] = []
        ends: list[int] = []
        for start, end, special in pieces:
            if special is not None:
                ids.append(special)
                ends.append(end)
                continue
            enc = next(encoded)
            last = start
            for _, e in enc.offsets:
                last = max(last, start + e)
                ends.append(last)
            ids.extend(enc.ids)
        return ids, ends

    @staticmethod
    def token_positions(ends: Sequence[int], char_offsets: Sequence[int]) -> list[int]:
        """Token positions of character offsets (tokens ending at or before each offset)."""
        return [bisect_right(ends, c) for c in char_offsets]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a piece of a UTF-8 character for some tokens)."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = byte_of_char()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs (U+FFFD where it holds part of a character)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def detokenizer(self, prompt_token_ids: Sequence[int] = ()) -> "Detokenizer":
        return Detokenizer(self, prompt_token_ids)


def _normalizer_factor(normalizer: dict | None) -> int | None:
    """How many characters of the input a normalizer may turn into one (None: unbounded)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", ()):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    return {"NFC": 3, "NFKC": 3, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}.get(kind)


class Detokenizer:
    CONTEXT_TOKENS = 4  # prompt tokens decoded along with the first output tokens

    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self._ids = list(prompt_token_ids[-self.CONTEXT_TOKENS:])
        self._prefix = 0              # window start: tokens decoded only as context
        self._read = len(self._ids)   # tokens whose text has been given out
        self.text = ""                # everything given out so far

    def push(self, token_ids: Sequence[int]) -> str:
        """Text that `token_ids` complete; holds back an unfinished character."""
        out = []
        for t in token_ids:
            self._ids.append(t)
            before = self._tok.decode(self._ids[self._prefix:self._read])
            now = self._tok.decode(self._ids[self._prefix:])
            if len(now) > len(before) and not now.endswith(REPLACEMENT):
                out.append(now[len(before):])
                self._prefix, self._read = self._read, len(self._ids)
        piece = "".join(out)
        self.text += piece
        return piece

    def flush(self) -> str:
        """What is held back when the stream ends (an unfinished character decodes as U+FFFD)."""
        before = self._tok.decode(self._ids[self._prefix:self._read])
        now = self._tok.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        piece = now[len(before):] if len(now) > len(before) else ""
        self.text += piece
        return piece
