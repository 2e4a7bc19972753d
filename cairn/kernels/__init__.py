"""Kernels: the ops the engine runs, one folder an op, each the op's one entry point.

Callers import ops from here (`from cairn.kernels import store_kv`), never from an implementation:
- `attention/`: `store_kv`, `paged_attention_prefill`, `paged_attention_decode`;
- `conv/`: the Gated DeltaNet's causal conv (`causal_conv1d_varlen`, `causal_conv1d_update_slots`,
  and the single-sequence `causal_conv1d`, `causal_conv1d_update`);
- `delta_rule/`: the gated delta rule, chunked and recurrent (`chunk_gated_delta_rule_varlen`,
  `gated_delta_rule_step_slots`; single-sequence `chunk_gated_delta_rule`,
  `recurrent_gated_delta_rule`, `gated_delta_rule_step`);
- `norms/`: the fused row ops (`rms_norm`, `gated_rms_norm`, `qk_norm_rope`, `delta_gates`,
  `sigmoid_gate`, `silu_mul`);
- `moe/`: `fused_moe` (with a `SharedExpert`);
- `sample/`: `argmax_rows`, `sample_rows`, `row_probs`, `draw_rows`, `penalise_rows`, `mask_rows`;
- `state/`: `copy_state_slots`.
An op folder holds its Triton kernels (`triton_ops.py`; the delta rule's `triton_chunk.py` and
`triton_recurrent.py`), its C++ CPU kernel (`*.cpp`) and launcher (`cpu_ops.py`), torch
implementations where torch is the chosen one (`torch_ops.py`), its launch shapes and autotune
configs (`tuning.py`), and its torch `reference.py`: the op's contract, its oracle in the tests,
and the slow fallback only (`common/dispatch.py` says when). `common/` is what they share.

`force_reference(True)` or `CAIRN_KERNELS=reference` runs the references everywhere, to rule out a
suspected kernel; `load_native(device)` builds or loads the C++ library now rather than at the
first op. The varlen ops take an optional `VarlenPlan`: their tiles and chunks, built on the host
once per step by the engine, so that a step's launchers never read a length back from the device.
"""

from __future__ import annotations

import torch

from cairn.kernels.attention import paged_attention_decode, paged_attention_prefill, store_kv
from cairn.kernels.common.dispatch import force_reference
from cairn.kernels.common.varlen_plan import VarlenPlan
from cairn.kernels.conv import causal_conv1d, causal_conv1d_update, causal_conv1d_update_slots, causal_conv1d_varlen
from cairn.kernels.delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_varlen,
    gated_delta_rule_step,
    gated_delta_rule_step_slots,
    recurrent_gated_delta_rule,
)
from cairn.kernels.moe import SharedExpert, fused_moe
from cairn.kernels.norms import delta_gates, gated_rms_norm, qk_norm_rope, rms_norm, sigmoid_gate, silu_mul
from cairn.kernels.sample import argmax_rows, draw_rows, mask_rows, penalise_rows, row_probs, sample_rows
from cairn.kernels.state import copy_state_slots

__all__ = [
    "store_kv", "paged_attention_prefill", "paged_attention_decode",
    "causal_conv1d", "causal_conv1d_update", "causal_conv1d_varlen", "causal_conv1d_update_slots",
    "chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_rule_step",
    "chunk_gated_delta_rule_varlen", "gated_delta_rule_step_slots",
    "rms_norm", "gated_rms_norm", "qk_norm_rope", "delta_gates", "sigmoid_gate", "silu_mul",
    "fused_moe", "SharedExpert",
    "argmax_rows", "sample_rows", "row_probs", "draw_rows", "penalise_rows", "mask_rows",
    "copy_state_slots",
    "VarlenPlan", "force_reference", "load_native",
]


def load_native(device) -> bool:
    """Loads (building it the first time) the C++ library CPU tensors run on, now rather than at
    the first op; True where it is in use. Anything but a CPU: False, nothing done."""
    if torch.device(device).type != "cpu":
        return False
    from cairn.kernels.common import native

    return native.library()
