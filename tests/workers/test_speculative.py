"""Speculative decoding (`num_speculative_tokens`, cairn.workers.speculative) changes how many
tokens a step yields, never which: against the same engine with k = 0, every request gets the
same tokens (greedy, and seeded sampled rows, whose draws are made at (seed, output index)), the
same logprobs, finish reasons and `cached_tokens`, and the cache holds the same pages and
checkpoints, with the same bytes, afterwards. In the exact mode (`speculative_exact`: drafted
tokens verified as decode rows, through the per-token kernels) all of it is bit for bit wherever
each op's rows do not depend on the batch's other rows: on this CPU every op in bf16 (what `auto`
serves here), and every one but the MoE experts' fp32 matmuls (MKL's sgemm) in fp32; so the MoE
family is held to it in bf16. The default mode verifies them as one chunk of the prefill path: in
fp32 it is held to the same tokens and logprobs within 1e-4 (in bf16 a near-tie can flip:
benchmarks/speculative.py reports how often).

The drafts come from a scripted drafter (tests/support/drafters.py) that knows the k = 0 run's
continuations and gets a share of its tokens wrong on purpose, so the tests control what is
kept: all, some, none. The checkpoint's own MTP head (a random one: it drafts, and the target
rejects nearly all of it) runs end to end in its own test."""

import pytest
import torch

from cairn.workers import Engine, SamplingParams
from tests.support.stepping import drive, run_alone
from cairn.workers.engine_options import EngineOptionError
from tests.support.drafters import ScriptedDrafter

ARCHS = ["qwen3_next", "qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def spec_model(tmp_path_factory):
    """`spec_model(arch)`: the tiny demo checkpoint of `arch` with a random MTP head."""
    from cairn.workers.demo import write_demo_model

    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = write_demo_model(tmp_path_factory.mktemp(f"spec-{arch}"), size="tiny", arch=arch, mtp=True)
        return made[arch]
    return get


def prompts(lengths, vocab=211, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def speculating(path, k: int, continuations, wrong: float, **options) -> Engine:
    engine = Engine.from_pretrained(path, num_speculative_tokens=k,
                                    **{"speculative_exact": True, "speculative_adaptive": False, **options})
    engine.drafter = ScriptedDrafter(continuations, engine.spec.vocab_size, wrong)
    return engine


def assert_same(expected: list, got: list, atol: float = 0.0) -> None:
    for i, (a, b) in enumerate(zip(expected, got)):
        assert (b.token_ids, b.finish_reason, b.cached_tokens) == (a.token_ids, a.finish_reason, a.cached_tokens), \
            f"request {i}"
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs:
            assert [[t for t, _ in lp.top] for lp in b.logprobs] == [[t for t, _ in lp.top] for lp in a.logprobs]
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in b.logprobs]),
                                       torch.tensor([lp.logprob for lp in a.logprobs]), atol=atol, rtol=0)


def assert_cache_same(plain: Engine, spec: Engine, atol: float = 0.0) -> None:
    """The same pages and checkpoints on both tiers, and on the device the same bytes in them:
    each page's K/V in every attention layer, each checkpoint's conv and delta-rule states."""
    for engine in (plain, spec):
        engine.check()
        assert engine.cache.pages.num_held == 0
    assert spec.cache_contents() == plain.cache_contents()
    assert spec.host_contents() == plain.host_contents()
    pages, states = plain.cache_contents()
    for page_hash in pages:
        a, b = (e.cache.pages.page_of(page_hash) for e in (plain, spec))
        if a is None:  # on the host tier alone (both: the contents are equal)
            continue
        for (ka, va), (kb, vb) in zip(plain.runner.caches.kv, spec.runner.caches.kv):
            torch.testing.assert_close(kb[b], ka[a], atol=atol, rtol=0)
            torch.testing.assert_close(vb[b], va[a], atol=atol, rtol=0)
    for key in states:
        a, b = (e.cache.checkpoints.get(key) for e in (plain, spec))
        if a is None:
            continue
        for pool in ("conv_states", "ssm_states"):
            torch.testing.assert_close(getattr(spec.runner.caches, pool)[b.slot],
                                       getattr(plain.runner.caches, pool)[a.slot], atol=atol, rtol=0)


def continuations(requests, outputs) -> list[list[int]]:
    return [p + o.token_ids for (p, _), o in zip(requests, outputs)]


MODES = {"exact": dict(dtype="bfloat16", speculative_exact=True),
         "default-fp32": dict(dtype="float32", speculative_exact=False)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_output_is_the_same_with_drafts_kept_and_rejected(spec_model, arch, batch, mode):
    path = spec_model(arch)
    requests = [(p, SamplingParams(max_tokens=40 + i % 5, temperature=0, ignore_eos=True, logprobs=2))
                for i, p in enumerate(prompts([5 + 3 * i for i in range(batch)], seed=batch))]
    options = dict(page_size=8, num_pages=256, max_num_seqs=16, cache_policy="all", dtype=MODES[mode]["dtype"])
    atol = 0.0 if mode == "exact" else 1e-4
    plain = Engine.from_pretrained(path, **options)
    expected = drive(plain, requests)
    for k in (1, 2, 3):
        spec = speculating(path, k, continuations(requests, expected), wrong=0.3, **options,
                           speculative_exact=MODES[mode]["speculative_exact"])
        got = drive(spec, requests)
        assert_same(expected, got, atol)
        assert_cache_same(plain, spec, atol)
        s = spec.speculation
        assert 0 < s.accepted_tokens < s.draft_tokens, "some drafts kept, some rejected"
        assert s.accepted_by_position[k - 1] > 0, "drafts kept at every position"
        assert spec.stats.steps < plain.stats.steps
        assert spec.stats.generated_tokens == plain.stats.generated_tokens


def test_a_rejected_draft_leaves_no_trace(spec_model):
    """Every draft wrong: each verify step keeps only its first token, so every state, page,
    checkpoint and hash a rejected token touched must have been rolled back or never made. With
    checkpoints at every page boundary (`all`) and pages of 4 tokens, drafts cross boundaries all
    the time. The next turn resumes as deep, with the same tokens, as with k = 0."""
    path = spec_model("qwen3_5")
    requests = [(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1))
                for p in prompts([13, 22, 7], seed=4)]
    options = dict(page_size=4, num_pages=256, max_num_seqs=4, cache_policy="all")
    plain = Engine.from_pretrained(path, **options)
    expected = drive(plain, requests)
    spec = speculating(path, 3, continuations(requests, expected), wrong=1.0, **options)
    got = drive(spec, requests)
    assert spec.speculation.draft_tokens > 60 and spec.speculation.accepted_tokens == 0
    assert_same(expected, got)
    assert_cache_same(plain, spec)
    turn = [(p + o.token_ids + [3, 1, 4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1))
            for (p, _), o in zip(requests, expected)]
    again_plain, again = drive(plain, turn), drive(spec, turn)
    assert min(o.cached_tokens for o in again_plain) > 20
    assert_same(again_plain, again)
    assert_cache_same(plain, spec)


def test_seeded_sampled_rows_draw_the_same_tokens(spec_model):
    """A seeded row draws its token of output index i at (seed, i) with or without drafts, after
    the same rules (temperature, top-k/p, min-p, logit_bias, min_tokens, penalties)."""
    path = spec_model("qwen3_next")
    ps = prompts([9, 14, 6, 11, 17], seed=2)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=18, temperature=1.2, top_k=30, min_p=0.02, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.7, seed=9, logit_bias={5: 2.0, 9: -3.0}, min_tokens=10),
              SamplingParams(max_tokens=15, temperature=0.9, seed=1, ignore_eos=True, repetition_penalty=1.2,
                             presence_penalty=0.3),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    requests = list(zip(ps, params))
    options = dict(page_size=8, num_pages=128, max_num_seqs=8)
    expected = drive(Engine.from_pretrained(path, **options), requests)
    spec = speculating(path, 2, continuations(requests, expected), wrong=0.2, **options)
    got = drive(spec, requests)
    assert_same(expected, got)
    assert spec.speculation.accepted_tokens > 20
    assert spec.drafter.asked == {tuple(p) for p in ps}  # every row drafts, the penalised one too


def test_penalised_and_constrained_rows_draft_and_keep_their_tokens(spec_model):
    """Rows with penalties and with grammars (a JSON schema; a reasoning model's thinking, then
    JSON) draft like any other. A drafted row is sampled after the drafted tokens before it:
    its penalties count them, its grammar's matcher steps through them and back (a wrong draft
    the grammar forbids ends what can be kept there). Greedy and seeded rows give k = 0's
    tokens; the drafts were kept often (a wrong one is a random token: 30% of them)."""
    import llguidance
    from tokenizers import Tokenizer

    from cairn.workers.grammar import Grammar

    path = spec_model("qwen3_5")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    start, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    json_only, thinking = Grammar(text), Grammar(text, think=(start, end), thinking=True)
    ps = [tok.encode(f"Question {i}: name a cairn.").ids for i in range(3)] + prompts([13, 7], seed=4)
    params = [SamplingParams(max_tokens=40, temperature=0, grammar=json_only),
              SamplingParams(max_tokens=40, temperature=1.0, seed=5, grammar=json_only, frequency_penalty=0.4),
              SamplingParams(max_tokens=48, temperature=1.0, seed=6, grammar=thinking, logit_bias={end: 3.0}),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=1.5,
                             presence_penalty=0.5),
              SamplingParams(max_tokens=24, temperature=0.9, seed=8, ignore_eos=True, repetition_penalty=1.4)]
    requests = list(zip(ps, params))
    options = dict(page_size=8, num_pages=128, max_num_seqs=8)
    plain = Engine.from_pretrained(path, **options)
    for grammar in (json_only, thinking):
        plain.sampler.grammars.prepare(grammar).result()
    expected = drive(plain, requests)
    assert all(o.finish_reason == "stop" for o in expected[:3])
    spec = speculating(path, 3, continuations(requests, expected), wrong=0.3, **options)
    for grammar in (json_only, thinking):
        spec.sampler.grammars.prepare(grammar).result()
    got = drive(spec, requests)
    assert_same(expected, got)
    assert spec.drafter.asked == {tuple(p) for p in ps}
    s = spec.speculation
    assert s.accepted_tokens > s.draft_tokens / 3, s
    spec.check()
    # the checkpoint's (random) head drafts for constrained rows among what their grammar allows:
    # where the schema leaves one token (a key, a quote), the draft is kept
    requests = [(p, SamplingParams(max_tokens=40, temperature=0, grammar=json_only)) for p in ps[:3]]
    head = Engine.from_pretrained(path, num_speculative_tokens=3, speculative_adaptive=False, **options)
    head.sampler.grammars.prepare(json_only).result()
    assert [o.token_ids for o in drive(head, requests)] == [o.token_ids for o in expected[:1]] + \
        [o.token_ids for o in drive(plain, requests[1:])]
    assert head.speculation.accepted_tokens >= 10, head.speculation  # unconstrained: none


@pytest.mark.parametrize("host_tier", [False, True], ids=["tier-off", "tier-on"])
def test_multi_turn_conversations_under_memory_pressure_resume_alike(spec_model, host_tier):
    """Three conversations taking turns, one request at a time, in a cache that cannot hold them
    all: evictions (and, with the host tier, demotions and promotions) happen as with k = 0, and
    every turn resumes as deep, with the same tokens, leaving the same pages and checkpoints.
    (Requests running together under pressure may evict in another order: drafts change how far
    each has got at a step, as any change of the steps would; their tokens stay the same: the
    preemption test.)"""
    from cairn.workers import EngineOptions, EngineSpec

    path = spec_model("qwen3_5_moe")
    block = EngineSpec.from_model_dir(path, EngineOptions(page_size=4, dtype="bfloat16")).page_bytes
    options = dict(page_size=4, max_num_seqs=3, cache_memory_bytes=110 * block, dtype="bfloat16",
                   host_cache_bytes=200 * block if host_tier else 0)
    plain = Engine.from_pretrained(path, **options)
    histories = prompts([23, 17, 29], seed=13)
    known: list[list[int]] = []
    spec = speculating(path, 2, known, wrong=0.3, **options)
    cached = []
    for turn, c in enumerate([0, 1, 0, 2, 0, 1, 2, 0, 1]):
        request = (histories[c], SamplingParams(max_tokens=6 + 3 * c, temperature=0, ignore_eos=True, logprobs=1))
        expected = drive(plain, [request])
        known += continuations([request], expected)
        got = drive(spec, [request])
        assert_same(expected, got)
        cached.append(got[0].cached_tokens)
        histories[c] = histories[c] + expected[0].token_ids + prompts([5], seed=turn)[0]
    assert sum(1 for n in cached if n) >= 2, f"later turns resume: {cached}"
    m_plain, m = plain.metrics(), spec.metrics()
    assert m.pages_evicted_total == m_plain.pages_evicted_total > 0
    if host_tier:
        assert m.pages_promoted_total == m_plain.pages_promoted_total > 0
    assert m.spec_accepted_tokens_total > 0
    assert_cache_same(plain, spec)


def test_preemption_and_a_full_cache_keep_the_tokens(spec_model):
    """Concurrent requests in a 20-page pool: sequences are preempted and resumed (the order
    differs from k = 0's, since drafts change how far each gets a step), and each still gets
    its k = 0 tokens; a verify step never evicts or preempts for its drafts (they use the pages
    there are, and the spare state slots beside the cache). Logprobs within 1e-4, not bit for
    bit: a preempted sequence recomputes its tokens as a prefill, at other tokens than k = 0's."""
    path = spec_model("qwen3_next")
    requests = [(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1))
                for p, m in zip(prompts([10, 9, 11, 10], seed=7), (30, 22, 26, 18))]
    options = dict(num_pages=20, page_size=4, max_num_seqs=4)
    plain = Engine.from_pretrained(path, **options)
    expected = drive(plain, requests)
    assert plain.scheduler.num_preemptions > 0
    spec = speculating(path, 3, continuations(requests, expected), wrong=0.2, **options)
    got = drive(spec, requests)
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in b.logprobs]),
                                   torch.tensor([lp.logprob for lp in a.logprobs]), atol=1e-4, rtol=0)
    assert spec.speculation.accepted_tokens > 0 and spec.scheduler.num_preemptions > 0
    spec.check()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_checkpoints_mtp_head_drafts_and_the_output_is_the_target_s(spec_model, arch):
    """The engine's own drafter: the checkpoint's (random) MTP head drafts after every step's
    kept tokens; the target rejects what it gets wrong, so the output is k = 0's. Its counts are
    in the engine's metrics (as /metrics exports them)."""
    path = spec_model(arch)
    requests = [(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)) for p in prompts([12, 30, 5])]
    expected = drive(Engine.from_pretrained(path, page_size=8), requests)
    spec = Engine.from_pretrained(path, page_size=8, num_speculative_tokens=3, speculative_adaptive=False)
    got = drive(spec, requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    m = spec.metrics()
    assert m.spec_drafts_total > 0 and m.spec_draft_tokens_total > m.spec_drafts_total
    assert m.spec_draft_tokens_total <= 3 * m.spec_drafts_total
    assert m.spec_mean_acceptance_length == 1 + m.spec_accepted_tokens_total / m.spec_drafts_total
    assert set(m.spec_accepted_tokens_by_position_total) == {"0", "1", "2"}
    assert spec.drafter.kv[0].abs().sum() > 0  # the head wrote its K/V
    spec.check()


def test_options_that_cannot_speculate_are_refused(spec_model, tiny_model_dir):
    with pytest.raises(EngineOptionError, match="num_speculative_tokens"):
        Engine.from_pretrained(spec_model("qwen3_next"), num_speculative_tokens=5)
    with pytest.raises(EngineOptionError, match="no MTP head"):
        Engine.from_pretrained(tiny_model_dir, num_speculative_tokens=2)


@pytest.mark.slow
def test_the_trained_demo_head_is_kept_at_a_realistic_rate(trained_spec_model):
    """`cairn demo-model --mtp trained` (tiny): on corpus lines its training never read, the head's
    first draft is kept >= 60% of the time, and the output is the target's own."""
    from tokenizers import Tokenizer

    from cairn.workers.demo.corpus import training_corpus

    tokenizer = Tokenizer.from_file(str(trained_spec_model / "tokenizer.json"))
    lines = training_corpus(4200)[4000:]
    ps = [ids[:16] for ids in (tokenizer.encode(line).ids for line in lines) if len(ids) >= 16][:12]
    requests = [(p, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)) for p in ps]
    expected = drive(Engine.from_pretrained(trained_spec_model, max_num_seqs=16), requests)
    spec = Engine.from_pretrained(trained_spec_model, max_num_seqs=16, num_speculative_tokens=1,
                                  speculative_adaptive=False)
    got = drive(spec, requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    s = spec.speculation
    assert s.accepted_by_position[0] / s.drafts >= 0.6, s


@pytest.mark.slow
def test_sampled_rows_draft_from_the_heads_distribution(trained_spec_model):
    """A sampled row's drafts are drawn from the head's distribution by the row's rules
    (`Sampler.draft_tokens`). A seeded row draws them with the uniforms its verify rows draw with,
    so its tokens are k = 0's; an unseeded one draws them apart and keeps them by rejection
    sampling. Either way drafts are kept more often than the head's argmax would be (the trained
    head's distribution is near the target's; an argmax draft is kept only with the target's
    probability of it), the unseeded rows most (at sum(min(p, q)))."""
    from tokenizers import Tokenizer

    from cairn.workers.demo.corpus import training_corpus

    tokenizer = Tokenizer.from_file(str(trained_spec_model / "tokenizer.json"))
    lines = training_corpus(4200)[4000:]
    ps = [ids[:16] for ids in (tokenizer.encode(line).ids for line in lines) if len(ids) >= 16][:12]
    first_kept = {}
    for seeded in (True, False):
        requests = [(p, SamplingParams(max_tokens=32, temperature=0.6, top_p=0.95, ignore_eos=True,
                                       seed=i if seeded else None)) for i, p in enumerate(ps)]
        expected = drive(Engine.from_pretrained(trained_spec_model, max_num_seqs=16), requests)
        for drafts in ("drawn", "argmax"):
            spec = Engine.from_pretrained(trained_spec_model, max_num_seqs=16, num_speculative_tokens=2,
                                          speculative_exact=True, speculative_adaptive=False)
            if drafts == "argmax":
                spec.drafter.pick = None
            got = drive(spec, requests)
            if seeded or drafts == "argmax":  # (the same key and the same uniform at each index)
                assert [o.token_ids for o in got] == [o.token_ids for o in expected]
            first_kept[seeded, drafts] = spec.speculation.accepted_by_position[0] / spec.speculation.drafts
    assert first_kept[True, "drawn"] > first_kept[True, "argmax"] + 0.05, first_kept
    assert first_kept[False, "drawn"] > max(first_kept[True, "drawn"], first_kept[False, "argmax"] + 0.1), first_kept


def test_the_gate_drafts_where_drafting_gives_more_tokens_per_second():
    """`speculative_adaptive`: per bucket of running sequences, each way is tried, then the faster
    one taken (each way's rate the median of its last steps: one odd step decides nothing) and
    the other tried for PROBE steps after REPROBE steps, then after twice as many while the
    choice stands."""
    from cairn.workers.speculative.gate import SpeculationGate

    gate = SpeculationGate()
    assert gate.drafting(16)  # nothing measured: try drafting
    gate.observe(16, True, tokens=30, seconds=1.0)  # the first step of a way: its compiles, not counted
    assert gate.drafting(16)
    gate.observe(16, True, tokens=30, seconds=0.03)  # 1000 tokens/s with drafts
    assert not gate.drafting(16)  # then without
    for _ in range(2):
        gate.observe(16, False, tokens=16, seconds=0.01)  # 1600 tokens/s without
    taken = [gate.drafting(16) for _ in range(8 * gate.REPROBE)]
    tries = [i + 1 for i, t in enumerate(taken) if t]  # the slower way for 2 steps, after 32 steps, then 64, 128
    assert tries == [32, 33, 97, 98, 226, 227] and gate.PROBE == 2 and gate.REPROBE == 32
    assert gate.drafting(1)  # another bucket: measured on its own
    for _ in range(2):
        gate.observe(1, True, tokens=3, seconds=0.01)
        gate.observe(1, False, tokens=1, seconds=0.006)
    assert sum(gate.drafting(1) for _ in range(gate.REPROBE)) == gate.REPROBE - 1
    for _ in range(20):  # drafts slow down at this load: the rate follows, and the gate turns
        gate.observe(1, True, tokens=1, seconds=0.02)
    # the rest of the try under way (plain), then plain, and drafting tried after REPROBE steps
    assert [i for i in range(gate.REPROBE + 1) if gate.drafting(1)] == [gate.REPROBE]
    gate.observe(1, True, tokens=3, seconds=0.0001)  # one odd step (30000 tokens/s): the median holds
    assert gate.rate(1, True) == 50.0 < gate.rate(1, False)


def test_a_step_that_prefills_verifies_drafts_only_beside_whole_prompt_chunks(spec_model):
    """Drafts never take a prompt's tokens: a step whose prompt chunks are cut by the token budget
    (`max_num_batched_tokens`) carries the other sequences' decodes without their drafts; one
    where the budget holds every prompt's chunk whole verifies them in the same forward. Every
    request gets k = 0's tokens."""
    path = spec_model("qwen3_next")
    requests = [(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p in prompts([9, 40, 12, 5])]
    expected = drive(Engine.from_pretrained(path, page_size=8, max_num_batched_tokens=16), requests)
    spec = speculating(path, 2, continuations(requests, expected), wrong=0.0, page_size=8, max_num_batched_tokens=16)
    plans, schedule = [], spec.scheduler.schedule
    spec.scheduler.schedule = lambda *a, **k: plans.append(schedule(*a, **k)) or plans[-1]
    ids = [spec.add_request(*requests[0])]
    for _ in range(3):
        spec.step()  # the first request decodes with drafts
    ids += [spec.add_request(*r) for r in requests[1:3]]  # two more prefill in 16-token chunks beside it
    final = {}
    for _ in range(8):
        final.update({o.request_id: o for o in spec.step() if o.finished})
    ids.append(spec.add_request(*requests[3]))  # a short prompt beside three decodes: its chunk is whole
    while spec.has_unfinished():
        final.update({o.request_id: o for o in spec.step() if o.finished})
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in expected]
    prefilling = [p for p in plans if any(not s.verify for s in p.prefills)]
    cut = [p for p in prefilling if any(s.end < s.seq.num_prompt_tokens for s in p.prefills if not s.verify)]
    assert len(cut) >= 3 and all(not s.drafts for p in cut for s in p.segments)
    assert any(s.drafts for p in prefilling if p not in cut for s in p.segments)  # verified beside a prefill


def test_the_first_token_goes_out_before_the_head_runs_over_the_prompt(spec_model):
    """The head's pass over a step's kept positions runs when the next step begins: the step
    that prefills a prompt returns its first token having run the target alone (TTFT as without
    speculation). A request aborted in between, and a `prompt_logits` pass in between (which
    replaces the hidden states the head reads), leave the others' tokens as k = 0's."""
    path = spec_model("qwen3_5")
    requests = [(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for p in prompts([20, 9, 14])]
    expected = drive(Engine.from_pretrained(path, page_size=8), requests)
    spec = Engine.from_pretrained(path, page_size=8, num_speculative_tokens=2, speculative_adaptive=False)
    head_rows, apply = [], spec.drafter._apply
    spec.drafter._apply = lambda work, hidden: head_rows.append(hidden.shape[0]) or apply(work, hidden)
    ids = [spec.add_request(*r) for r in requests]
    first = spec.step()  # every prompt prefilled
    assert {o.request_id for o in first} == set(ids) and head_rows == []
    victim = spec.add_request(prompts([7], seed=5)[0], requests[0][1])
    spec.step()  # the head over the three prompts (43 positions), then the verify step and the victim's prefill
    assert head_rows[0] == 20 + 9 + 14
    spec.abort(victim)  # its head pass is pending: it is left out
    spec.prompt_logits(prompts([11], seed=6)[0])  # runs the pending head pass first
    final = {}
    while spec.has_unfinished():
        final.update({o.request_id: o for o in spec.step() if o.finished})
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in expected]
    assert spec.speculation.drafts > 0
    spec.check()


def test_a_prompt_over_several_steps_is_one_head_pass_after_its_first_token(spec_model):
    """A prompt computed over several steps (chunked by `max_num_batched_tokens`): the head's
    passes over its earlier chunks wait for its last (`held_back`), so the step that computes the
    last chunk runs the target alone and returns the first token; the next step begins with one
    head pass over the whole prompt, which writes the head K/V a one-step prefill's pass writes,
    and the drafts are that engine's."""
    path = spec_model("qwen3_5")
    prompt = prompts([40], seed=7)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engines, passes, drafted = [], [], []
    for budget in (16, 64):
        engine = Engine.from_pretrained(path, page_size=8, num_pages=64, max_num_batched_tokens=budget,
                                        num_speculative_tokens=2, speculative_adaptive=False)
        rows, apply, propose = [], engine.drafter._apply, engine.drafter.propose
        engine.drafter._apply = lambda work, hidden, rows=rows, apply=apply: rows.append(hidden.shape[0]) or \
            apply(work, hidden)
        seen = []
        engine.drafter.propose = lambda runs, seen=seen, propose=propose: propose(runs) or \
            seen.extend(list(run.segment.seq.draft) for run in runs if run.want)
        engine.add_request(prompt, greedy)
        steps = []  # per step: head passes before it, its outputs' token counts
        while engine.has_unfinished():
            before = len(rows)
            steps.append((before, [o.num_output_tokens for o in engine.step()]))
        engines.append((engine, steps))
        passes.append(rows)
        drafted.append(seen)
    (chunked, steps), (whole, _) = engines
    assert [o for _, o in steps[:3]] == [[], [], [1]]  # the first token from the third step
    assert steps[3][0] == 0 and passes[0][0] == 40  # no head pass before it; one over the prompt, after
    assert passes[1][0] == 40 and drafted[0] == drafted[1] and len(drafted[0]) >= 2
    hashes = chunked.spec.page_hashes(prompt, chunked.spec.hash_root(None))[:5]
    at = [[e.cache.pages.page_of(h) for h in hashes] for e in (chunked, whole)]
    for a, b in zip(chunked.drafter.kv, whole.drafter.kv):
        torch.testing.assert_close(a[at[0]], b[at[1]], atol=1e-4, rtol=0)  # (the target's chunked prefill sums
        assert a[at[0]].any()  # in another order: its hidden states are equal to float32 rounding)


@pytest.mark.slow
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
def test_tensor_parallel_speculation_matches_one_device(trained_spec_model, exact):
    """At tensor_parallel_size 2 every rank holds its share of the head (its decoder layer split
    as the target's) and runs each draft pass in step with rank 0 (rank 0's argmax), and every
    rank makes the verify steps' rollbacks and snapshots: greedy tokens, logprobs (to TP's
    summation order) and the next turn's cached_tokens are one device's without speculation, and
    the head's drafts are kept about as often as on one device."""
    from tests.workers.test_tensor_parallel import assert_same_outputs

    from tokenizers import Tokenizer

    from cairn.workers.demo.corpus import training_corpus

    tokenizer = Tokenizer.from_file(str(trained_spec_model / "tokenizer.json"))
    lines = training_corpus(4100)[4000:]
    ps = [ids[:n] for ids, n in zip((tokenizer.encode(line).ids for line in lines), (5, 16, 30)) if len(ids) >= n]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    options = dict(page_size=8, num_pages=128, max_num_seqs=4)
    one = Engine.from_pretrained(trained_spec_model, **options)
    spec_one = Engine.from_pretrained(trained_spec_model, num_speculative_tokens=2, speculative_exact=exact,
                                      speculative_adaptive=False, **options)
    expected = one.generate(ps, params)
    spec_one.generate(ps, params)
    tp = Engine.from_pretrained(trained_spec_model, tensor_parallel_size=2, num_speculative_tokens=2,
                                speculative_exact=exact, speculative_adaptive=False, **options)
    try:
        assert_same_outputs(tp.generate(ps, params), expected)
        turn = [p + o.token_ids + p[:3] for p, o in zip(ps, expected)]  # the next turn resumes each
        again, again_tp = one.generate(turn, params), tp.generate(turn, params)
        assert_same_outputs(again_tp, again)
        assert [o.cached_tokens for o in again_tp] == [o.cached_tokens for o in again] and again[2].cached_tokens > 40
        s, s1 = tp.speculation, spec_one.speculation
        assert s.accepted_tokens >= 0.8 * s1.accepted_tokens > 10, (s, s1)
    finally:
        tp.runner.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_graphed_verify_steps_give_the_eager_tokens_bit_for_bit(spec_model, arch):
    """Decode graphs capture the exact mode's verify step (part 6): at each batch bucket, k + 1
    levels of rows, a level padded to the bucket (fewer drafts pad up; padding rows write no
    page and no state, and their state saves go to the layout's padding slot, which no verify
    segment is given). On CPU the same padded batches run eagerly over the same buffers: the
    tokens, logprobs and cache are k = 0's, bit for bit (bf16), as sequences finish and the
    batch passes through the buckets."""
    path = spec_model(arch)
    requests = [(p, SamplingParams(max_tokens=20 + 4 * i, temperature=0, ignore_eos=True, logprobs=2))
                for i, p in enumerate(prompts([5 + 3 * i for i in range(6)], seed=11))]
    options = dict(page_size=8, num_pages=256, max_num_seqs=8, dtype="bfloat16")
    plain = Engine.from_pretrained(path, **options)
    expected = drive(plain, requests)
    spec = speculating(path, 2, continuations(requests, expected), wrong=0.3, enforce_eager=False, **options)
    graphs = spec.runner.graphs
    assert graphs.depth == 2 and graphs.padding_slot == spec.layout.padding_slot >= 0
    assert graphs.padding_slot not in spec.scheduler.spare_slots
    got = drive(spec, requests)
    assert_same(expected, got)
    assert_cache_same(plain, spec)
    verified = {size for size, depth in graphs._static if depth == 2}
    assert len(verified) >= 3, graphs._static.keys()  # verify steps ran graphed at several buckets
    assert spec.speculation.accepted_tokens > 20


def test_the_heads_kv_follows_its_pages_to_the_host_tier_and_back(spec_model):
    """A page demoted to the host tier and promoted into another block brings the head's K/V
    at its positions with it (host rows of their own, beside `host_cache_bytes`), as device
    moves do: drafts after a resume from the host tier read what the head wrote there."""
    from cairn.workers.plan import COPY, DEMOTE, PROMOTE, BlockCopy

    engine = Engine.from_pretrained(spec_model("qwen3_5"), page_size=8, num_pages=64, host_cache_bytes=2 * 2**20,
                                    num_speculative_tokens=2)
    runner, kv = engine.runner, engine.drafter.kv
    assert engine.layout.host_blocks > 8 and engine.drafter.host_bytes > 0
    g = torch.Generator().manual_seed(0)
    written = [torch.randn(kv[0][3].shape, generator=g).to(kv[0].dtype) for _ in kv]
    for t, w in zip(kv, written):
        t[3] = w
    engine.flush_block_copies([BlockCopy(DEMOTE, 3, 5)])
    for t in kv:
        t[3].zero_()
    engine.flush_block_copies([BlockCopy(PROMOTE, 5, 7), BlockCopy(COPY, 7, 9)])
    for t, w in zip(kv, written):
        assert torch.equal(t[7], w) and torch.equal(t[9], w) and not t[3].any()
    assert runner.host_rows[0].shape[0] == engine.layout.host_blocks


def test_a_peer_fetch_brings_the_heads_kv_with_its_pages(spec_model):
    """A page fetched from a peer (cairn.workers.cache.transfer) brings the holder's head K/V at
    its positions to a receiver that speculates too (written first if the holder's head pass over
    them is still to run): after resuming from the fetched pages, the receiver drafts what the
    holder drafts resuming from its own. A receiver without a head takes the same pages, and the
    same `cached_tokens` come out."""
    path = spec_model("qwen3_5")
    options = dict(page_size=8, num_pages=64, cache_policy="all")
    spec = dict(num_speculative_tokens=2, speculative_adaptive=False)
    holder = Engine.from_pretrained(path, worker_id="holder", **options, **spec)
    receivers = [Engine.from_pretrained(path, worker_id="receiver", **options, **spec),
                 Engine.from_pretrained(path, worker_id="plain", **options)]
    prompt = prompts([41], seed=5)[0]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    holder.add_request(prompt, SamplingParams(max_tokens=2, temperature=0))
    holder.step()  # the prompt's prefill; the head's pass over it waits for the next step, or an export
    hashes = holder.spec.page_hashes(prompt, holder.spec.hash_root(None))
    for receiver in receivers:
        plan = receiver.fetches.plan(hashes, len(prompt), 5)
        export = holder.fetches.export(hashes, plan.first, plan.depth)
        assert len(export.page_rows) == 2  # the head's K and V, whoever asks
        assert receiver.fetches.import_(export, hashes, plan.first) == 5
    head = receivers[0].drafter.kv
    for h in hashes[:5]:
        a, b = holder.cache.pages.page_of(h), receivers[0].cache.pages.page_of(h)
        for mine, theirs in zip(head, holder.drafter.kv):
            assert theirs[a].any() and torch.equal(mine[b], theirs[a])

    def drafts_of(engine):
        seen, propose = [], engine.drafter.propose

        def recording(runs):
            propose(runs)
            seen.extend(list(run.segment.seq.draft) for run in runs if run.want)
        engine.drafter.propose = recording
        return seen
    drafted = [drafts_of(holder), drafts_of(receivers[0])]
    longer = prompt + [7, 8, 9]
    outs = [run_alone(engine, longer, greedy) for engine in (holder, *receivers)]
    assert [o.cached_tokens for o in outs] == [40] * 3 and len({tuple(o.token_ids) for o in outs}) == 1
    assert drafted[0] == drafted[1] and len(drafted[0]) >= 5


def test_a_head_pass_that_fails_costs_drafts_and_nothing_else(spec_model):
    """Drafts are proposals: when the MTP head's pass raises (a fault in its kernels), its
    sequences decode that step without drafts, and every request still gets k = 0's tokens."""
    path = spec_model("qwen3_next")
    requests = [(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for p in prompts([8, 13])]
    expected = drive(Engine.from_pretrained(path, page_size=8), requests)
    spec = Engine.from_pretrained(path, page_size=8, num_speculative_tokens=2, speculative_adaptive=False)
    run, calls = spec.drafter.run, []

    def failing(work, seqs=(), hidden=None):
        calls.append(1)
        if len(calls) % 3 == 2:
            raise RuntimeError("a kernel fault in the head")
        return run(work, seqs, hidden)
    spec.drafter.run = failing
    assert [o.token_ids for o in drive(spec, requests)] == [o.token_ids for o in expected]
    assert len(calls) >= 6 and spec.speculation.drafts > 0 and spec.broken is None
    spec.check()


def test_speculative_max_num_seqs_bounds_the_states_set_aside(spec_model):
    """`speculative_max_num_seqs` N: k x N spare state slots (and the padding one) instead of
    k x `max_num_seqs`; a step verifies at most k x N drafted tokens (N sequences' worth), the
    others decode plainly beside them, and the tokens are k = 0's."""
    path = spec_model("qwen3_5")
    requests = [(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for p in prompts([6, 9, 4, 11, 7, 5])]
    options = dict(page_size=8, num_pages=256, max_num_seqs=8)
    expected = drive(Engine.from_pretrained(path, **options), requests)
    spec = speculating(path, 2, continuations(requests, expected), wrong=0.2, speculative_max_num_seqs=2, **options)
    assert spec.layout.spare_slots == 2 * 2 + 1 and len(spec.scheduler.spare_slots) == 4
    full = Engine.from_pretrained(path, num_speculative_tokens=2, **options)
    assert full.layout.spare_slots == 2 * 8 + 1 and full.layout.spare_bytes > spec.layout.spare_bytes
    plans, schedule = [], spec.scheduler.schedule
    spec.scheduler.schedule = lambda *a, **k: plans.append(schedule(*a, **k)) or plans[-1]
    assert [o.token_ids for o in drive(spec, requests)] == [o.token_ids for o in expected]
    drafted = [sum(s.drafts for s in p.segments) for p in plans]  # a drafted token takes a slot
    assert max(drafted) == 2 * 2 and spec.speculation.accepted_tokens > 20
    with pytest.raises(EngineOptionError, match="speculative_max_num_seqs"):
        Engine.from_pretrained(path, num_speculative_tokens=2, speculative_max_num_seqs=0)
