"""Structured outputs at the ingress: what a request's output must match, compiled and checked
before any engine sees it; the engine enforces it token by token (cairn.workers.grammar).

Sources, at most one per request (a second is a 400 naming it):
- `response_format`: `{type: text}` (nothing), `{type: json_object}` (any JSON object), or
  `{type: json_schema, json_schema: {name, schema, strict?, description?}}`: the schema, enforced
  whether strict or not (as vLLM does);
- vLLM's `structured_outputs`: exactly one of `json` (a schema, or its text), `regex`, `choice`
  (a list of strings), `grammar` (Lark; GBNF or EBNF converted) or `json_object: true`, with
  `disable_any_whitespace` and `disable_additional_properties`; an unknown key is a 400 naming it;
- tool calls (chat only): `tool_choice` required or a named function, tools with `strict: true`,
  and with auto any call kept well formed (`tool_grammar`, in the model family's call format;
  `chat_completions` decides).
Whitespace in JSON is free (as vLLM's default) unless `disable_any_whitespace`.

A regex is too hard when its bounded repeats, expanded, spell out over `MAX_REGEX_POSITIONS`
(`regex_size`: llguidance builds automata lazily, so such a regex would fail mid-answer).
`GrammarCompiler.check(field, text)` validates a grammar with llguidance against the model's
tokenizer and computes its first mask (which builds its lexer), on a pool of its own (`prep_pool`'s rules: bounded threads, a share per tenant, a
503 when none comes free), within `grammar_compile_s`; a grammar over `max_grammar_chars`, one
that does not compile, or one that takes too long is a 400 naming `field`. Results, the errors
included, are cached by a hash of the grammar (the newest 256), so a client repeating a schema
pays once. A thread whose compile timed out stays taken until llguidance's fuel limits end it,
so slow grammars cannot pile up beyond the pool.

For a reasoning model the grammar applies to the content after the thinking (`Grammar.think`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from cairn.cluster.api.api_errors import APIError, bad_request
from cairn.cluster.api.limits import APILimits
from cairn.cluster.api.prep_pool import PrepPool
from cairn.cluster.api.prompts import Prepared
from cairn.cluster.api.text_tokenizer import TextTokenizer
from cairn.workers.grammar import Grammar, parser_limits

CACHED_CHECKS = 256
MAX_REGEX_POSITIONS = 65_536  # a regex's bounded repeats, expanded (regex_size)
SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
SO_OPTIONS = ("disable_any_whitespace", "disable_additional_properties")


def _schema_grammar(schema: Any, field: str, compact: bool = False, closed: bool = False) -> str:
    import llguidance

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request("is not JSON: a JSON Schema is a JSON object", field) from None
    if not isinstance(schema, dict):
        raise bad_request("a JSON Schema is a JSON object", field)
    if closed:
        schema = _closed(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": not compact})
    except (ValueError, TypeError) as e:
        raise bad_request(f"is not a usable JSON Schema: {e}", field) from None


def _closed(schema: Any) -> Any:
    """`disable_additional_properties`: every object schema without additionalProperties gets false."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def response_format_grammar(response_format: dict[str, Any] | None) -> tuple[str, str] | None:
    """(field, grammar) of a `response_format`, None for text or none."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", _schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("json_schema needs an object {name, schema, strict?}", "response_format.json_schema")
        if "schema" not in spec:
            raise bad_request("json_schema needs a schema", "response_format.json_schema.schema")
        return "response_format.json_schema.schema", _schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise bad_request(f"type must be text, json_object or json_schema, got {kind!r}", "response_format.type")


def structured_outputs_grammar(so: dict[str, Any] | None) -> tuple[str, str] | None:
    """(field, grammar) of vLLM's `structured_outputs`, None if absent."""
    if so is None:
        return None
    import llguidance

    for key in so:
        if key not in SO_KINDS + SO_OPTIONS + ("whitespace_pattern", "structural_tag"):
            raise bad_request(f"unknown key {key!r}; expected one of {', '.join(SO_KINDS + SO_OPTIONS)}",
                              f"structured_outputs.{key}")
    for key in ("whitespace_pattern", "structural_tag"):
        if so.get(key) is not None:
            raise bad_request("is not supported", f"structured_outputs.{key}", "unsupported")
    kinds = [k for k in SO_KINDS if so.get(k) is not None and so.get(k) is not False]
    if len(kinds) != 1:
        raise bad_request(f"give exactly one of {', '.join(SO_KINDS)}" + (f", not {' and '.join(kinds)}" if kinds else ""),
                          "structured_outputs")
    kind, value = kinds[0], so[kinds[0]]
    field = f"structured_outputs.{kind}"
    compact = so.get("disable_any_whitespace") is True
    if kind == "json":
        return field, _schema_grammar(value, field, compact, so.get("disable_additional_properties") is True)
    if kind == "json_object":
        return field, _schema_grammar({"type": "object"}, field, compact)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request("choice is a non-empty list of non-empty strings", field)
        return field, llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value) + "\n")
    if not isinstance(value, str) or not value:
        raise bad_request(f"{kind} is a non-empty string", field)
    if kind == "regex":
        check_regex_size(value, field)
        return field, llguidance.LLMatcher.grammar_from_regex(value)
    try:
        return field, llguidance.grammar_from("grammar", value)  # Lark as it is; GBNF converted
    except ValueError as e:
        raise bad_request(f"is not a Lark or GBNF grammar: {e}", field) from None


def regex_size(pattern: str) -> int | None:
    """How many positions `pattern` spells out with its bounded repeats expanded (a{1000} is
    1,000; an unbounded * or + counts once), or None if Python's parser cannot read it
    (llguidance's, which reads Rust's syntax, decides)."""
    try:
        import re._parser as sre_parse
    except ImportError:  # Python < 3.11
        import sre_parse  # type: ignore[no-redef]
    try:
        parsed = sre_parse.parse(pattern)
    except Exception:
        return None

    def size(items) -> int:
        total = 0
        for op, arg in items:
            name = str(op)
            if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
                lo, hi, sub = arg
                total += size(sub) * (max(lo, 1) if hi == sre_parse.MAXREPEAT else hi)
            elif name == "SUBPATTERN":
                total += size(arg[-1])
            elif name == "BRANCH":
                total += sum(size(b) for b in arg[1])
            elif name in ("ASSERT", "ASSERT_NOT"):
                total += size(arg[1])
            else:
                total += 1
        return total

    return size(parsed)


def check_regex_size(pattern: str, field: str) -> None:
    """A regex whose bounded repeats spell out more than MAX_REGEX_POSITIONS is too hard: its
    automaton is built lazily, so it would fail (out of fuel) mid-answer rather than at compile."""
    n = regex_size(pattern)
    if n is not None and n > MAX_REGEX_POSITIONS:
        raise bad_request(f"is too hard: its repeats spell out {n} positions, over {MAX_REGEX_POSITIONS}", field)


class GrammarCompiler:
    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, limits: APILimits):
        self._text_tokenizer, self.vocab_size, self.limits = tokenizer, vocab_size, limits
        self._ll = None
        self._ll_lock = threading.Lock()
        self.pool = PrepPool(limits.grammar_threads, limits.prepare_wait_s)
        self._checked: OrderedDict[str, str] = OrderedDict()  # hash -> "" (compiles) or the error
        # llguidance's view of the tokenizer takes about a second at 150k tokens: built now, in the
        # background, not by the first request that needs it
        threading.Thread(target=self._tokenizer, name="cairn-grammar-tokenizer", daemon=True).start()
        ids = tokenizer.tokenizer.token_to_id
        self.think = (ids("<think>"), ids("</think>")) if tokenizer.has_tokens("<think>", "</think>") else None
        self.tag_ids = (ids("<tool_call>"), ids("</tool_call>")) if tokenizer.has_tokens("<tool_call>", "</tool_call>") \
            else None

    def _tokenizer(self):
        with self._ll_lock:
            if self._ll is None:
                import llguidance

                tok = self._text_tokenizer.tokenizer
                # the ids the model can emit: its vocabulary, and every added token (Qwen's tool-call
                # tags sit past the tokenizer's own count, which would leave them out of range)
                n_vocab = max(self.vocab_size, tok.get_vocab_size(with_added_tokens=True),
                              1 + max(tok.get_added_tokens_decoder(), default=0))
                self._ll = llguidance.LLTokenizer(tok.to_str(), n_vocab=n_vocab)
            return self._ll

    def _validate(self, text: str) -> str:
        """'' or the error: the grammar is checked, then matched up to its first mask (llguidance
        builds its lexer lazily: a regex too hard to build fails there, within the fuel limits)."""
        import llguidance

        tokenizer = self._tokenizer()
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=parser_limits())
        if error:
            return error
        matcher = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
        if not matcher.is_error():
            matcher.compute_bitmask()
        return matcher.get_error() if matcher.is_error() else ""

    async def check(self, field: str, text: str, client_gone: Callable[[], Awaitable[None]],
                    tenant: str | None = None) -> None:
        """Raises a 400 naming `field` unless `text` compiles within the limits."""
        if len(text) > self.limits.max_grammar_chars:
            raise APIError(400, f"the grammar is {len(text)} characters compiled; this server accepts at most "
                                f"{self.limits.max_grammar_chars} (max_grammar_chars)", field, "limit_exceeded")
        key = hashlib.sha256(text.encode()).hexdigest()
        error = self._checked.get(key)
        if error is None:
            try:
                error = await asyncio.wait_for(self.pool.run(lambda stop: self._validate(text), client_gone, tenant),
                                               self.limits.grammar_compile_s)
            except TimeoutError:
                raise bad_request(f"the grammar did not compile within {self.limits.grammar_compile_s:g} s "
                                  f"(grammar_compile_s)", field) from None
            self._checked[key] = error
            while len(self._checked) > CACHED_CHECKS:
                self._checked.popitem(last=False)
        self._checked.move_to_end(key)
        if error:
            raise bad_request(f"does not compile: {error.strip().splitlines()[0][:300]}", field)

    def grammar(self, text: str, prompt: Prepared | None, reasoning_model: bool) -> Grammar:
        """The engine's grammar for `prompt` (None: a raw one): a reasoning model's thinking left
        free, unless the prompt closed it."""
        think = self.think if reasoning_model and prompt is not None and not prompt.closes_think else None
        return Grammar(text, think=think, thinking=think is not None and prompt.opens_think)
