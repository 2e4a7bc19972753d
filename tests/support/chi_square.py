"""A chi-square goodness-of-fit test held to a stated false-alarm rate: `critical(df)` is the
upper quantile at the normal quantile z (Wilson-Hilferty's approximation, slightly above the
exact one), `chi_square(counts, probs)` the statistic."""

import math

import torch

Z_1E6 = 4.7534  # the standard normal's upper 1e-6 quantile


def critical(df: int, z: float = Z_1E6) -> float:
    """The chi-square upper quantile at the normal quantile z (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())
