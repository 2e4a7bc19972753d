"""What a verify step keeps of a draft: greedy rows keep exactly what one-at-a-time greedy decoding
gives (the oracle tests/support/acceptance_oracle.py, `accept_greedy`, and the rule the engine applies
on the host, cairn.workers.speculative.acceptance.kept_tokens); sampled rows through a speculating engine give each output
token the target's distribution at its position, seeded (drafts drawn with the verify row's
uniform) or not (drafts drawn apart, kept by rejection sampling): checked by a chi-square test
over many rows on a three-token vocabulary, of the second and third tokens jointly, against a
cold engine's logits. The chi-square test is held to a false-alarm rate of at most 1e-6
(tests/support/chi_square.py), and every draw is a function of the engine's and the requests'
seeds: it gives the same verdict every run. Penalties, bias and the other sampling rules act on
the target's logits before the draw: the sampler's tests hold those."""

import pytest
import torch

from tests.support.acceptance_oracle import accept_greedy
from tests.support.chi_square import chi_square, critical


def test_greedy_keeps_the_drafts_matching_prefix_then_the_targets_token():
    draft = torch.tensor([[4, 5, 6], [4, 9, 6], [1, 5, 6], [4, 5, 6]])
    target = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 0, 7]])
    tokens, counts = accept_greedy(draft, target)
    assert counts.tolist() == [4, 2, 1, 3]
    assert tokens.tolist() == [[4, 5, 6, 7], [4, 5, -1, -1], [4, -1, -1, -1], [4, 5, 0, -1]]
    tokens, counts = accept_greedy(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[3], [8]]))  # k = 0
    assert tokens.tolist() == [[3], [8]] and counts.tolist() == [1, 1]


def joint_counts(outputs: list[list[int]], first: int) -> dict[tuple[int, int], int]:
    """How often each (second, third) output token pair follows the first token `first`."""
    counts: dict[tuple[int, int], int] = {}
    for tokens in outputs:
        if tokens[0] == first:
            counts[tokens[1], tokens[2]] = counts.get((tokens[1], tokens[2]), 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_sampled_rows_of_a_speculating_engine_follow_the_targets_distribution(trained_spec_model, seeded):
    """Sampled rows through a speculating engine (drafts drawn from the trained head, the exact
    mode), many of them on a 3-token vocabulary (top_k 3), 3 tokens each: the verify step after
    the first token checks one draft. The second and third output tokens after the commonest
    first one, jointly, have the target's distribution, from a cold k = 0 engine's logits (the
    third token comes from the verify row past a kept draft, or from the next step after a
    rejected one); pairs expected fewer than 5 times are one cell. A rule that kept a draft
    without its draw, or drew a rejected one's token from the target instead of the residual,
    fails it by a wide margin."""
    from tokenizers import Tokenizer

    from cairn.workers import Engine, SamplingParams
    from cairn.workers.demo.corpus import training_corpus
    from tests.support.stepping import drive

    tokenizer = Tokenizer.from_file(str(trained_spec_model / "tokenizer.json"))
    held_out = [ids[:12] for ids in (tokenizer.encode(line).ids for line in training_corpus(4100)[4000:])
                if len(ids) >= 12]
    cold = Engine.from_pretrained(trained_spec_model)

    def top3(tokens: list[int]) -> dict[int, float]:  # the target's top-k 3 distribution after `tokens`
        logits = cold.prompt_logits(tokens)[-1]
        values, ids = torch.topk(logits, 3)
        return dict(zip(ids.tolist(), torch.softmax(values.double(), -1).tolist()))

    n, wave = 2560, 64

    def testable_cells(tokens: list[int]) -> int:
        """Pairs after the commonest first token that n samples are expected to see 5 times or more."""
        first, p0 = max(top3(tokens).items(), key=lambda kv: kv[1])
        return sum(n * p0 * p1 * p2 >= 5 for second, p1 in top3(tokens + [first]).items()
                   for p2 in top3(tokens + [first, second]).values())
    spec = Engine.from_pretrained(trained_spec_model, max_num_seqs=wave, num_speculative_tokens=2,
                                  speculative_exact=True, speculative_adaptive=False)

    def sample(prompt: list[int], start: int, count: int) -> list[list[int]]:
        requests = [(prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i if seeded else None))
                    for i in range(start, start + count)]
        return [o.token_ids for o in drive(spec, requests)]

    def kept_share(prompt: list[int]) -> float:
        """The share of one wave's drafts kept (a pilot wave, past the test's seeds)."""
        before = spec.speculation.accepted_by_position[0]
        sample(prompt, 10 * n, wave)
        return (spec.speculation.accepted_by_position[0] - before) / wave
    # the first held-out corpus line whose continuations spread enough for the test to tell rules
    # apart and whose drafts the head gets right often enough to check the verify row past a kept
    # one (which line that is moves with the trained head, and so with the libraries that train it)
    prompt = next(p for p in held_out if testable_cells(p) >= 5 and kept_share(p) > 0.5)
    drafts, kept = spec.speculation.drafts, spec.speculation.accepted_by_position[0]
    outputs = []
    for start in range(0, n, wave):  # in waves of max_num_seqs: each request verifies its one draft
        outputs += sample(prompt, start, wave)
    first = max(top3(prompt).items(), key=lambda kv: kv[1])[0]
    counts = joint_counts(outputs, first)
    expected = {}
    for second, p1 in top3(prompt + [first]).items():
        for third, p2 in top3(prompt + [first, second]).items():
            expected[second, third] = p1 * p2
    total = sum(counts.values())
    assert total > n / 3 and set(counts) <= set(expected)
    cells = [[pair] for pair, p in expected.items() if p * total >= 5]
    cells.append([pair for pair, p in expected.items() if p * total < 5])  # the rare pairs, together
    cells = [c for c in cells if c]
    observed = torch.tensor([float(sum(counts.get(pair, 0) for pair in c)) for c in cells])
    probs = torch.tensor([sum(expected[pair] for pair in c) for c in cells], dtype=torch.float64)
    assert len(cells) >= 5 and chi_square(observed, probs) < critical(len(cells) - 1)
    s = spec.speculation
    assert s.drafts - drafts == n and s.accepted_by_position[0] - kept > n / 3, s  # many third tokens: a verify
    # row past a kept draft


def test_the_engines_rule_on_the_host_is_accept_greedy_over_the_targets_draws():
    """The engine keeps a verify segment's drafts by comparing them with the target's own draws at
    each position (cairn.workers.speculative.acceptance.kept_tokens, on the host): `accept_greedy` with the
    draws as the target's choices. It also ends at a faulted row and after a token that stops the
    sequence."""
    from cairn.workers.engine_errors import SequenceFault
    from cairn.workers.plan import Segment
    from cairn.workers.sampling_params import SamplingParams
    from cairn.workers.sequence import Sequence
    from cairn.workers.speculative.acceptance import kept_tokens

    g = torch.Generator().manual_seed(3)
    segments, results = [], []
    for _ in range(400):
        k = int(torch.randint(0, 5, (1,), generator=g))
        draft = torch.randint(0, 3, (k,), generator=g).tolist()  # 3 tokens: matches are frequent
        drawn = torch.randint(0, 3, (k + 1,), generator=g).tolist()
        seq = Sequence("r", [1, 2], SamplingParams(max_tokens=100))
        seq.draft = draft
        segments.append(Segment(seq, 1, 1 + k, drafts=k, verify=True))
        results.append([(t, None) for t in drawn])
    got = kept_tokens(segments, results, lambda seq, token, length: None)
    for seg, rows, (kept, accepted) in zip(segments, results, got):
        _, counts = accept_greedy(torch.tensor([seg.seq.draft], dtype=torch.long).reshape(1, seg.drafts),
                                  torch.tensor([[t for t, _ in rows]]))
        assert (kept, accepted) == (int(counts[0]), int(counts[0]) - 1)
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=100))
    seq.draft = [5, 6, 7]
    seg = Segment(seq, 1, 4, drafts=3, verify=True)
    rows = [(5, None), (6, None), (7, None), (8, None)]
    assert kept_tokens([seg], [rows], lambda s, t, n: None) == [(4, 3)]
    assert kept_tokens([seg], [rows], lambda s, t, n: "stop" if t == 6 else None) == [(2, 3)]
    assert kept_tokens([seg], [rows[:1] + [SequenceFault("x")] + rows[2:]], lambda s, t, n: None) == [(1, 1)]
    assert kept_tokens([seg], [[SequenceFault("x")] + rows[1:]], lambda s, t, n: None) == [(0, 0)]
