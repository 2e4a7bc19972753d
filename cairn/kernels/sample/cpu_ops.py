"""Sampling's C++ CPU kernels (sample.cpp), launched over `torch.ops.cairn_cpu`: greedy argmax, the
draw, penalties and grammar masks over fp32 rows; masks and penalties on other rows go to
sample/torch_ops.py. Contracts: sample/torch_ops.py's docstring; oracle: sample/reference.py."""

from __future__ import annotations

import torch
from torch import Tensor

from cairn.kernels.common.checks import check_rows
from cairn.kernels.sample import torch_ops

NATIVE = True  # runs only where the C++ library is loaded
_ops = torch.ops.cairn_cpu


def _fp32_rows(x: Tensor) -> bool:
    return x.dtype == torch.float32 and x.stride(1) == 1


def argmax_rows(logits: Tensor) -> Tensor:
    check_rows("logits", logits)
    return _ops.argmax_rows(logits)


def mask_rows(x: Tensor, at: Tensor, words: Tensor) -> None:
    check_rows("x", x)
    if not _fp32_rows(x):
        return torch_ops.mask_rows(x, at, words)
    _ops.mask_rows(x, at, words)


def penalise_rows(x: Tensor, at: Tensor, rows: Tensor, counts: Tensor, prompt: Tensor, values: Tensor) -> None:
    check_rows("x", x)
    if not _fp32_rows(x):
        return torch_ops.penalise_rows(x, at, rows, counts, prompt, values)
    _ops.penalise_rows(x, at, rows, counts, prompt, values)


def sample_rows(x: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, u: Tensor,
                host=None) -> Tensor:
    """Ties at a top-k boundary go to the lowest indices, and sums run in another order (the kept
    set may differ from the oracle's by a token whose weight sits at the boundary within rounding).
    `host` is not needed here: reading the parameters costs nothing on a CPU."""
    check_rows("x", x)
    return _ops.sample_rows(x.float().contiguous(), temperature.contiguous(), top_k.contiguous(),
                            top_p.contiguous(), min_p.contiguous(), u.contiguous())
