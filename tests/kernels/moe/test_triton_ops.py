"""The fused MoE's Triton op (interpreted on CPU) against its reference at odd shapes, its align
step against `reference.align` (many programs, not one), and the properties a CUDA graph relies
on: seven kernels and no other op, no host sync, and launch grids fixed by (tokens, experts, top k)
whatever the routing.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cairn import kernels
from cairn.kernels.moe import reference as moe_ref
from cairn.kernels.moe import torch_ops as moe_torch
from cairn.kernels.moe import triton_ops as moe_triton
from tests.kernels.conventions import TOL, triton_interpreted

H, I = 40, 24  # neither a power of two nor a block multiple


pytestmark = [triton_interpreted, pytest.mark.usefixtures("nan_filled_buffers")]


def moe_inputs(T: int, E: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g) * 2
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    return x, logits, gate_up, down


def shared_inputs(width: int = I, seed: int = 9, dtype=torch.float32) -> moe_ref.SharedExpert:
    g = torch.Generator().manual_seed(seed)
    return moe_ref.SharedExpert(*((torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)
                                        for shape in ((width, H), (width, H), (H, width), (1, H))))


KERNELS = {name: getattr(moe_triton, name) for name in (
    "_route_kernel", "_align_count_kernel", "_align_offsets_kernel", "_align_scatter_kernel", "_gate_up_kernel",
    "_down_kernel", "_sum_kernel")}
ALIGN = ["_align_count_kernel", "_align_offsets_kernel", "_align_scatter_kernel"]


class AtenOps(TorchDispatchMode):
    """The aten ops the launcher's host code runs, allocations aside, and not while a kernel runs
    (the interpreter's own tensor work is the GPU's there)."""
    ALLOCATIONS = {"empty.memory_format", "full.default", "empty_strided.default"}

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_kernel and func.__name__ not in self.ALLOCATIONS:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


class Recorder:
    """Stands in for a jitted kernel: records each launch's grid, then launches it."""

    def __init__(self, kernel, launches: list, ops: AtenOps):
        self.kernel, self.launches, self.ops = kernel, launches, ops

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            # a tuned kernel's grid is a function of its config (interpreted: the first, fixed)
            config = self.kernel.config_for(kwargs) if callable(grid) else None
            self.launches.append((self.kernel.fn.__name__, tuple(grid(config) if callable(grid) else grid)))
            self.ops.in_kernel = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.ops.in_kernel = False
        return launch


def recording(monkeypatch) -> tuple[list, AtenOps]:
    launches: list = []
    ops = AtenOps()
    for name, kernel in KERNELS.items():
        monkeypatch.setattr(moe_triton, name, Recorder(kernel, launches, ops))
    return launches, ops


def launches_of(monkeypatch, x, logits, gate_up, down, k, shared=None) -> tuple[list, list[str]]:
    launches, ops = recording(monkeypatch)
    with ops:
        moe_triton.fused_moe(x, logits, gate_up, down, k, shared=shared)
    return launches, ops.ops


def routed_ids(T: int, E: int, k: int, seed: int = 0) -> torch.Tensor:
    """Expert ids [T * k] as routing gives them: k distinct experts a token."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).flatten().to(torch.int32)


def assert_aligned_like_the_reference(ids: torch.Tensor, E: int, block_m: int) -> None:
    got = moe_triton.align(ids, E, block_m)
    want = moe_ref.align(ids, E, block_m)
    for name, g, w in zip(("sorted_pairs", "block_expert", "num_padded"), got, want):
        assert torch.equal(g, w), name


@pytest.mark.parametrize("E, k", [(6, 2), (256, 8), (512, 10)])
@pytest.mark.parametrize("T", [1, 7, 65])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align_matches_the_reference(E, k, T, block_m):
    assert_aligned_like_the_reference(routed_ids(T, E, k, seed=T * E), E, block_m)


@pytest.mark.slow
@pytest.mark.parametrize("E, k", [(6, 2), (256, 8), (512, 10)])
def test_align_of_a_4k_prefill_matches_the_reference_over_many_programs(monkeypatch, E, k):
    ids = routed_ids(4096, E, k, seed=E)
    launches, _ = recording(monkeypatch)
    assert_aligned_like_the_reference(ids, E, 64)
    grids = dict(launches)
    assert grids["_align_count_kernel"][0] >= 32 and grids["_align_scatter_kernel"][0] >= 32, grids
    assert grids["_align_offsets_kernel"] == (1,)  # the one serial step: C x E counts, not N pairs


def test_align_with_experts_that_get_no_pair_and_every_pair_on_one_expert():
    ids = routed_ids(65, 16, 2, seed=1)
    ids[ids == 3] = 5  # expert 3 gets nothing; 5 may now hold a token twice, as align allows
    assert_aligned_like_the_reference(ids, 16, 16)
    assert_aligned_like_the_reference(torch.full((130,), 7, dtype=torch.int32), 16, 16)  # one expert has all
    assert_aligned_like_the_reference(torch.full((130,), 0, dtype=torch.int32), 512, 64)
    assert_aligned_like_the_reference(torch.full((130,), 511, dtype=torch.int32), 512, 64)


@pytest.mark.parametrize("E, k", [(6, 2), (64, 8)])
@pytest.mark.parametrize("T", [1, 7, 65])
@pytest.mark.parametrize("renormalize", [True, False])
def test_triton_moe_matches_the_reference(E, k, T, renormalize):
    x, logits, gate_up, down = moe_inputs(T, E, seed=T + E)
    want = moe_ref.fused_moe(x, logits, gate_up, down, k, renormalize)
    got = moe_triton.fused_moe(x, logits, gate_up, down, k, renormalize)
    torch.testing.assert_close(got, want, **TOL)


def test_bf16_weights_and_activations_stay_within_bf16_rounding_of_the_reference():
    x, logits, gate_up, down = moe_inputs(17, 64, seed=3, dtype=torch.bfloat16)
    got = moe_triton.fused_moe(x, logits, gate_up, down, 8)
    want = moe_ref.fused_moe(x, logits, gate_up, down, 8)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1.5e-2


def test_experts_that_get_no_token_and_every_token_on_one_expert():
    x, logits, gate_up, down = moe_inputs(33, 6, seed=5)
    logits[:, 4] = -1e4  # expert 4 gets no token
    logits[:, 2] += 30.0  # every token's first choice is expert 2
    experts = torch.topk(logits.float().softmax(-1), 2).indices
    assert (experts[:, 0] == 2).all() and not (experts == 4).any()
    torch.testing.assert_close(moe_triton.fused_moe(x, logits, gate_up, down, 2),
                               moe_ref.fused_moe(x, logits, gate_up, down, 2), **TOL)


@pytest.mark.parametrize("E, k", [(6, 2), (64, 8)])
@pytest.mark.parametrize("T", [1, 7, 65])
def test_a_shared_expert_rides_in_the_routed_experts_launches(E, k, T):
    x, logits, gate_up, down = moe_inputs(T, E, seed=T * E)
    shared = shared_inputs(seed=T)
    torch.testing.assert_close(moe_triton.fused_moe(x, logits, gate_up, down, k, shared=shared),
                               moe_ref.fused_moe(x, logits, gate_up, down, k, shared=shared), **TOL)


def test_a_shared_expert_of_another_width_runs_beside_them():
    x, logits, gate_up, down = moe_inputs(7, 6, seed=2)
    shared = shared_inputs(width=2 * I + 3)
    torch.testing.assert_close(moe_triton.fused_moe(x, logits, gate_up, down, 2, shared=shared),
                               moe_ref.fused_moe(x, logits, gate_up, down, 2, shared=shared), **TOL)


def test_bf16_with_a_shared_expert_stays_within_bf16_rounding():
    x, logits, gate_up, down = moe_inputs(17, 64, seed=4, dtype=torch.bfloat16)
    shared = shared_inputs(dtype=torch.bfloat16)
    got = moe_triton.fused_moe(x, logits, gate_up, down, 8, shared=shared).float()
    want = moe_ref.fused_moe(x, logits, gate_up, down, 8, shared=shared).float()
    assert ((got - want).norm() / want.norm()).item() < 1.5e-2


def test_no_tokens_give_an_empty_output():
    x, logits, gate_up, down = moe_inputs(0, 6)
    assert moe_triton.fused_moe(x, logits, gate_up, down, 2).shape == (0, H)


@pytest.mark.parametrize("with_shared", [False, True])
def test_seven_kernels_no_other_op_and_grids_fixed_by_the_shapes_not_the_routing(monkeypatch, with_shared):
    x, logits, gate_up, down = moe_inputs(9, 64, seed=1)
    shared = shared_inputs() if with_shared else None
    spread, ops = launches_of(monkeypatch, x, logits, gate_up, down, 8, shared)
    assert [name for name, _ in spread] == ["_route_kernel", *ALIGN, "_gate_up_kernel", "_down_kernel",
                                         "_sum_kernel"]
    # no cast (the sum writes x's dtype), no host sync (`_local_scalar_dense` is what .item() and .tolist() run), no
    # routing-sized op (nonzero, unique): the host code only allocates and launches
    assert ops == [], ops
    skewed = logits.clone()
    skewed[:, :8] += 50.0  # every token on the same 8 experts
    assert launches_of(monkeypatch, x, skewed, gate_up, down, 8, shared)[0] == spread


def test_the_op_on_cpu_tensors_runs_the_torch_op(monkeypatch):
    calls = []
    monkeypatch.setattr(moe_torch, "fused_moe",
                        lambda *a, **kw: calls.append(a[0].shape) or torch.zeros_like(a[0]))
    x, logits, gate_up, down = moe_inputs(3, 6)
    kernels.fused_moe(x, logits, gate_up, down, 2, True)
    assert calls == [(3, H)]


def test_bad_shapes_are_refused_with_what_was_expected():
    x, logits, gate_up, down = moe_inputs(4, 6)
    with pytest.raises(ValueError, match=r"expected logits \[T, E\]"):
        moe_triton.fused_moe(x, logits[:, :5], gate_up, down, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe_triton.fused_moe(x, logits, gate_up, down, 7)
    with pytest.raises(ValueError, match=r"expected down \[E, H, I\]"):
        moe_triton.fused_moe(x, logits, gate_up, down[:, :, :-1], 2)

