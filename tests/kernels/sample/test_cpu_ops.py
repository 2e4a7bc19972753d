"""The C++ sampling kernels (cairn/kernels/sample/sample.cpp, launched by cpu_ops.py) against the
row-by-row oracle (sample/reference.py): greedy's first maximum, the draw's support and token at
every uniform of a fine grid (but where sums in another order move a boundary), penalties and
masks.
"""

from __future__ import annotations

import math

import pytest
import torch

from cairn.kernels.sample import cpu_ops as sample_cpu
from cairn.kernels.sample import reference as sample_ref
from tests.kernels.conventions import needs_compiler, rand

pytestmark = [needs_compiler, pytest.mark.usefixtures("native_library")]


def draws_over(draw_fn, rows: int, grid: int = 1500) -> torch.Tensor:
    """[grid, rows]: the token each row draws at each uniform of a fine grid."""
    return torch.stack([draw_fn(torch.full((rows,), float(u))) for u in torch.linspace(0, 0.9999, grid)])


SAMPLING_ROWS = [  # (temperature, top_k, top_p, min_p): every branch, alone and together
    (1.0, 0, 1.0, 0.0), (0.5, 0, 0.9, 0.0), (1.3, 5, 1.0, 0.0), (0.8, 40, 0.7, 0.0), (1.0, 0, 1.0, 0.3),
    (0.7, 3, 0.5, 0.1), (1.0, 2000, 1.0, 0.0), (1.0, 2000, 0.8, 0.0), (1e-30, 0, 0.9, 0.0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_takes_the_first_maximum_and_refuses_rows_that_are_not_finite(dtype):
    logits = rand(7, 1000, seed=1, dtype=dtype)
    logits[1, 17] = logits[1, 900] = 50.0  # a tie: the first
    logits[2, 999] = 60.0  # in the tail past the last whole vector
    logits[3, 5] = math.nan
    logits[4, 400] = math.inf
    logits[5] = -math.inf
    logits[6, 0] = 70.0
    got = sample_cpu.argmax_rows(logits)
    assert got.tolist() == sample_ref.argmax_rows(logits).tolist()
    assert got.tolist()[1:] == [17, 999, -1, -1, -1, 0]
    narrow = rand(3, 5, seed=2, dtype=dtype)  # shorter than a vector
    assert sample_cpu.argmax_rows(narrow).tolist() == narrow.float().argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [1000, 4099])  # a whole number of vectors, and a tail
def test_sampling_draws_from_exactly_the_references_support(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(len(SAMPLING_ROWS), vocab, generator=g) * 3  # distinct values: no ties to break
    x[1, 100:] = -math.inf  # a masked row (a grammar's)
    t, k, p, m = (torch.tensor(c) for c in zip(*SAMPLING_ROWS))
    k = k.long()
    host = (k.tolist(), p.tolist(), m.tolist())
    got = draws_over(lambda u: sample_cpu.sample_rows(x, t, k, p, m, u), len(SAMPLING_ROWS))
    want = draws_over(lambda u: sample_ref.sample_rows(x, t, k, p, m, u, host), len(SAMPLING_ROWS))
    for r in range(len(SAMPLING_ROWS)):
        # the same inverse CDF: the same token at every uniform but where sums in another order
        # move a boundary between two tokens past a grid point
        assert (got[:, r] != want[:, r]).sum() <= 3, (SAMPLING_ROWS[r], (got[:, r] != want[:, r]).sum())
        if SAMPLING_ROWS[r][1] in (3, 5):  # a few tokens, among the k largest
            assert set(got[:, r].tolist()) == set(want[:, r].tolist())
            assert set(got[:, r].tolist()) <= set(torch.topk(x[r], SAMPLING_ROWS[r][1]).indices.tolist())
    assert set(got[:, -1].tolist()) == {int(x[-1].argmax())}  # a temperature too small to divide by is greedy
    assert int(got[:, 1].max()) < 100


def test_sampling_top_k_breaks_ties_to_the_lowest_ids_and_never_draws_a_zero_weight():
    x = torch.zeros(2, 64)
    x[1, 10:] = -math.inf
    k = torch.tensor([5, 20])
    one = torch.ones(2)
    got = draws_over(lambda u: sample_cpu.sample_rows(x, one, k, one, torch.zeros(2), u), 2)
    assert set(got[:, 0].tolist()) == set(range(5)) and set(got[:, 1].tolist()) == set(range(10))


def penalties_and_masks_agree(ops) -> None:
    """`ops`' penalties and masks equal the oracle's, on rows `at` of a batch (others untouched)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 1003, generator=g) * 4
    counts = torch.randint(0, 3, (4, 1003), generator=g, dtype=torch.int32) * (torch.rand(4, 1003, generator=g) < 0.05)
    prompt = torch.rand(4, 1003, generator=g) < 0.05
    at, rows = torch.tensor([0, 2, 4]), torch.tensor([3, 0, 1])
    values = torch.tensor([[1.3, 0.5, 1.0], [0.7, -1.0, 2.0], [1.0, 0.0, -0.5]])
    mine, theirs = x.clone(), x.clone()
    ops.penalise_rows(mine, at, rows, counts, prompt, values)
    sample_ref.penalise_rows(theirs, at, rows, counts, prompt, values)
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    words = torch.randint(-2**31, 2**31 - 1, (3, 32), generator=g, dtype=torch.int32)
    words[0] = -1  # everything allowed
    mine, theirs = x.clone(), x.clone()
    ops.mask_rows(mine, at, words)
    sample_ref.mask_rows(theirs, at, words)
    assert torch.equal(mine, theirs) and torch.equal(mine[0], x[0]) and torch.equal(mine[1], x[1])


def test_penalties_and_masks_match_their_references():
    penalties_and_masks_agree(sample_cpu)

