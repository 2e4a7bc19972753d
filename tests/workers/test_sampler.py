"""The batched sampler honours every parameter at its boundary, against a plain per-row torch
reference written here, in batches that mix greedy, sampled and penalised rows; seeded draws are
the same alone and batched and independent across output indices; penalties in an engine match
an oracle built from a cold engine's prompt logits, through batching and preemption."""

import pytest
import torch

from cairn.workers import Engine, SamplingParams
from cairn.kernels.sample.torch_ops import nucleus
from cairn.workers.sampler import Sampler
from cairn.workers.uniforms import uniforms
from cairn.workers.sequence import Sequence, Status

EOS = 3


def seq(params: SamplingParams, prompt=(1, 2, 3), outputs=(), rid="r") -> Sequence:
    s = Sequence(rid, list(prompt), params)
    s.token_ids.extend(outputs)
    return s


def draws(logits_row, params: SamplingParams, seeds=range(400), others=()):
    """The tokens drawn for `logits_row` over many seeds, each time beside the `others` rows."""
    sampler, got = Sampler(0, (EOS,)), []
    for s in seeds:
        rows = [seq(SamplingParams(**{**vars(params), "seed": s}))] + [seq(o, rid=f"o{i}") for i, o in enumerate(others)]
        logits = torch.stack([logits_row] + [torch.randn(logits_row.shape[0]) for _ in others])
        got.append(sampler.sample(logits, rows)[0][0])
    return got


MIX = (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=3, seed=1),
       SamplingParams(presence_penalty=1.5, repetition_penalty=1.3, seed=2))


@pytest.mark.parametrize("others", [(), MIX], ids=["alone", "mixed batch"])
@pytest.mark.parametrize("top_p,nucleus_set", [(0.6, {0, 1}), (0.85, {0, 1, 2}), (0.96, {0, 1, 2, 3}),
                                               (0.3, {0})])
def test_top_p_draws_exactly_the_nucleus(top_p, nucleus_set, others):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-30] * 60)
    assert set(draws(probs.log(), SamplingParams(top_p=top_p), others=others)) == nucleus_set


@pytest.mark.parametrize("others", [(), MIX], ids=["alone", "mixed batch"])
@pytest.mark.parametrize("k", [1, 2, 5, 63])
def test_top_k_keeps_exactly_k(k, others):
    logits = torch.linspace(0, 1.0, 64)[torch.randperm(64, generator=torch.Generator().manual_seed(k))]
    got = set(draws(logits, SamplingParams(top_k=k), seeds=range(600), others=others))
    assert got == set(torch.topk(logits, k).indices.tolist())


@pytest.mark.parametrize("min_p", [0.19, 0.21, 0.26, 0.49, 1.0])  # thresholds between the probabilities
def test_min_p_keeps_exactly_the_tokens_at_or_above_its_threshold(min_p):
    probs = torch.tensor([0.4, 0.2, 0.1, 0.1, 0.08, 0.07, 0.05])
    want = {i for i, p in enumerate(probs.tolist()) if p >= min_p * 0.4}
    assert set(draws(probs.log(), SamplingParams(min_p=min_p), others=MIX)) == want


def test_top_k_with_top_p_takes_the_nucleus_of_the_k():
    probs = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1])  # top_k 3 renormalises to .40 .33 .27
    assert set(draws(probs.log(), SamplingParams(top_k=3, top_p=0.5))) == {0, 1}
    assert set(draws(probs.log(), SamplingParams(top_k=3, top_p=0.8))) == {0, 1, 2}


def test_the_nucleus_mask_matches_a_sort_at_vocabulary_size():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(6, 151936, generator=g) ** 8  # peaked and flat rows, unnormalised
    w[0, :100] = 0.0
    top_p = torch.tensor([0.1, 0.5, 0.9, 0.99, 0.999, 0.3])
    keep = nucleus(w, top_p)
    for i in range(6):
        ordered, _ = torch.sort(w[i], descending=True)
        before = ordered.cumsum(0) - ordered
        n = int((before < top_p[i] * w[i].sum()).sum())
        m = int(keep[i].sum())
        assert abs(m - n) <= 1, (i, m, n)  # fp32 sums in another order may move the boundary by one
        assert bool(keep[i][w[i] >= ordered[m - 1]].all())  # and what is kept is the likeliest m


def reference_adjust(logits, prompt, outputs, p: SamplingParams, eos=(EOS,)):
    """vLLM's and OpenAI's semantics, one row, plainly."""
    x = logits.clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(outputs) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = float("-inf")
    counts = torch.bincount(torch.tensor(list(outputs), dtype=torch.long), minlength=x.shape[0]).float()
    in_prompt = torch.zeros(x.shape[0], dtype=torch.bool)
    in_prompt[list(prompt)] = True
    for t in range(x.shape[0]):
        if (counts[t] > 0 or in_prompt[t]) and p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
    return x


PENALISED = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.7, temperature=0),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.5, presence_penalty=-2, frequency_penalty=2),
    SamplingParams(logit_bias={5: 100.0, 7: -100.0, 0: 3.5}),
    SamplingParams(min_tokens=4, stop_token_ids=(9,)),
    SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=(9,)),
    SamplingParams(min_tokens=2),  # reached: nothing masked
    SamplingParams(temperature=0),
]


def test_each_penalty_and_bias_changes_exactly_the_logits_it_should():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(PENALISED), 40, generator=g) * 3
    prompt, outputs = [1, 2, 2, 11], [5, 5, 6, 11, 30, 5]
    rows = [seq(p, prompt, outputs[:3] if p.min_tokens == 4 else outputs, rid=f"r{i}") for i, p in enumerate(PENALISED)]
    got = Sampler(0, (EOS,)).adjusted_logits(logits, rows)
    for i, (p, s) in enumerate(zip(PENALISED, rows)):
        want = reference_adjust(logits[i], prompt, s.output_token_ids, p)
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6, msg=lambda m: f"{p}: {m}")
        changed = (got[i] != logits[i])
        assert changed.equal(want != logits[i])


def test_greedy_rows_take_the_argmax_of_the_changed_logits_and_logprobs_stay_raw():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    ps = [SamplingParams(temperature=0, logit_bias={17: 100.0}, logprobs=2),
          SamplingParams(temperature=0, presence_penalty=2.0, logprobs=0),
          SamplingParams(temperature=0.5, seed=4, logit_bias={18: 100.0}, logprobs=1)]
    top = int(logits[1].argmax())
    rows = [seq(ps[0]), seq(ps[1], outputs=[top], rid="b"), seq(ps[2], rid="c")]
    out = Sampler(0).sample(logits.clone(), rows)
    assert [t for t, _ in out] == [17, int(reference_adjust(logits[1], [1, 2, 3], [top], ps[1]).argmax()), 18]
    raw = torch.log_softmax(logits, -1)
    for r, (t, lp) in enumerate(out):
        assert lp.logprob == pytest.approx(float(raw[r, t]), abs=1e-5)
        k = ps[r].logprobs
        assert [i for i, _ in lp.top] == torch.topk(raw[r], k).indices.tolist()


def test_seeded_draws_are_the_same_alone_and_batched_and_independent_across_indices():
    logits = torch.zeros(1, 1000)  # uniform
    tokens = []
    for index in range(12):
        row = seq(SamplingParams(seed=77), outputs=[0] * index)
        alone = Sampler(1).sample(logits.clone(), [row])[0][0]
        batched = Sampler(2).sample(torch.cat([torch.randn(3, 1000), logits]),
                                    [seq(p, rid=f"o{i}") for i, p in enumerate(MIX)] + [row])[-1][0]
        assert alone == batched
        tokens.append(alone)
    assert len(set(tokens)) > 6, tokens
    other = [Sampler(0).sample(logits.clone(), [seq(SamplingParams(seed=78), outputs=[0] * i)])[0][0]
             for i in range(12)]
    assert other != tokens
    u = uniforms(torch.full((4096,), 5), torch.arange(4096))
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02


def test_unseeded_draws_differ_across_sequences_and_indices_and_keep_a_sequences_key():
    """An unseeded sequence draws at (its key, output index), the key drawn once from the
    sampler's generator: other sequences and other indices draw independently, and the same
    index draws the same token again (what a draft drawn ahead of its verify row relies on)."""
    sampler = Sampler(0)
    got = {sampler.sample(torch.zeros(1, 1000), [seq(SamplingParams())])[0][0] for _ in range(10)}
    assert len(got) > 5
    row = seq(SamplingParams())
    by_index = []
    for index in range(10):
        row.token_ids[3:] = [0] * index
        by_index.append(sampler.sample(torch.zeros(1, 1000), [row])[0][0])
        assert sampler.sample(torch.zeros(1, 1000), [row])[0][0] == by_index[-1]
    assert len(set(by_index)) > 5


def test_a_draft_is_the_token_its_row_would_draw_at_that_index():
    """`Sampler.draft_tokens` (speculative decoding's drafts): from the same logits, each greedy
    or seeded row's draft after its drafts so far is the token `sample` draws for it as a verify
    row at that offset: greedy with bias and penalties, seeded with top-k/p and min-p; it counts
    nothing (the penalised row's next draw is unchanged)."""
    g = torch.Generator().manual_seed(4)
    params = [SamplingParams(temperature=0, logit_bias={7: 3.0}), SamplingParams(temperature=0.9, top_p=0.9, seed=5),
              SamplingParams(temperature=1.1, top_k=20, min_p=0.01, seed=9),
              SamplingParams(temperature=0.8, seed=2, presence_penalty=1.0, frequency_penalty=0.5)]
    rows = [seq(p, outputs=[9, 4], rid=f"r{i}") for i, p in enumerate(params)]
    drafts = [[9], [11], [3, 12], []]
    for trial in range(20):
        logits = torch.randn(4, 64, generator=g) * 3
        sampler = Sampler(0)
        sampler.sample(torch.randn(4, 64, generator=g), rows)  # the penalised row's counts
        drafted = sampler.draft_tokens(logits.clone(), rows, drafts).tolist()
        assert drafted == sampler.draft_tokens(logits.clone(), rows, drafts).tolist()  # nothing counted
        for row, draft in zip(rows, drafts):
            row.draft = list(draft)
        verified = sampler.sample(logits.clone(), rows, [len(d) for d in drafts])
        assert drafted == [token for token, _ in verified], trial
        for row in rows:
            row.draft = []


def test_an_unseeded_rows_drafts_are_drawn_apart_and_kept_by_rejection_sampling():
    """A sampled row without a seed drafts from the head's distribution q (after its rules) with
    uniforms of its own, and keeps q (`Sequence.draft_q`); its verify row keeps the draft with
    probability min(1, p / q) and otherwise draws from the residual max(0, p - q): over many
    sequences the drafts follow q, the verified tokens the target's p (chi-square, false alarm
    1e-6), and a draft is kept at the rate sum(min(p, q))."""
    from cairn.kernels.sample import reference
    from tests.support.chi_square import chi_square, critical

    V, n = 6, 20_000
    g = torch.Generator().manual_seed(8)
    target, head = torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5, logit_bias={2: 1.0})
    rules = dict(temperature=torch.tensor([0.9]), top_k=torch.tensor([5]), top_p=torch.tensor([1.0]),
                 min_p=torch.tensor([0.0]))
    biased = torch.zeros(V).index_fill_(0, torch.tensor([2]), 1.0)
    p, q = (reference.row_probs((x + biased)[None], **rules)[0].double() for x in (target, head))
    rows = [seq(params, outputs=[1], rid=f"r{i}") for i in range(n)]
    sampler = Sampler(3)
    drafted = sampler.draft_tokens(head.expand(n, V).clone(), rows, [[] for _ in rows])
    torch.testing.assert_close(rows[0].draft_q[0].double(), q, atol=1e-6, rtol=0)
    drafts = torch.bincount(drafted, minlength=V).double()
    assert chi_square(drafts[q > 0], q[q > 0]) < critical(int((q > 0).sum()) - 1) and drafts[q == 0].sum() == 0
    for row, token in zip(rows, drafted.tolist()):
        row.draft = [token]
    out = torch.tensor([token for token, _ in sampler.sample(target.expand(n, V).clone(), rows, [0] * n)])
    counts = torch.bincount(out, minlength=V).double()
    assert chi_square(counts[p > 0], p[p > 0]) < critical(int((p > 0).sum()) - 1) and counts[p == 0].sum() == 0
    kept = (out == drafted).double().mean()
    assert abs(kept - torch.minimum(p, q).sum()) < 0.015, (kept, torch.minimum(p, q).sum())


def test_an_overflowing_temperature_is_greedy_and_a_non_finite_row_fails_alone():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 10
    logits[2, 5] = float("nan")
    rows = [seq(SamplingParams(temperature=1e-40, top_p=0.5)), seq(SamplingParams(seed=3, top_k=4), rid="b"),
            seq(SamplingParams(seed=3), rid="c")]
    out = Sampler(0).sample(logits.clone(), rows)
    assert out[0][0] == int(logits[0].argmax())
    assert out[1][0] in torch.topk(logits[1], 4).indices.tolist()
    assert out[2].__class__.__name__ == "SequenceFault"


def test_penalty_rows_follow_each_step_and_are_reused_after_a_finish():
    sampler = Sampler(0)
    logits = torch.zeros(1, 20)
    logits[0, 4] = 1.0  # the argmax until the presence penalty takes it down
    s = seq(SamplingParams(temperature=0, presence_penalty=2.0), prompt=[1])
    got = []
    for _ in range(3):
        token = sampler.sample(logits.clone(), [s])[0][0]
        s.token_ids.append(token)
        got.append(token)
    assert got[0] == 4 and got[1] != 4 and got[2] not in (4, got[1])
    assert len(sampler.counts) == 1
    s.status = Status.FINISHED
    sampler.sample(logits.clone(), [seq(SamplingParams(temperature=0, frequency_penalty=1.0), rid="n")])
    assert len(sampler.counts) == 1 and sampler.counts.counts.shape[0] == 4  # the row came back


# ---- through the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def path(hf_checkpoint):
    return hf_checkpoint("dense")


def oracle(engine, prompt, params, steps, eos):
    """Greedy tokens under `params`, each from a cold prefill of everything so far, adjusted by
    the per-row reference."""
    out = []
    for _ in range(steps):
        logits = engine.prompt_logits(prompt + out)[-1]
        token = int(reference_adjust(logits, prompt, out, params, tuple(eos)).argmax())
        out.append(token)
        if token in eos and len(out) >= params.min_tokens and not params.ignore_eos:
            break
    return out


def test_engine_penalties_match_the_oracle_batched_and_preempted(path):
    cold = Engine.from_pretrained(path, num_pages=64)
    eos = cold.scheduler.eos_token_ids
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (12, 30, 7)]
    params = [SamplingParams(max_tokens=8, temperature=0, presence_penalty=2.0, frequency_penalty=1.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, repetition_penalty=2.0, logit_bias={7: 4.0}, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, min_tokens=5, stop_token_ids=(7,), logit_bias={7: 100.0})]
    want = [oracle(cold, p, sp, sp.max_tokens, eos | {7}) for p, sp in zip(prompts, params)]
    assert len(want[2]) == 6 and want[2][-1] == 7  # the stop id held back until min_tokens, then taken
    for engine in (Engine.from_pretrained(path, num_pages=64),
                   Engine.from_pretrained(path, num_pages=6, page_size=8, max_num_batched_tokens=16)):
        outs = engine.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
    assert sum(o.num_preemptions for o in outs) > 0  # the small cache did preempt
