"""A reply that ends inside the page its prompt ended in: the next request of the conversation,
which extends that prompt, resumes at the prompt's end (`cairn.workers.cache.partial_pages`), and
computes what a cold engine computes. Both hybrid families, every position of the prompt's end in
its page, and replies of 1, 2, 4 and 40 tokens (the last fills the page by decoding)."""

import pytest
import torch

from cairn.workers import Engine, SamplingParams
from tests.support.drafters import ScriptedDrafter
from tests.support.stepping import finish

PS = 16
REPLIES = (1, 2, 4, 40)
NEXT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_all(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    out = finish(engine, ids)
    return [out[i] for i in ids]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_the_next_request_resumes_at_the_prompts_end_whatever_the_reply_left_of_its_page(demo_model, arch):
    model = demo_model(arch)
    warm = Engine.from_pretrained(model, num_pages=1024, dtype="float32", max_num_seqs=64)
    cases = [(r, g) for r in range(PS) for g in REPLIES]
    firsts = [tokens(2 * PS + r, seed=100 * r + g) for r, g in cases]  # P = 32 .. 47
    run_all(warm, firsts, [SamplingParams(max_tokens=g, temperature=0, ignore_eos=True) for _, g in cases])
    # kept where the reply ended inside the prompt end's page, under its sub-page state
    assert warm.cache.stats.partial_pages_kept == sum(1 for r, g in cases if r and r + g - 1 < PS)
    seconds = [p + tokens(30, seed=7 + i) for i, p in enumerate(firsts)]
    resumed = run_all(warm, seconds, [NEXT] * len(seconds))
    short = [(r, g, out.cached_tokens) for (r, g), p, out in zip(cases, firsts, resumed) if out.cached_tokens != len(p)]
    assert not short, f"(P mod page, reply length, cached) short of the prompt's end: {short}"
    warm.check()
    cold = run_all(Engine.from_pretrained(model, num_pages=1024, dtype="float32", max_num_seqs=64), seconds,
                   [NEXT] * len(seconds))
    for case, w, c in zip(cases, resumed, cold):
        assert c.cached_tokens == 0
        assert w.token_ids == c.token_ids, case
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in w.logprobs]),
                                   torch.tensor([lp.logprob for lp in c.logprobs]), atol=2e-4, rtol=0)


def resume_cases(engine: Engine, cases, seed: int = 0) -> tuple[list, list]:
    """Each case's first prompt with a reply of g tokens, then its next prompt (3 tokens each):
    (the first prompts, the next requests' outputs)."""
    firsts = [tokens(3 * PS + r, seed=seed + 100 * r + g) for r, g in cases]
    run_all(engine, firsts, [SamplingParams(max_tokens=g, temperature=0, ignore_eos=True) for _, g in cases])
    seconds = [p + tokens(20, seed=seed + 7 + i) for i, p in enumerate(firsts)]
    return firsts, run_all(engine, seconds, [NEXT] * len(seconds))


CASES = [(r, g) for r in (1, 6, 13) for g in (1, 4)]


def test_tensor_parallel_ranks_keep_the_page_and_resume_where_one_device_does(demo_model):
    model = demo_model("qwen3_5")
    one = Engine.from_pretrained(model, num_pages=256, dtype="float32", max_num_seqs=8)
    tp = Engine.from_pretrained(model, num_pages=256, dtype="float32", max_num_seqs=8, tensor_parallel_size=2)
    try:
        firsts, expected = resume_cases(one, CASES)
        _, got = resume_cases(tp, CASES)
        assert [o.cached_tokens for o in got] == [o.cached_tokens for o in expected] == [len(p) for p in firsts]
        for w, c in zip(got, expected):
            assert w.token_ids == c.token_ids
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in w.logprobs]),
                                       torch.tensor([lp.logprob for lp in c.logprobs]), atol=2e-4, rtol=0)
        tp.check()
    finally:
        tp.close()


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from cairn.workers.demo import write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("partial-mtp"), size="tiny", arch="qwen3_5", mtp=True)


def test_a_verify_step_whose_kept_tokens_end_inside_a_page_leaves_it_too(mtp_model):
    """Speculating (2 drafts a step, every step, exact; drafts scripted from the plain engine's
    replies, a third of them wrong): replies whose kept tokens end inside the page their prompt
    ended in leave that page, and the next requests resume and compute as a plain engine's do."""
    cases = [(r, g) for r in (2, 9) for g in (3, 6)]
    options = dict(num_pages=256, dtype="float32", max_num_seqs=8)
    plain = Engine.from_pretrained(mtp_model, **options)
    firsts, expected = resume_cases(plain, cases, seed=5)
    replies = run_all(Engine.from_pretrained(mtp_model, **options), firsts,
                      [SamplingParams(max_tokens=g, temperature=0, ignore_eos=True) for _, g in cases])
    spec = Engine.from_pretrained(mtp_model, num_speculative_tokens=2, speculative_exact=True,
                                  speculative_adaptive=False, **options)
    spec.drafter = ScriptedDrafter([p + o.token_ids for p, o in zip(firsts, replies)], spec.spec.vocab_size,
                                   wrong=0.3)
    _, got = resume_cases(spec, cases, seed=5)
    assert spec.speculation.accepted_tokens > 0, "drafts were kept"
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in expected] == [len(p) for p in firsts]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    spec.check()
