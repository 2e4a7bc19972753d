"""Structured outputs on the real engine: the demo models' random weights are the ideal adversary,
so every constrained output that ends must parse and validate.

- Generated JSON schemas (objects, arrays, enums, bounded numbers, nested required fields) and
  regexes, greedy rows beside sampled and penalised ones in one batch.
- The same under preemption (a cache too small for all), and cached == cold with constraints.
- A reasoning model's thinking stays free, and the answer after it matches; the output never
  ends inside the thinking.
- A grammar that does not compile faults its row alone; the matcher rolls back dropped tokens.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import llguidance
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from cairn.workers import Engine, SamplingParams
from cairn.workers.grammar import Grammar, Grammars
from cairn.workers.sequence import Sequence

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def engine(demo_model):
    return Engine.from_pretrained(demo_model("qwen3_next"), num_pages=256, max_num_seqs=8)


@pytest.fixture(scope="module")
def tok(demo_model):
    return Tokenizer.from_file(str(demo_model("qwen3_next") / "tokenizer.json"))


def run(engine, requests):
    """[(prompt ids, params)] -> outputs in order, each (token ids, finish reason); fails if the
    engine does not finish them within a bounded number of steps."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    done, steps, deadline = {}, 0, time.monotonic() + 120
    while steps < 20 * MAX_TOKENS and time.monotonic() < deadline:
        if not engine.has_runnable():  # held while a grammar compiles in the background
            time.sleep(0.002)
            continue
        steps += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.token_ids or ()), out.finish_reason)
        if all(i in done for i in ids):
            return [done[i] for i in ids]
    raise AssertionError(f"{sum(i not in done for i in ids)} requests did not finish")


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def mixes(grammar, n=4, seed=0):
    """Greedy, sampled, top-k/top-p and penalised rows, all with `grammar`."""
    base = dict(max_tokens=MAX_TOKENS, grammar=grammar)
    kinds = [dict(temperature=0), dict(temperature=1.0, seed=seed), dict(temperature=0.8, top_k=20, top_p=0.9,
                                                                          seed=seed + 1),
             dict(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.3, seed=seed + 2)]
    return [SamplingParams(**base, **kinds[i % len(kinds)]) for i in range(n)]


# ---- generated schemas and regexes ---------------------------------------------------------------
names = st.text(alphabet="abcdefgh_", min_size=1, max_size=6)
leaf = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.lists(st.text(alphabet="xyz ", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
)


def objects(children):
    return st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False}))


schemas = st.recursive(leaf, lambda children: st.one_of(
    objects(children), st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                                 children, st.integers(0, 3))), max_leaves=5)
regexes = st.lists(st.sampled_from([r"[a-c]{2}", r"-", r"[0-9]{1,3}", r"(yes|no)", r"x?", r"[A-Z]", r"\.", r"(ab){1,2}"]),
                   min_size=1, max_size=5).map("".join)


def schema_grammar(schema):
    return Grammar(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=schemas)
def test_every_output_of_a_generated_schema_validates(engine, tok, schema):
    outs = run(engine, [(tok.encode("Tell me in JSON.").ids, sp) for sp in mixes(schema_grammar(schema))])
    finished = 0
    for ids, reason in outs:
        if reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(text_of(tok, ids)), schema)
    assert finished >= 2, (schema, outs)  # bounded schemas end well within MAX_TOKENS


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(regex=regexes)
def test_every_output_of_a_generated_regex_matches(engine, tok, regex):
    grammar = Grammar(llguidance.LLMatcher.grammar_from_regex(regex))
    outs = run(engine, [(tok.encode("Say it.").ids, sp) for sp in mixes(grammar)])
    for ids, reason in outs:
        assert reason == "stop", (regex, outs)  # a regex without unbounded parts always ends
        assert re.fullmatch(regex, text_of(tok, ids)), (regex, text_of(tok, ids))


def test_constrained_rows_beside_free_ones_leave_the_free_ones_as_they_were(engine, tok):
    prompt = tok.encode("Free text please.").ids
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    alone = run(engine, [(prompt, free)])
    grammar = schema_grammar({"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                              "additionalProperties": False})
    mixed = run(engine, [(prompt, free)] + [(prompt, sp) for sp in mixes(grammar)])
    assert mixed[0] == alone[0]
    for ids, reason in mixed[1:]:
        assert reason == "stop" and json.loads(text_of(tok, ids)) in ({"a": True}, {"a": False})


# ---- preemption and the prefix cache --------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "tags", "n"], "additionalProperties": False}


def test_seeded_constrained_outputs_are_the_same_alone_preempted_and_cached(demo_model, tok):
    grammar = schema_grammar(SCHEMA)
    prompts = [tok.encode(f"Question {i}: name a cairn.").ids for i in range(4)]
    params = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, grammar=grammar) for s in range(4)]
    model = demo_model("qwen3_next")
    roomy = Engine.from_pretrained(model, num_pages=256, page_size=4, max_num_seqs=4)
    cold = [run(roomy, [(p, sp)])[0] for p, sp in zip(prompts, params)]
    cached_before = roomy.stats.cached_tokens
    assert run(roomy, list(zip(prompts, params))) == cold  # the prompts' pages are cached now
    assert roomy.stats.cached_tokens > cached_before
    # the prompts fit the pool together; their outputs do not, so decodes preempt
    tight = Engine.from_pretrained(model, num_pages=16, page_size=4, max_num_seqs=4)
    assert run(tight, list(zip(prompts, params))) == cold
    assert tight.stats.preemptions > 0
    for ids, reason in cold:
        if reason == "stop":
            jsonschema.validate(json.loads(text_of(tok, ids)), SCHEMA)


# ---- reasoning ------------------------------------------------------------------------------------
def test_a_reasoning_models_thinking_is_free_and_its_answer_matches(demo_model):
    model = demo_model("qwen3_5")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    engine = Engine.from_pretrained(model, num_pages=256, max_num_seqs=8)
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    # the prompt opened <think>: the output thinks until </think>, then answers in JSON
    prompt = tok.encode("<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n<think>\n").ids
    thinking = Grammar(text, think=(start, end), thinking=True)
    # </think> costs the random model a while: push it there with a bias, later in the output
    outs = run(engine, [(prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, grammar=thinking,
                                                logit_bias=((end, 4.0),))) for s in range(4)])
    for ids, reason in outs:
        assert end in ids, "the output ended inside its thinking"
        answer = ids[ids.index(end) + 1:]
        assert reason == "stop" and json.loads(text_of(tok, answer)) in ({"ok": True}, {"ok": False})
    # without the prompt opening it, the first token may open the thinking, or answer at once
    may = Grammar(text, think=(start, end), thinking=False)
    seq = Sequence("s", prompt, SamplingParams(grammar=may))
    engine.sampler.grammars.prepare(may).result()
    words = engine.sampler.grammars.mask(seq)
    allowed = {t for t in range(engine.spec.vocab_size) if (int(words[t // 32]) >> (t % 32)) & 1}
    assert start in allowed and len(allowed) >= 2
    assert all(t == start or tok.decode([t]).startswith("{") for t in allowed)


# ---- faults and rollback --------------------------------------------------------------------------
def test_a_grammar_that_does_not_compile_faults_its_row_alone(engine, tok):
    prompt = tok.encode("hello").ids
    bad = SamplingParams(max_tokens=8, grammar=Grammar("start: nothing_defined"))
    good = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (bad_ids, bad_reason), (good_ids, good_reason) = run(engine, [(prompt, bad), (prompt, good)])
    assert bad_reason == "error" and good_reason == "length" and len(good_ids) == 8


def test_an_engine_without_a_tokenizer_refuses_a_grammar(engine):
    from cairn.workers.engine_errors import RequestRejected

    grammars, engine.sampler.grammars = engine.sampler.grammars, None
    try:
        with pytest.raises(RequestRejected) as e:
            engine.add_request([1, 2, 3], SamplingParams(grammar=Grammar("start: \"a\"")))
        assert e.value.param == "grammar"
    finally:
        engine.sampler.grammars = grammars


def test_the_matcher_follows_its_sequence_back_and_forth(engine, tok):
    grammars: Grammars = engine.sampler.grammars
    grammar = Grammar(llguidance.LLMatcher.grammar_from_regex("abc|abd"))
    seq = Sequence("r", [1, 2], SamplingParams(grammar=grammar))

    def allowed():
        words = grammars.mask(seq)
        return {tok.id_to_token(t) for t in range(engine.spec.vocab_size) if (int(words[t // 32]) >> (t % 32)) & 1}

    a, b, c = (tok.token_to_id(x) for x in "abc")
    seq.token_ids += [a, b]
    assert {"c", "d"} <= allowed() and "a" not in allowed()
    seq.token_ids += [c]
    assert allowed() <= {"<|im_end|>", "<|endoftext|>"}
    del seq.token_ids[-2:]  # as if a preemption dropped the last two
    assert "b" in allowed() and "c" not in allowed()


def test_a_slow_grammar_holds_its_own_request_and_no_other(engine, tok):
    """While a grammar compiles, its sequence is held; other requests step on."""
    import threading

    grammars: Grammars = engine.sampler.grammars
    backend, gate = grammars._backend_now(), threading.Event()

    class Slow:
        def compile(self, text):
            gate.wait(30)
            return backend.compile(text)

    grammars._backend = Slow()
    try:
        grammar = Grammar(llguidance.LLMatcher.grammar_from_regex("slow[0-9]"))
        slow = engine.add_request(tok.encode("wait").ids, SamplingParams(max_tokens=8, grammar=grammar))
        free = engine.add_request(tok.encode("go").ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        dropped = engine.add_request(tok.encode("never").ids, SamplingParams(max_tokens=8, grammar=grammar))
        assert engine.abort(dropped).finish_reason == "abort"  # a held request aborts like any other
        outputs = {}
        for _ in range(20):
            for out in engine.step():
                outputs.setdefault(out.request_id, []).append(out)
            if any(o.finished for o in outputs.get(free, [])):
                break
        assert any(o.finished for o in outputs[free]) and slow not in outputs  # it waited, alone
        assert dropped not in outputs
        assert not engine.has_runnable() and engine.has_unfinished()  # held: nothing to step for
        woken = threading.Event()
        engine.on_runnable = woken.set
        gate.set()
        assert woken.wait(30)  # the compile's end wakes whoever steps the engine
        for _ in range(200):
            finished = [o for o in engine.step() if o.request_id == slow and o.finished]
            if finished:
                assert text_of(tok, finished[0].token_ids) in {f"slow{d}" for d in range(10)}
                break
        else:
            raise AssertionError("the held request never finished")
    finally:
        grammars._backend, engine.on_runnable = backend, None


def test_ignore_eos_goes_on_past_the_grammars_end_freely(engine, tok):
    grammar = Grammar(llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"'))
    eos = tok.token_to_id("<|im_end|>")
    (ids, reason), = run(engine, [(tok.encode("Answer.").ids,
                                   SamplingParams(max_tokens=12, temperature=1.0, seed=3, grammar=grammar,
                                                  ignore_eos=True))])
    assert reason == "length" and len(ids) == 12 and eos in ids  # the answer, its end, then free tokens
    assert text_of(tok, ids[:ids.index(eos)]) in ("yes", "no")
