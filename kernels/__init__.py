"""Kernels: the ops the engine runs, as Triton kernels and their plain-torch references.

Callers import ops from here (`from kernels import store_kv`), never from an implementation.
Each op asks `_backend` which module implements it for the tensors it was given. Today every op
runs `kernels.reference` (fp32 torch: the CPU path, and the oracle every Triton kernel is tested
against). A Triton module for CUDA tensors slots in by being returned from `_backend`; it
implements the same functions with the same signatures.

Shapes, units and conventions are stated once, in `kernels.reference`.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

from torch import Tensor

from kernels import reference

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
]


def _backend(tensor: Tensor) -> ModuleType:
    """The module implementing ops on `tensor`'s device (today always the reference)."""
    return reference


def store_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """See `reference.store_kv`."""
    _backend(key).store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_prefill(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                            cu_seqlens_q: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
    """See `reference.paged_attention_prefill`."""
    return _backend(query).paged_attention_prefill(query, k_cache, v_cache, page_table, cu_seqlens_q,
                                                   seq_lens, scale)


def paged_attention_decode(query: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                           seq_lens: Tensor, scale: float) -> Tensor:
    """See `reference.paged_attention_decode`."""
    return _backend(query).paged_attention_decode(query, k_cache, v_cache, page_table, seq_lens, scale)


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
