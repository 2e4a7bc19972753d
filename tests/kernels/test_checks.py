"""Every implementation of an op (its reference, C++ launcher, torch op and interpreted Triton
launcher) refuses a bad call the same way, through the shared checks
(cairn/kernels/common/checks.py): ValueError("expected …, got …"), before any work."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from cairn.kernels.common import native, triton_helpers

PAGE, NUM_PAGES, H_Q, H_KV, D = 8, 40, 6, 2, 12
H_K, H_V, D_K, D_V = 2, 6, 24, 20
CHANNELS, WIDTH = 10, 4


def implementations(package: str) -> list:
    """Every module that implements ops of `cairn.kernels.<package>` in this process."""
    ops = importlib.import_module(f"cairn.kernels.{package}").OPS
    names = list(ops.cuda + ops.cpu) + [ops.fallback]
    modules = [importlib.import_module(n) for n in names]
    return [m for m in modules if not getattr(m, "NATIVE", False) or native.library()]


def delta(length: int = 4):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(length, H_K, D_K, generator=gen), torch.randn(length, H_K, D_K, generator=gen),
            torch.randn(length, H_V, D_V, generator=gen), -torch.rand(length, H_V, generator=gen),
            torch.rand(length, H_V, generator=gen))


def pool(slots: int = 2, dtype=torch.float32):
    return torch.zeros(slots, H_V, D_K, D_V, dtype=dtype)


def caches():
    shape = (NUM_PAGES, PAGE, H_KV, D)
    return torch.full(shape, math.nan), torch.full(shape, math.nan)


TABLE, LENS = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
CU2 = torch.tensor([0, 1, 2], dtype=torch.int32)
KV = torch.randn(2, H_KV, D)
WEIGHT = torch.randn(CHANNELS, WIDTH)
SLOTS = torch.tensor([0, 1])

# case -> (op package, op, (args, kwargs))
CASES = {
    "key head dim": ("attention", "store_kv", lambda: ((torch.randn(2, H_KV, D + 1), KV, *caches(), SLOTS), {})),
    "int32 slots": ("attention", "store_kv", lambda: ((KV, KV, *caches(), SLOTS.int()), {})),
    "query heads": ("attention", "paged_attention_prefill",
                    lambda: ((torch.randn(2, 5, D), *caches(), TABLE, CU2, LENS, 1.0), {})),
    "int64 table": ("attention", "paged_attention_decode",
                    lambda: ((torch.randn(2, H_Q, D), *caches(), TABLE.long(), LENS, 1.0), {})),
    "decode seq_lens": ("attention", "paged_attention_decode",
                        lambda: ((torch.randn(2, H_Q, D), *caches(), TABLE, LENS[:1], 1.0), {})),
    "conv state width": ("conv", "causal_conv1d", lambda: ((torch.randn(3, CHANNELS), WEIGHT,
                                                            torch.zeros(CHANNELS, WIDTH)), {})),
    "conv pool width": ("conv", "causal_conv1d_update_slots",
                        lambda: ((torch.randn(2, CHANNELS), WEIGHT, torch.zeros(4, CHANNELS, WIDTH), SLOTS), {})),
    "conv cu_seqlens end": ("conv", "causal_conv1d_varlen",
                            lambda: ((torch.randn(3, CHANNELS), WEIGHT, CU2, torch.zeros(4, CHANNELS, WIDTH - 1),
                                      SLOTS), {})),
    "value heads": ("delta_rule", "chunk_gated_delta_rule",
                    lambda: ((*delta()[:2], torch.randn(4, 3, D_V), *(t[:, :3] for t in delta()[3:])), {})),
    "position past the end": ("delta_rule", "chunk_gated_delta_rule", lambda: (delta(), {"state_positions": [5]})),
    "delta cu_seqlens end": ("delta_rule", "chunk_gated_delta_rule_varlen",
                             lambda: ((*delta(), torch.tensor([0, 3], dtype=torch.int32), pool(), SLOTS[:1]), {})),
    "fp64 pool": ("delta_rule", "gated_delta_rule_step_slots",
                  lambda: ((*delta(2), pool(dtype=torch.float64), SLOTS), {})),
    "int32 state slots": ("delta_rule", "gated_delta_rule_step_slots", lambda: ((*delta(2), pool(), SLOTS.int()), {})),
    "slot lengths": ("state", "copy_state_slots", lambda: (([torch.zeros(4, 2)], SLOTS, torch.tensor([2])), {})),
    "expert widths": ("moe", "fused_moe", lambda: ((torch.randn(3, 8), torch.randn(3, 4), torch.randn(4, 10, 8),
                                                    torch.randn(4, 8, 4), 2), {})),
    "top_k past the experts": ("moe", "fused_moe", lambda: ((torch.randn(3, 8), torch.randn(3, 4),
                                                             torch.randn(4, 10, 8), torch.randn(4, 8, 5), 5), {})),
}


@pytest.mark.skipif(not triton_helpers.INTERPRETED, reason="runs the Triton launchers interpreted on CPU tensors")
@pytest.mark.parametrize("case", list(CASES))
def test_every_implementation_refuses_a_bad_call_with_what_was_expected(case):
    package, op, make = CASES[case]
    modules = [m for m in implementations(package) if hasattr(m, op)]
    assert len(modules) >= 2, [m.__name__ for m in modules]  # the reference and at least one more
    for module in modules:
        args, kwargs = make()
        with pytest.raises(ValueError, match="expected"):
            getattr(module, op)(*args, **kwargs)
