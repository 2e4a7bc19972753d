"""Fixtures the op folders' tests share."""

import pytest


@pytest.fixture
def the_references():
    """Ops called through `cairn.kernels` run their references (CPU tensors would run the C++
    kernels, held to these references in each folder's test_cpu_ops.py)."""
    from cairn import kernels

    kernels.force_reference(True)
    yield
    kernels.force_reference(False)


@pytest.fixture
def nan_filled_buffers(monkeypatch):
    """Every buffer a Triton launcher allocates starts as NaN: a kernel that leaves part of its
    output unwritten fails."""
    import math

    from cairn.kernels.common import triton_helpers

    monkeypatch.setattr(triton_helpers, "FILL", math.nan)


@pytest.fixture
def native_library():
    """The C++ library loaded (built the first time), for tests that launch its ops directly."""
    from cairn.kernels.common import native

    if not native.library():
        pytest.fail(f"the CPU kernels did not build: {native.build_error()}")
