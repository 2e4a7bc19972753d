"""The CUDA backend: every op of `reference` and `reference_varlen`, as compiled Triton kernels
(greedy sampling's `argmax_rows` as torch's own ops on the device).

`kernels._backend` imports this module for CUDA tensors. A process runs Triton either compiled or
interpreted, fixed when triton is first imported: under TRITON_INTERPRET=1 (which the CPU tests
set) even triton's own `tl.sum` is interpreted and no kernel can compile. So this module refuses
to load in such a process, with an error that says so, rather than failing at a first launch.
"""

from __future__ import annotations

from cairn.kernels import triton_common

if triton_common.INTERPRETED:
    raise ImportError("cairn.kernels.gpu runs compiled Triton, but this process imported triton with "
                      "TRITON_INTERPRET=1 (as the CPU tests do): run CUDA work in a process without it")

from cairn.kernels.triton_attention import paged_attention_decode, paged_attention_prefill, store_kv  # noqa: E402
from cairn.kernels.triton_conv import (  # noqa: E402
    causal_conv1d,
    causal_conv1d_update,
    causal_conv1d_update_slots,
    causal_conv1d_varlen,
)
from cairn.kernels.triton_delta_recurrent import (  # noqa: E402
    gated_delta_rule_step,
    gated_delta_rule_step_slots,
    recurrent_gated_delta_rule,
)
from cairn.kernels.triton_delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_varlen  # noqa: E402
from cairn.kernels.triton_state import copy_state_slots  # noqa: E402
from cairn.kernels.reference import argmax_rows  # noqa: E402  (torch's max and where on the device: no kernel of ours)

__all__ = [
    "store_kv", "paged_attention_prefill", "paged_attention_decode", "causal_conv1d", "causal_conv1d_update",
    "causal_conv1d_varlen", "causal_conv1d_update_slots", "chunk_gated_delta_rule", "chunk_gated_delta_rule_varlen",
    "recurrent_gated_delta_rule", "gated_delta_rule_step", "gated_delta_rule_step_slots", "copy_state_slots",
    "argmax_rows",
]
