"""Structured outputs on the engine: a request's grammar, and the tokens it allows at each step.

Contract:
- `Grammar`, a field of `SamplingParams`, is a grammar in llguidance's format (what
  `cairn.cluster.api.structured` makes of a request's response_format, structured_outputs or forced
  tool call), and how it meets a reasoning model's thinking: with `think` = (start, end) token
  ids, output that opens with the start tag is reasoning, unconstrained, up to the first end tag
  (with `thinking`, the prompt opened it: the output is reasoning from its first token); the
  grammar constrains what follows, as vLLM does for its reasoning parsers. At the first token
  of a model that may think, the start tag is allowed beside what the grammar allows. While it
  thinks, every token is allowed but the end-of-sequence ones: a constrained output never ends
  inside its thinking, so what it answers always matches. Output past the grammar's end (an
  end-of-sequence token that `ignore_eos` went past) is free.
- `Grammars` (one per engine, from the model's tokenizer): `prepare(grammar)` compiles in a
  background thread (the engine holds a request back until its grammar compiled: a slow grammar
  stalls no other request) (compiled grammars are kept by a hash of their text, the newest
  `CACHED_GRAMMARS`; each request matches with a copy); `mask(seq)` returns the sequence's allowed
  next tokens as a packed bitmask (int32 words, bit j of word i is token 32 i + j). The sequence's matcher is first brought up to its output: the tokens accepted
  since the last step are consumed, and tokens the sequence no longer holds (a preemption that
  dropped output) are rolled back, so the matcher never holds state its sequence does not.
- Faults stay in their row: a grammar that does not compile (the ingress validated it, so only a
  direct engine user sees this) or a matcher in error raises from `mask`, which the sampler turns
  into that row's `SequenceFault`.
- The library: llguidance (`LLGuidance`): no ahead-of-time lexer over the vocabulary (a grammar
  compiles in milliseconds, masks take tens of microseconds), no dependency beyond its wheel,
  Lark with JSON schemas inline (what forced tool calls need), and fuel limits on every step.
  Another library plugs in as a `Backend` (compile text to a matcher; copy, fill a mask,
  consume, roll back, report an error).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

CACHED_GRAMMARS = 64


@dataclass(frozen=True)
class Grammar:
    text: str                              # llguidance's grammar (Lark, or its JSON form)
    think: tuple[int, int] | None = None   # (start, end) ids of a reasoning model's tags
    thinking: bool = False                 # the prompt opened the start tag

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ValueError("a grammar is a non-empty string")
        if self.think is not None and (len(self.think) != 2 or not all(isinstance(t, int) for t in self.think)):
            raise ValueError("think is (start, end) token ids")

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


class GrammarError(ValueError):
    """A grammar that does not compile, or a matcher that left its grammar."""


class Matcher(Protocol):
    def copy(self) -> "Matcher": ...
    def fill(self, words: np.ndarray) -> None: ...        # the allowed next tokens, into int32 words
    def consume(self, tokens: list[int]) -> None: ...     # raises GrammarError when forbidden
    def rollback(self, count: int) -> None: ...


class Backend(Protocol):
    def compile(self, text: str) -> Matcher: ...          # raises GrammarError


class LLGuidance:
    """llguidance over a `tokenizer.json` (its text)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import llguidance

        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)

    def compile(self, text: str) -> "_LLMatcher":
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
        if m.is_error():
            raise GrammarError(m.get_error())
        return _LLMatcher(m)


def parser_limits():
    """llguidance's fuel limits, the same on the ingress (which validates) and the engine: a
    grammar that stays inside them when validated stays inside them at every step."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


class _LLMatcher:
    def __init__(self, m):
        self.m = m

    def copy(self) -> "_LLMatcher":
        return _LLMatcher(self.m.deep_copy())

    def fill(self, words: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        self._check()

    def consume(self, tokens: list[int]) -> None:
        if tokens and not self.m.consume_tokens(tokens):
            self._check()
            raise GrammarError("the output left its grammar")

    def rollback(self, count: int) -> None:
        if count and not self.m.rollback(count):
            self._check()
            raise GrammarError(f"could not roll the grammar back {count} tokens")

    def _check(self) -> None:
        if self.m.is_error():
            raise GrammarError(self.m.get_error())


class _State:
    """One sequence's place in its grammar."""

    def __init__(self, matcher: Matcher):
        self.matcher = matcher
        self.start: int | None = None  # output index where the grammar begins (None: still thinking)
        self.scanned = 0               # output tokens searched for the end tag
        self.consumed = 0              # output tokens from `start` the matcher holds
        self.ended = False             # an end-of-sequence token went by (ignore_eos): the rest is free


class Grammars:
    def __init__(self, backend: Backend | Future, vocab_size: int, eos_token_ids: tuple[int, ...] = ()):
        self._backend = backend
        self.words = -(-vocab_size // 32)
        self._eos = frozenset(eos_token_ids)
        self._free = np.full(self.words, -1, np.int32)  # every token
        self._thinking = self._free.copy()  # every token but the end ones
        for t in eos_token_ids:
            self._thinking.view(np.uint32)[t // 32] &= ~np.uint32(1 << (t % 32))
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cairn-grammar")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Future] = OrderedDict()

    @classmethod
    def for_model(cls, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> "Grammars | None":
        """From the tokenizer in `model_dir`, loaded in the background; None without one."""
        if not (Path(model_dir) / "tokenizer.json").exists():
            return None

        def load() -> Backend:
            from tokenizers import Tokenizer

            return LLGuidance(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).to_str(), vocab_size,
                              eos_token_ids)

        grammars = cls(Future(), vocab_size, eos_token_ids)
        grammars._backend = grammars._pool.submit(load)
        return grammars

    def _backend_now(self) -> Backend:
        return self._backend.result() if isinstance(self._backend, Future) else self._backend

    def prepare(self, grammar: Grammar) -> Future:
        """Compiles `grammar` in the background unless it is cached; its future."""
        key = grammar.key
        with self._lock:
            done = self._compiled.get(key)
            if done is None or (done.done() and done.exception() is not None):
                done = self._compiled[key] = self._pool.submit(lambda: self._backend_now().compile(grammar.text))
            self._compiled.move_to_end(key)
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return done

    def mask(self, seq, draft: list[int] | tuple[int, ...] = ()) -> np.ndarray:
        """The allowed next tokens of `seq` (a `Sequence` whose params carry a grammar) as int32
        words; raises GrammarError. With `draft` (speculative decoding: tokens proposed after its
        output), the tokens allowed after the output and the draft: the matcher steps through
        the drafted tokens, then rolls back to the output, so it never holds a token its
        sequence does not. Where a drafted token is not allowed after those before it, the
        mask is the one there: no row past it can be kept, as the token drawn there is not it."""
        words = self._mask(seq, seq.output_token_ids)
        if not draft:
            return words
        state: _State = seq.grammar_state
        held = (state.start, state.scanned, state.consumed, state.ended)
        try:
            out = list(seq.output_token_ids)
            for token in draft:
                if not words.view(np.uint32)[token // 32] >> np.uint32(token % 32) & 1:
                    break
                out.append(token)
                words = self._mask(seq, out)
        finally:
            state.matcher.rollback(state.consumed - held[2])
            state.start, state.scanned, state.consumed, state.ended = held
        return words

    def _mask(self, seq, out: list[int]) -> np.ndarray:
        """`mask` after `out` (the sequence's output, or that and drafted tokens)."""
        grammar: Grammar = seq.params.grammar
        state: _State | None = seq.grammar_state
        if state is None:
            state = seq.grammar_state = _State(self.prepare(grammar).result().copy())
        if state.start is not None and len(out) < state.start:  # preempted back into the thinking
            state.matcher.rollback(state.consumed)
            state.start, state.scanned, state.consumed = None, 0, 0
        opening = False
        if state.start is None:
            think = grammar.think
            if think is None:
                state.start = 0
            elif not grammar.thinking and not out:
                opening = True  # the first token: the start tag or the grammar's
            elif not grammar.thinking and out[0] != think[0]:
                state.start = 0
            else:
                state.scanned = min(state.scanned, len(out))
                try:
                    state.start = out.index(think[1], state.scanned) + 1
                except ValueError:
                    state.scanned = len(out)
                    return self._thinking.copy()
        if state.start is not None:
            held = len(out) - state.start
            if held < state.consumed or (state.ended and held <= state.consumed):  # tokens dropped
                state.matcher.rollback(state.consumed - min(held, state.consumed))
                state.consumed, state.ended = min(held, state.consumed), False
            if not state.ended:
                new = out[state.start + state.consumed:]
                end = next((i for i, t in enumerate(new) if t in self._eos), None)
                state.matcher.consume(new if end is None else new[:end])
                state.consumed += len(new) if end is None else end  # the matcher holds what precedes an end
                state.ended = end is not None
            if state.ended:
                return self._free.copy()
        words = np.zeros(self.words, np.int32)
        state.matcher.fill(words)
        if opening:
            start = grammar.think[0]
            words.view(np.uint32)[start // 32] |= np.uint32(1 << (start % 32))
        return words
