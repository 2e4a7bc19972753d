"""Sampling's row ops: `argmax_rows` (greedy), `sample_rows` (the draw), `row_probs` (the
distribution it draws from) and `draw_rows` (its inverse CDF over any weights: speculative
decoding's residual draws), `penalise_rows`, `mask_rows` (a grammar's mask). The op's one entry
point (`cairn.kernels.common.dispatch`); contracts: sample/torch_ops.py; oracle:
sample/reference.py.

| device | every op |
|---|---|
| CUDA | torch_ops (batched torch ops on the device: no kernel of ours yet) |
| CPU (C++ library) | cpu_ops (fp32 rows; other masks and penalties: torch_ops) |
| CPU (no library) | torch_ops |
"""

from __future__ import annotations

from torch import Tensor

from cairn.kernels.common.dispatch import Ops

__all__ = ["argmax_rows", "sample_rows", "row_probs", "draw_rows", "penalise_rows", "mask_rows"]

OPS = Ops(cuda=("cairn.kernels.sample.torch_ops",),
          cpu=("cairn.kernels.sample.cpu_ops", "cairn.kernels.sample.torch_ops"),
          fallback="cairn.kernels.sample.reference")


def argmax_rows(logits: Tensor) -> Tensor:
    return OPS.pick("argmax_rows", logits)(logits)


def mask_rows(x: Tensor, at: Tensor, words: Tensor) -> None:
    OPS.pick("mask_rows", x)(x, at, words)


def penalise_rows(x: Tensor, at: Tensor, rows: Tensor, counts: Tensor, prompt: Tensor, values: Tensor) -> None:
    OPS.pick("penalise_rows", x)(x, at, rows, counts, prompt, values)


def sample_rows(x: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, u: Tensor,
                host: tuple[list[int], list[float], list[float]] | None = None) -> Tensor:
    """`host`: the rows' top_k, top_p and min_p as lists, so CUDA picks branches without a sync."""
    return OPS.pick("sample_rows", x)(x, temperature, top_k, top_p, min_p, u, host)


def row_probs(x: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
              host: tuple[list[int], list[float], list[float]] | None = None) -> Tensor:
    return OPS.pick("row_probs", x)(x, temperature, top_k, top_p, min_p, host)


def draw_rows(w: Tensor, u: Tensor) -> Tensor:
    return OPS.pick("draw_rows", w)(w, u)
