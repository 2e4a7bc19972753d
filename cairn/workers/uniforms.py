"""Counter-based uniforms for sampling: `uniforms(keys, index)` gives one uniform in [0, 1) per
row, a function of (key, index) alone (SplitMix64 over int64 tensors, on the rows' device), so a
seeded request draws the same tokens alone, batched, chunked or preempted, and successive output
indices are independent draws. The sampler draws a row's token with the uniform at (its key, its
output index); speculative decoding's drafts and keep tests use other streams of the same key
(a key xor a salt: cairn.workers.speculative.draft_sampling).
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # SplitMix64's increment, as an int64
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9 - 2**64, 0x94D049BB133111EB - 2**64


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser over int64 tensors (multiplications wrap)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniforms(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, a function of (key, index) only: fp32 with 24 random bits."""
    h = _mix(_mix(keys) + (index + 1) * _GOLDEN)
    return _shr(h, 40).to(torch.float32) * 2.0 ** -24
