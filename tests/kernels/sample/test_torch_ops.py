"""Sampling as batched torch ops (sample/torch_ops.py, what CUDA runs) against the row-by-row oracle
(sample/reference.py): the same token at every uniform of a fine grid but where rounding moves a
boundary, the same distributions (`row_probs`), exactly the same penalties and masks, and
greedy's first maximum."""

from __future__ import annotations

import math

import pytest
import torch

from cairn.kernels.sample import reference, torch_ops
from tests.kernels.sample.test_cpu_ops import SAMPLING_ROWS, draws_over, penalties_and_masks_agree


@pytest.mark.parametrize("vocab", [1000, 4099])
def test_the_draw_takes_the_oracles_token_at_every_uniform(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(len(SAMPLING_ROWS), vocab, generator=g) * 3
    x[1, 100:] = -math.inf
    t, k, p, m = (torch.tensor(c) for c in zip(*SAMPLING_ROWS))
    k = k.long()
    host = (k.tolist(), p.tolist(), m.tolist())
    got = draws_over(lambda u: torch_ops.sample_rows(x, t, k, p, m, u, host), len(SAMPLING_ROWS))
    want = draws_over(lambda u: reference.sample_rows(x, t, k, p, m, u), len(SAMPLING_ROWS))
    for r in range(len(SAMPLING_ROWS)):
        assert (got[:, r] != want[:, r]).sum() <= 3, (SAMPLING_ROWS[r], (got[:, r] != want[:, r]).sum())


@pytest.mark.parametrize("vocab", [4099])  # several blocks of the two-level draw, and a tail
def test_row_probs_is_the_distribution_the_draw_takes_and_draw_rows_its_inverse_cdf(vocab):
    """`row_probs` (speculative decoding's p and q) equals the oracle's normalised kept weights
    row by row (an overflowing temperature: one-hot at the argmax), and `draw_rows` over those
    probabilities takes `sample_rows`' token at every uniform (but where rounding moves a
    boundary)."""
    g = torch.Generator().manual_seed(vocab + 1)
    x = torch.randn(len(SAMPLING_ROWS), vocab, generator=g) * 3
    x[1, 100:] = -math.inf
    t, k, p, m = (torch.tensor(c) for c in zip(*SAMPLING_ROWS))
    k = k.long()
    host = (k.tolist(), p.tolist(), m.tolist())
    probs = torch_ops.row_probs(x, t, k, p, m, host)
    torch.testing.assert_close(probs, reference.row_probs(x, t, k, p, m), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(SAMPLING_ROWS)))
    got = draws_over(lambda u: torch_ops.draw_rows(probs, u), len(SAMPLING_ROWS))
    want = draws_over(lambda u: torch_ops.sample_rows(x, t, k, p, m, u, host), len(SAMPLING_ROWS))
    for r in range(len(SAMPLING_ROWS)):
        assert (got[:, r] != want[:, r]).sum() <= 3, (SAMPLING_ROWS[r], (got[:, r] != want[:, r]).sum())
    assert torch.equal(reference.draw_rows(probs, torch.full((len(SAMPLING_ROWS),), 0.5)),
                       torch_ops.draw_rows(probs, torch.full((len(SAMPLING_ROWS),), 0.5)))


def test_penalties_masks_and_greedy_equal_the_oracle():
    penalties_and_masks_agree(torch_ops)
    x = torch.randn(3, 1003, generator=torch.Generator().manual_seed(4))
    x[1, 17] = x[1, 900] = 50.0
    x[2, 3] = math.nan
    assert torch_ops.argmax_rows(x).tolist() == reference.argmax_rows(x).tolist()
    assert reference.argmax_rows(x).tolist()[1:] == [17, -1]
