"""Sampling as batched torch ops (sample/torch_ops.py, what CUDA runs) against the row-by-row oracle
(sample/reference.py): the same token at every uniform of a fine grid but where rounding moves a
boundary, exactly the same penalties and masks, and greedy's first maximum."""

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


def test_penalties_masks_and_greedy_equal_the_oracle():
    penalties_and_masks_agree(torch_ops)
    x = torch.randn(3, 1003, generator=torch.Generator().manual_seed(4))
    x[1, 17] = x[1, 900] = 50.0
    x[2, 3] = math.nan
    assert torch_ops.argmax_rows(x).tolist() == reference.argmax_rows(x).tolist()
    assert reference.argmax_rows(x).tolist()[1:] == [17, -1]
