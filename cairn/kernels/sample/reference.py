"""Sampling defined row by row, with a sort and a float64 cumulative sum: the oracle of the C++
kernels (sample/cpu_ops.py) and of the batched torch ops (sample/torch_ops.py, whose docstring
states the contract), and the slow fallback (`cairn.kernels.common.dispatch`).

Where the implementations avoid a sort (a radix select for top-p) and a vocabulary-long cumulative
sum (a two-level draw), this sorts each row by weight (stable: ties keep the lower id first) and
draws by one float64 inverse CDF: the same tokens, but where rounding moves a boundary.
"""

from __future__ import annotations

import torch

from cairn.kernels.common.checks import check_rows


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    check_rows("logits", logits)
    out = []
    for row in logits.float():
        best = float(row.max()) if row.numel() else float("nan")
        out.append(int((row == best).nonzero()[0]) if row.numel() and abs(best) != float("inf") and best == best
                   else -1)
    return torch.tensor(out, dtype=torch.int64, device=logits.device)


def _kept(w: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row's weights after min-p, top-k and top-p (float64)."""
    w = torch.where(w >= min_p, w, 0.0) if min_p > 0 else w
    order = torch.sort(w, descending=True, stable=True).indices
    if 0 < top_k < w.shape[0]:
        keep = order[:top_k]
        vals = w[keep]
        before = vals.cumsum(0) - vals
        vals = torch.where((before < top_p * vals.sum()) | (top_p >= 1.0), vals, 0.0)
        return torch.zeros_like(w).index_put_((keep,), vals)
    if top_p < 1.0:
        sorted_w = w[order]
        _, group, counts = torch.unique_consecutive(sorted_w, return_inverse=True, return_counts=True)
        first = counts.cumsum(0) - counts  # each tie group's first sorted position
        larger = torch.empty_like(w)  # the mass of the tokens of strictly larger weight than each
        larger[order] = (sorted_w.cumsum(0) - sorted_w)[first][group]
        return torch.where(larger < top_p * w.sum(), w, 0.0)
    return w


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor, host=None) -> torch.Tensor:
    check_rows("x", x)
    out = []
    for r in range(x.shape[0]):
        row, t = x[r].double(), float(temperature[r])
        peak = float(row.max())
        if not abs(peak / t) < float("inf"):  # a temperature too small to divide by: greedy
            out.append(int(row.argmax()))
            continue
        w = _kept(((row - peak) / t).exp(), int(top_k[r]), float(top_p[r]), float(min_p[r]))
        cum = w.cumsum(0)
        out.append(min(int(torch.searchsorted(cum, float(u[r]) * float(cum[-1]), right=True)), row.shape[0] - 1))
    return torch.tensor(out, dtype=torch.int64, device=x.device)


def mask_rows(x: torch.Tensor, at: torch.Tensor, words: torch.Tensor) -> None:
    token = torch.arange(x.shape[1], device=x.device)
    for i, r in enumerate(at.tolist()):
        allowed = (words[i].long()[token // 32] >> (token % 32)) & 1  # bit j of word k: token 32 k + j
        x[r] = x[r].masked_fill(allowed == 0, float("-inf"))


def penalise_rows(x: torch.Tensor, at: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor,
                  prompt: torch.Tensor, values: torch.Tensor) -> None:
    for i, (r, c) in enumerate(zip(at.tolist(), rows.tolist())):
        repetition, frequency, presence = (float(v) for v in values[i])
        count = counts[c].to(x.dtype)
        seen = counts[c] > 0
        row = x[r]
        row = torch.where(seen | prompt[c], torch.where(row > 0, row / repetition, row * repetition), row)
        x[r] = row - frequency * count - presence * seen.to(x.dtype)


def row_probs(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, host=None) -> torch.Tensor:
    check_rows("x", x)
    out = []
    for r in range(x.shape[0]):
        row, t = x[r].double(), float(temperature[r])
        peak = float(row.max())
        if not abs(peak / t) < float("inf"):
            out.append(torch.nn.functional.one_hot(row.argmax(), row.shape[0]).double())
            continue
        w = _kept(((row - peak) / t).exp(), int(top_k[r]), float(top_p[r]), float(min_p[r]))
        out.append(w / w.sum())
    return torch.stack(out).float()


def draw_rows(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cum = w.double().cumsum(-1)
    return torch.searchsorted(cum, u.double()[:, None] * cum[:, -1:], right=True)[:, 0].clamp_(max=w.shape[1] - 1)
