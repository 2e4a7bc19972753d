"""A reply that ends inside the page its prompt ended in: the next request of the conversation,
which extends that prompt, resumes at the prompt's end (`cairn.workers.cache.partial_pages`), and
computes what a cold engine computes. Both hybrid families, every position of the prompt's end in
its page, and replies of 1, 2, 4 and 40 tokens (the last fills the page by decoding)."""

import pytest
import torch

from cairn.workers import Engine, SamplingParams
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
