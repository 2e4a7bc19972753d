"""What the kernel tests share: marks (Triton interpreted, a C++ compiler), tolerances, inputs."""

import math
import shutil

import pytest
import torch

from cairn.kernels.common import triton_helpers

triton_interpreted = pytest.mark.skipif(
    not triton_helpers.INTERPRETED, reason="needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")

TOL = dict(atol=2e-5, rtol=1e-4)  # outputs: one pass of fp32 math
STATE_TOL = dict(atol=5e-5, rtol=2e-4)  # recurrent states: error accumulates over the chunks
EXACT = dict(atol=0, rtol=0)  # copies: stored values, conv windows, slots
BF16 = dict(atol=2e-2, rtol=2e-2)  # a bf16 output against fp32 math

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler: the CPU kernels cannot build here (the references run)")


def rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def layer_pool(slots, inner, dtype=torch.float32, layers=3, layer=1):
    """A per-layer view of a pool of all layers' states, strided by a slot as the engine's arena
    lays it out, NaN everywhere; returns (the whole pool, the layer's view)."""
    whole = torch.full((slots, layers, *inner), math.nan, dtype=dtype)
    return whole, whole[:, layer]
