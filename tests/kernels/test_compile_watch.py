"""compile_watch's interpreted keys follow Triton's specialisation rules: a launch counts as a
compile when a compiled launch would compile (a new constexpr, launch option, argument type, an
integer becoming 1 or a multiple of 16, a pointer's 16-byte alignment), and not otherwise (a new
integer value of the same class, an argument the kernel does not specialise on)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from cairn.kernels.common import compile_watch, triton_helpers
from tests.kernels.conventions import triton_interpreted

pytestmark = triton_interpreted


@triton.jit
def _scale_kernel(x, y, n, m, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n, other=0.0) * FACTOR, mask=i < n)


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["x"])
def _lenient_kernel(x, y, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n, other=0.0), mask=i < n)


@pytest.fixture(autouse=True)
def installed(fresh_compile_watch):
    compile_watch.install(triton_helpers.INTERPRETED)
    assert triton_helpers.INTERPRETED


def compiles_of(launch) -> int:
    before = compile_watch.compiles()
    launch()
    return compile_watch.compiles() - before


def test_a_launch_counts_as_a_compile_exactly_when_its_specialisation_is_new():
    x, y = torch.randn(64), torch.empty(64)
    scale = _scale_kernel[(1,)]
    assert compiles_of(lambda: scale(x, y, 7, 3, FACTOR=2.0, BLOCK=64)) == 1
    assert compiles_of(lambda: scale(x, y, 5, 9, FACTOR=2.0, BLOCK=64)) == 0  # same classes: neither 1 nor /16
    assert compiles_of(lambda: scale(x, y, 32, 9, FACTOR=2.0, BLOCK=64)) == 1  # n divisible by 16
    assert compiles_of(lambda: scale(x, y, 48, 3, FACTOR=2.0, BLOCK=64)) == 0
    assert compiles_of(lambda: scale(x, y, 7, 1, FACTOR=2.0, BLOCK=64)) == 1  # m == 1
    assert compiles_of(lambda: scale(x, y, 7, 3, FACTOR=3.0, BLOCK=64)) == 1  # a constexpr
    assert compiles_of(lambda: scale(x, y, 7, 3, FACTOR=2.0, BLOCK=64, num_warps=8)) == 1  # a launch option
    assert compiles_of(lambda: scale(x[1:], y, 7, 3, FACTOR=2.0, BLOCK=32)) == 1  # x 4 bytes off 16 (BLOCK new too)
    assert compiles_of(lambda: scale(x[1:], y, 7, 3, FACTOR=2.0, BLOCK=32)) == 0
    assert compiles_of(lambda: scale(x[1:], y, 7, 3, FACTOR=2.0, BLOCK=32)) == 0
    assert compiles_of(lambda: scale(x[4:], y, 7, 3, FACTOR=2.0, BLOCK=32)) == 1  # aligned again
    assert compiles_of(lambda: scale(x.double(), y.double(), 7, 3, FACTOR=2.0, BLOCK=64)) == 1  # a dtype


def test_arguments_a_kernel_does_not_specialise_on_never_count():
    x, y = torch.randn(64), torch.empty(64)
    lenient = _lenient_kernel[(1,)]
    assert compiles_of(lambda: lenient(x, y, 7, BLOCK=64)) == 1
    assert compiles_of(lambda: lenient(x, y, 16, BLOCK=64)) == 0
    assert compiles_of(lambda: lenient(x, y, 1, BLOCK=64)) == 0
    assert compiles_of(lambda: lenient(x[1:], y, 7, BLOCK=64)) == 0  # x's alignment is not specialised on
    assert compiles_of(lambda: lenient(x, y[1:], 7, BLOCK=64)) == 1  # y's is
    assert [kernel for kernel, _ in compile_watch.seen()] == ["_lenient_kernel"] * 2
