"""Kernels: the ops the engine runs, as Triton kernels and their plain-torch references.

Callers import ops from here (`from cairn.kernels import store_kv`), never from an implementation.
Each op asks `_backend` which module implements it for the tensors it was given:
- CUDA tensors run `cairn.kernels.gpu` (compiled Triton, imported on first use);
- CPU tensors run `cairn.kernels.cpu` where it has the op and its C++ library built (the Gated
  DeltaNet's conv and delta rule, decode attention: `cairn.kernels.cpu_build`), else
  `cairn.kernels.reference` (fp32 torch: the rest of the CPU path, and the oracle every kernel, C++ or
  Triton, is tested against), `cairn.kernels.reference_varlen` (its varlen and slot forms),
  `cairn.kernels.reference_moe` (the mixture of experts) and `cairn.kernels.reference_fused` (the norms,
  rotary and gates a GPU runs as one launch each, `cairn.kernels.triton_fused`) and
  `cairn.kernels.reference_sample` (sampling's draw, which CUDA runs as batched torch ops too);
- `CAIRN_KERNELS=reference` in the environment (read at every call) or `force_reference(True)`
  sends every tensor to the references, CUDA's and the CPU's alike, for debugging a suspected
  kernel.
Interpreted Triton (`TRITON_INTERPRET=1`) is for the CPU tests only, which import the
`kernels.triton_*` modules directly. A process that imported triton interpreted cannot compile
kernels at all, so there CUDA tensors run the references, with a warning (a test session on a
GPU machine keeps working; tests/test_triton_gpu.py runs the compiled kernels in a child process).

Shapes, units and conventions are stated once, in `cairn.kernels.reference`. The varlen ops take an
optional `VarlenPlan` (cairn.kernels.varlen_plan): their tiles and chunks, built on the host once per
step by the engine, so that a step's launchers never read a length back from the device.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from cairn.kernels import reference, reference_fused, reference_moe, reference_sample, reference_varlen
from cairn.kernels.reference_moe import SharedExpert
from cairn.kernels.varlen_plan import VarlenPlan

__all__ = [
    "store_kv",
    "paged_attention_prefill",
    "paged_attention_decode",
    "causal_conv1d",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_rule",
    "gated_delta_rule_step",
    "copy_state_slots",
    "chunk_gated_delta_rule_varlen",
    "gated_delta_rule_step_slots",
    "causal_conv1d_varlen",
    "causal_conv1d_update_slots",
    "fused_moe",
    "SharedExpert",
    "rms_norm",
    "gated_rms_norm",
    "qk_norm_rope",
    "delta_gates",
    "sigmoid_gate",
    "silu_mul",
    "argmax_rows",
    "sample_rows",
    "penalise_rows",
    "mask_rows",
    "VarlenPlan",
    "force_reference",
    "load_native",
]

_forced_reference = False
_warned_interpreted = False


def force_reference(on: bool = True) -> None:
    """Run the torch references on every device (or, with on=False, go back to the default)."""
    global _forced_reference
    _forced_reference = bool(on)


def load_native(device) -> bool:
    """Loads (building it the first time) the C++ library CPU tensors run on, now rather than at
    the first op; True where it is in use. Anything but a CPU: False, nothing done."""
    if torch.device(device).type != "cpu":
        return False
    from cairn.kernels import cpu_build

    return cpu_build.library()


def _reference_forced() -> bool:
    return _forced_reference or os.environ.get("CAIRN_KERNELS", "").strip().lower() == "reference"


def _uses_native(tensor: Tensor) -> bool:
    """Whether `tensor`'s op runs `cairn.kernels.cpu` (a CPU tensor, its C++ library built)."""
    if tensor.device.type != "cpu" or _reference_forced():
        return False
    from cairn.kernels import cpu_build

    return cpu_build.library()


def _uses_triton(tensor: Tensor) -> bool:
    if not tensor.is_cuda or _reference_forced():
        return False
    from cairn.kernels import triton_common  # imports triton: only once CUDA tensors show up

    if triton_common.INTERPRETED:  # compiled kernels cannot run in this process (see cairn.kernels.gpu)
        global _warned_interpreted
        if not _warned_interpreted:
            _warned_interpreted = True
            warnings.warn("TRITON_INTERPRET=1 in this process: CUDA tensors run the torch reference ops",
                          RuntimeWarning, stacklevel=3)
        return False
    return True


def _backend(tensor: Tensor, native: bool = False) -> ModuleType:
    """The module implementing the `reference` ops on `tensor`'s device (`native`: an op
    `cairn.kernels.cpu` has too)."""
    if _uses_triton(tensor):
        return importlib.import_module("cairn.kernels.gpu")
    return importlib.import_module("cairn.kernels.cpu") if native and _uses_native(tensor) else reference


def _moe_backend(tensor: Tensor) -> ModuleType:
    """The module implementing `fused_moe` on `tensor`'s device."""
    return importlib.import_module("cairn.kernels.triton_moe") if _uses_triton(tensor) else reference_moe


def _fused_backend(tensor: Tensor) -> ModuleType:
    """The module implementing the `reference_fused` ops on `tensor`'s device (`cairn.kernels.cpu` has
    them all)."""
    if _uses_triton(tensor):
        return importlib.import_module("cairn.kernels.triton_fused")
    return importlib.import_module("cairn.kernels.cpu") if _uses_native(tensor) else reference_fused


def _varlen_backend(tensor: Tensor) -> ModuleType:
    """The module implementing the `reference_varlen` ops on `tensor`'s device (`cairn.kernels.cpu` has
    them all)."""
    if _uses_triton(tensor):
        return importlib.import_module("cairn.kernels.gpu")
    return importlib.import_module("cairn.kernels.cpu") if _uses_native(tensor) else reference_varlen


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """See `reference.store_kv`."""
    _backend(key).store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float,
                            plan: VarlenPlan | None = None) -> Tensor:
    """See `reference.paged_attention_prefill`."""
    return _backend(query, native=True).paged_attention_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q,
                                                                seq_lens, scale, plan)


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    """See `reference.paged_attention_decode`."""
    return _backend(query, native=True).paged_attention_decode(query, k_cache, v_cache, page_table, seq_lens, scale)


def causal_conv1d(x: Tensor, weight: Tensor, conv_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """See `reference.causal_conv1d`."""
    return _backend(x).causal_conv1d(x, weight, conv_state)


def causal_conv1d_update(x: Tensor, weight: Tensor, conv_state: Tensor) -> Tensor:
    """See `reference.causal_conv1d_update`."""
    return _backend(x).causal_conv1d_update(x, weight, conv_state)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                           initial_state: Tensor | None = None, *, scale: float | None = None,
                           chunk_size: int = 64, use_qk_l2norm: bool = True,
                           state_positions: Sequence[int] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """See `reference.chunk_gated_delta_rule`."""
    return _backend(v).chunk_gated_delta_rule(q, k, v, g, beta, initial_state, scale=scale,
                                              chunk_size=chunk_size, use_qk_l2norm=use_qk_l2norm,
                                              state_positions=state_positions)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               initial_state: Tensor | None = None, *, scale: float | None = None,
                               use_qk_l2norm: bool = True) -> tuple[Tensor, Tensor]:
    """See `reference.recurrent_gated_delta_rule`."""
    return _backend(v).recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, scale=scale,
                                                  use_qk_l2norm=use_qk_l2norm)


def gated_delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
                          scale: float | None = None, use_qk_l2norm: bool = True) -> Tensor:
    """See `reference.gated_delta_rule_step`."""
    return _backend(v).gated_delta_rule_step(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm)


def copy_state_slots(tensors: Sequence[Tensor], src_slots: Tensor, dst_slots: Tensor) -> None:
    """See `reference.copy_state_slots`."""
    _backend(tensors[0] if tensors else src_slots).copy_state_slots(tensors, src_slots, dst_slots)


def chunk_gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                  state_pool: Tensor, state_slots: Tensor, *, scale: float | None = None,
                                  use_qk_l2norm: bool = True, state_positions: Sequence[Sequence[int]] = (),
                                  plan: VarlenPlan | None = None) -> tuple[Tensor, Tensor]:
    """See `reference_varlen.chunk_gated_delta_rule_varlen`."""
    return _varlen_backend(v).chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens, state_pool, state_slots,
                                                            scale=scale, use_qk_l2norm=use_qk_l2norm,
                                                            state_positions=state_positions, plan=plan)


def gated_delta_rule_step_slots(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                                state_slots: Tensor, *, scale: float | None = None,
                                use_qk_l2norm: bool = True) -> Tensor:
    """See `reference_varlen.gated_delta_rule_step_slots`."""
    return _varlen_backend(v).gated_delta_rule_step_slots(q, k, v, g, beta, state_pool, state_slots, scale=scale,
                                                          use_qk_l2norm=use_qk_l2norm)


def causal_conv1d_varlen(x: Tensor, weight: Tensor, cu_seqlens: Tensor, conv_pool: Tensor,
                         state_slots: Tensor, plan: VarlenPlan | None = None) -> Tensor:
    """See `reference_varlen.causal_conv1d_varlen`."""
    return _varlen_backend(x).causal_conv1d_varlen(x, weight, cu_seqlens, conv_pool, state_slots, plan)


def causal_conv1d_update_slots(x: Tensor, weight: Tensor, conv_pool: Tensor, state_slots: Tensor) -> Tensor:
    """See `reference_varlen.causal_conv1d_update_slots`."""
    return _varlen_backend(x).causal_conv1d_update_slots(x, weight, conv_pool, state_slots)


def fused_moe(x: Tensor, logits: Tensor, gate_up: Tensor, down: Tensor, top_k: int,
              renormalize: bool = True, shared: SharedExpert | None = None) -> Tensor:
    """See `reference_moe.fused_moe`."""
    return _moe_backend(x).fused_moe(x, logits, gate_up, down, top_k, renormalize, shared)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
    """See `reference_fused.rms_norm`."""
    return _fused_backend(x).rms_norm(x, weight, eps, residual)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """See `reference_fused.gated_rms_norm`."""
    return _fused_backend(x).gated_rms_norm(x, gate, weight, eps)


def qk_norm_rope(q: Tensor, k: Tensor, q_weight: Tensor, k_weight: Tensor, positions: Tensor, inv_freq: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """See `reference_fused.qk_norm_rope`."""
    return _fused_backend(q).qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps)


def delta_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """See `reference_fused.delta_gates`."""
    return _fused_backend(a).delta_gates(a, b, A_log, dt_bias)


def sigmoid_gate(x: Tensor, gate: Tensor) -> Tensor:
    """See `reference_fused.sigmoid_gate`."""
    return _fused_backend(x).sigmoid_gate(x, gate)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """See `reference_fused.silu_mul`."""
    return _fused_backend(gate).silu_mul(gate, up)


def argmax_rows(logits: Tensor) -> Tensor:
    """See `reference.argmax_rows`."""
    return _backend(logits, native=True).argmax_rows(logits)


def mask_rows(x: Tensor, at: Tensor, words: Tensor) -> None:
    """See `reference_sample.mask_rows`."""
    if _uses_native(x) and x.dtype == torch.float32 and x.stride(1) == 1:
        importlib.import_module("cairn.kernels.cpu").mask_rows(x, at, words)
    else:
        reference_sample.mask_rows(x, at, words)


def penalise_rows(x: Tensor, at: Tensor, rows: Tensor, counts: Tensor, prompt: Tensor, values: Tensor) -> None:
    """See `reference_sample.penalise_rows`."""
    if _uses_native(x) and x.dtype == torch.float32 and x.stride(1) == 1:
        importlib.import_module("cairn.kernels.cpu").penalise_rows(x, at, rows, counts, prompt, values)
    else:
        reference_sample.penalise_rows(x, at, rows, counts, prompt, values)


def sample_rows(x: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, u: Tensor,
                host: tuple[list[int], list[float], list[float]] | None = None) -> Tensor:
    """See `reference_sample.sample_rows` (CUDA runs it too: batched torch ops on the device)."""
    if _uses_native(x):
        return importlib.import_module("cairn.kernels.cpu").sample_rows(x, temperature, top_k, top_p, min_p, u)
    return reference_sample.sample_rows(x, temperature, top_k, top_p, min_p, u, host)
