"""What a verify step keeps of a draft (cairn/workers/acceptance.py): greedy rows keep exactly what
one-at-a-time greedy decoding gives; sampled rows, by rejection sampling, give each output token
exactly the target's distribution at its position, whatever the draft: checked by chi-square
tests over many seeded rows on a six-token vocabulary, for the first output token and for the
second given the first. Each chi-square test is held to a false-alarm rate of at most 1e-6 (its
critical value from the Wilson-Hilferty approximation of the chi-square quantile, slightly
above the exact one), so the suite fails by chance less than once in 10^5 runs; a draft-biased
rule (a rejected position drawing from the target instead of the residual) fails them by a wide
margin. Penalties, bias and the other sampling rules act on the target's probabilities before
these functions see them: the sampler's tests hold those."""

import math

import torch

from cairn.workers.acceptance import accept_greedy, accept_sampled

V, K, N = 6, 2, 60_000
Z_1E6 = 4.7534  # the standard normal's upper 1e-6 quantile


def critical(df: int, z: float = Z_1E6) -> float:
    """The chi-square upper quantile at the normal quantile z (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_keeps_the_drafts_matching_prefix_then_the_targets_token():
    draft = torch.tensor([[4, 5, 6], [4, 9, 6], [1, 5, 6], [4, 5, 6]])
    target = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 0, 7]])
    tokens, counts = accept_greedy(draft, target)
    assert counts.tolist() == [4, 2, 1, 3]
    assert tokens.tolist() == [[4, 5, 6, 7], [4, 5, -1, -1], [4, -1, -1, -1], [4, 5, 0, -1]]
    tokens, counts = accept_greedy(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[3], [8]]))  # k = 0
    assert tokens.tolist() == [[3], [8]] and counts.tolist() == [1, 1]


def tables(seed: int):
    """Target and draft distributions over V tokens: the first position's, and the second's
    given the first token (the target's forward ran over the drafted token)."""
    g = torch.Generator().manual_seed(seed)
    p0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    p1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # [first token, V]
    p2 = torch.softmax(torch.randn(V, V, generator=g), -1)  # the bonus, given the second token
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return p0, p1, p2, q0, q1


def draw_rows(seed: int, n: int = N):
    """n rows, each drafting K tokens from the draft tables, with the target's distributions at
    each position given that draft."""
    p0, p1, p2, q0, q1 = tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    d0 = torch.multinomial(q0, n, replacement=True, generator=g)
    d1 = torch.multinomial(q1[d0], 1, generator=g)[:, 0]
    draft = torch.stack((d0, d1), dim=1)
    p = torch.stack((p0.expand(n, V), p1[d0], p2[d1]), dim=1)
    q = torch.stack((q0.expand(n, V), q1[d0]), dim=1)
    keys, index = torch.arange(n, dtype=torch.long) * 7919 + seed, torch.full((n,), 5, dtype=torch.long)
    return draft, p, q, keys, index, (p0, p1)


def test_sampled_rows_give_the_targets_distribution_at_every_position():
    draft, p, q, keys, index, (p0, p1) = draw_rows(seed=3)
    q0 = q[0, 0]
    tokens, counts = accept_sampled(draft, p, q, keys, index)
    assert ((counts >= 1) & (counts <= K + 1)).all()
    assert ((tokens >= 0).sum(1) == counts).all() and (tokens[:, 0] >= 0).all()
    first = torch.bincount(tokens[:, 0], minlength=V).double()
    assert chi_square(first, p0.double()) < critical(V - 1)
    second = tokens[:, 1]
    checked = 0
    for t in range(V):  # the second token given the first: the target's distribution after t
        there = second[(tokens[:, 0] == t) & (second >= 0)]
        if len(there) >= 2000:
            assert chi_square(torch.bincount(there, minlength=V).double(), p1[t].double()) < critical(V - 1), t
            checked += 1
    assert checked >= 3
    rate = (counts > 1).double().mean()  # the first draft is kept with probability sum min(p0, q0)
    assert abs(rate - torch.minimum(p0, q0).sum()) < 0.01


def test_a_draft_equal_to_the_target_is_always_kept_and_a_disjoint_one_never():
    draft, p, q, keys, index, _ = draw_rows(seed=5, n=2000)
    _, counts = accept_sampled(draft, p, p[:, :K], keys, index)  # q = p
    assert (counts == K + 1).all()
    p_first = p.clone()
    p_first[torch.arange(len(draft)), 0, draft[:, 0]] = 0.0  # the target never takes the drafted token
    tokens, counts = accept_sampled(draft, p_first, q, keys, index)
    assert (counts == 1).all() and (tokens[:, 0] != draft[:, 0]).all()


def test_the_randomness_is_the_rows_key_and_output_index_alone():
    draft, p, q, keys, index, _ = draw_rows(seed=7, n=500)
    a = accept_sampled(draft, p, q, keys, index)
    perm = torch.randperm(500, generator=torch.Generator().manual_seed(0))  # rows in another batch order
    b = accept_sampled(draft[perm], p[perm], q[perm], keys[perm], index[perm])
    assert torch.equal(a[0][perm], b[0]) and torch.equal(a[1][perm], b[1])
    c = accept_sampled(draft, p, q, keys + 1, index)
    assert not torch.equal(a[0], c[0])
    # with nothing drafted, the draw at an index is the plain inverse CDF of the target there
    tokens, counts = accept_sampled(draft[:, :0], p[:, :1], q[:, :0], keys, index)
    assert counts.eq(1).all() and torch.equal(tokens[:, 0], accept_sampled(
        draft[:, :0], p[:, :1], q[:, :0], keys, index)[0][:, 0])


def test_the_engines_rule_on_the_host_is_accept_greedy_over_the_targets_draws():
    """The engine keeps a verify segment's drafts by comparing them with the target's own draws at
    each position (cairn.workers.speculation.kept_tokens, on the host): `accept_greedy` with the
    draws as the target's choices. It also ends at a faulted row and after a token that stops the
    sequence."""
    from cairn.workers.engine_errors import SequenceFault
    from cairn.workers.plan import Segment
    from cairn.workers.sampling_params import SamplingParams
    from cairn.workers.sequence import Sequence
    from cairn.workers.speculation import kept_tokens

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
