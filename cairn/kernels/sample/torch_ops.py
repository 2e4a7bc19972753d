"""Sampling as batched torch ops: what CUDA runs (no kernel of ours: a handful of launches over the
whole batch, no host sync but the rows' parameters, passed as `host`), and what a CPU runs where
the C++ kernels (sample/cpu_ops.py) do not take the call. Its oracle is sample/reference.py.

`sample_rows(x, temperature, top_k, top_p, min_p, u)`: one token per row of the changed logits
x [N, V] fp32 (bias, penalties and masks applied), with per-row [N] parameters (temperature > 0;
top_k 0 or >= V = off; top_p 1 = off; min_p 0 = off) and one uniform u in [0, 1) per row:
- w = exp((x - max) / temperature), the weights (never normalised); a row where max / temperature
  overflows takes its argmax (what such a temperature means);
- min-p keeps w >= min_p (the most likely token has w = 1);
- top-k keeps exactly k tokens; a row with top-k takes its top-p from those k sorted weights;
- top-p keeps the tokens whose strictly likelier tokens hold less than p of the mass (the
  smallest set reaching p; the most likely token always stays; every tie at the boundary stays),
  found without a sort by a radix select over the weights' float bits (`nucleus`);
- the draw is an inverse CDF with the row's uniform, in two levels (blocks of 1,024 tokens, then
  within the block), so no cumulative sum spans the vocabulary (`draw`). A token of weight 0 is
  never drawn.
`penalise_rows(x, at, rows, counts, prompt, values)`: vLLM's penalties, in place, on rows `at` of
x from token-count rows `rows` (counts [R, V] int32 of output tokens, prompt [R, V] bool) with
values [M, 3] = (repetition, frequency, presence): repetition divides the positive (multiplies
the negative) logits of tokens in the prompt or the output; frequency x count and presence (for
a token in the output) are subtracted.
`mask_rows(x, at, words)`: in place, row at[i] of x keeps the tokens allowed by the packed words
[M, ceil(V / 32)] int32 (bit j of word k: token 32 k + j; a grammar's mask) and the others become
-inf.
`row_probs(x, temperature, top_k, top_p, min_p)`: the distribution [N, V] fp32 (rows summing to
1) that `sample_rows` draws from (an overflowing temperature: one-hot at the argmax);
`draw_rows(w, u)`: `sample_rows`' inverse CDF over any non-negative weights w [N, V] (speculative
decoding's residual draws).
`argmax_rows(logits)`: greedy sampling's ids, [N] int64, the first index of each row's maximum, or
-1 for a row whose maximum is not finite (a NaN, a +inf, all -inf).
`host` (optional): the rows' top_k, top_p and min_p as Python lists, so that on CUDA the branches
are chosen without reading the device.
"""

from __future__ import annotations

import torch

from cairn.kernels.common.checks import check_rows

_BLOCK = 1024  # tokens per block of the two-level draw


def sample_rows(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, u: torch.Tensor,
                host: tuple[list[int], list[float], list[float]] | None = None) -> torch.Tensor:
    w, overflow, greedy = _weights(x, temperature, top_k, top_p, min_p, host)
    return torch.where(overflow, greedy, draw(w, u))


def row_probs(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor, host: tuple[list[int], list[float], list[float]] | None = None) -> torch.Tensor:
    w, overflow, greedy = _weights(x, temperature, top_k, top_p, min_p, host)
    p = w / w.sum(-1, keepdim=True)
    return torch.where(overflow[:, None], torch.nn.functional.one_hot(greedy, x.shape[1]).to(p.dtype), p)


def draw_rows(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return draw(w, u)


def _weights(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor, host: tuple[list[int], list[float], list[float]] | None = None):
    """`sample_rows`' weights [N, V] (not normalised) after its rules, each row's overflow (its
    temperature too small: the argmax) and argmax."""
    k_host, p_host, min_p_host = host if host is not None else (top_k.tolist(), top_p.tolist(), min_p.tolist())
    ns = x.shape[0]
    inv = (1.0 / temperature)[:, None]
    best, greedy = torch.max(x, dim=-1)
    peak = best[:, None]
    w = ((x - peak) * inv).exp_()  # the difference first: exactly 0 at the max, whatever the temperature
    overflow = ~torch.isfinite(peak[:, 0] * inv[:, 0])
    if any(v > 0 for v in min_p_host):
        w.masked_fill_(w < min_p[:, None], 0.0)
    with_k = [i for i, k in enumerate(k_host) if 0 < k < x.shape[1]]  # k >= V keeps every token
    if with_k:
        at = torch.tensor(with_k, device=x.device) if len(with_k) < ns else None
        sub = w if at is None else w.index_select(0, at)
        k = top_k if at is None else top_k.index_select(0, at)
        vals, idx = torch.topk(sub, max(k_host[i] for i in with_k), dim=-1)
        vals = vals * (torch.arange(vals.shape[1], device=x.device)[None, :] < k[:, None])
        p = top_p if at is None else top_p.index_select(0, at)
        before = vals.cumsum(-1) - vals  # top-p inside the k, already sorted
        vals = torch.where((before < p[:, None] * vals.sum(-1, keepdim=True)) | (p[:, None] >= 1), vals, 0.0)
        kept = torch.zeros_like(sub).scatter_(1, idx, vals)
        if at is None:
            w.copy_(kept)
        else:
            w.index_copy_(0, at, kept)
    with_p = [i for i, (k, p) in enumerate(zip(k_host, p_host)) if not 0 < k < x.shape[1] and p < 1.0]
    if with_p:
        at = torch.tensor(with_p, device=x.device) if len(with_p) < ns else None
        sub = w if at is None else w.index_select(0, at)
        keep = nucleus(sub, top_p if at is None else top_p.index_select(0, at))
        if at is None:
            w.mul_(keep)
        else:
            w.index_copy_(0, at, sub * keep)
    return w, overflow, greedy


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    check_rows("logits", logits)
    best, index = torch.max(logits, dim=-1)
    return torch.where(torch.isfinite(best), index, -1)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed allowed-token words [n, W] int32 (bit j of word i: token 32 i + j) as a bool
    mask [n, vocab]."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words[:, :, None] >> shifts) & 1  # an arithmetic shift: the & keeps the one bit
    return bits.view(words.shape[0], -1)[:, :vocab].bool()


def mask_rows(x: torch.Tensor, at: torch.Tensor, words: torch.Tensor) -> None:
    x.index_copy_(0, at, x.index_select(0, at).masked_fill_(~unpack_bitmask(words, x.shape[1]), float("-inf")))


def penalise_rows(x: torch.Tensor, at: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor,
                  prompt: torch.Tensor, values: torch.Tensor) -> None:
    c = counts.index_select(0, rows)
    seen = c > 0
    sub = x.index_select(0, at)
    repetition, frequency, presence = (values[:, i:i + 1] for i in range(3))
    sub = torch.where(seen | prompt.index_select(0, rows), torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    x.index_copy_(0, at, sub - frequency * c - presence * seen)


def nucleus(w: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep-mask [n, V] of top-p over non-negative weights w [n, V] fp32 (any scale), top_p [n]:
    a token stays when the tokens of strictly larger weight hold less than top_p of the row's
    mass. Radix select over the float bits (monotone for non-negative floats): the bucket of the
    high 15 bits where the mass from the top first reaches top_p, then the same inside it over
    the low 16 bits; that gives the boundary's exact bit pattern, and a token stays when its bits
    are at least that (so every tie of the boundary value stays)."""
    n, vocab = w.shape
    bits = w.view(torch.int32) & 0x7FFFFFFF  # a NaN's sign bit (an overflowed row, discarded) never indexes
    target = (top_p * w.sum(-1))[:, None]
    rows = torch.arange(n, device=w.device, dtype=torch.int32)[:, None]

    def boundary(keys: torch.Tensor, buckets: int, above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket (of `buckets` per row; a key of `buckets` is ignored) where the mass from
        the top, plus `above`, first reaches the target; and the mass of the buckets above it."""
        table = torch.zeros(n * (buckets + 1), dtype=w.dtype, device=w.device)
        table.index_add_(0, (keys + rows * (buckets + 1)).view(-1), w.reshape(-1))
        table = table.view(n, buckets + 1)[:, :buckets]
        total = table.sum(-1, keepdim=True) + above
        from_top = total - table.cumsum(-1) + table  # mass in buckets >= b, plus above
        b = ((from_top >= target).sum(-1, keepdim=True) - 1).clamp_(min=0)
        return b, from_top.gather(1, b) - table.gather(1, b)

    b_high, above = boundary(bits >> 16, 1 << 15, torch.zeros(n, 1, dtype=w.dtype, device=w.device))
    low = torch.where((bits >> 16) == b_high, bits & 0xFFFF, 1 << 16)
    b_low, _ = boundary(low, 1 << 16, above)
    return bits >= ((b_high << 16) | b_low).to(torch.int32)


def draw(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over weights w [n, V] with one uniform per row: the block of _BLOCK tokens (the
    last one may be shorter) whose cumulative mass first exceeds u x total, then the token inside
    it. A token of weight 0 is never drawn."""
    n, vocab = w.shape
    whole = vocab // _BLOCK
    sums = [w[:, :whole * _BLOCK].view(n, whole, _BLOCK).sum(-1)] if whole else []
    if vocab > whole * _BLOCK:
        sums.append(w[:, whole * _BLOCK:].sum(-1, keepdim=True))
    cum = torch.cat(sums, dim=1).cumsum(-1)  # [n, blocks]
    target = u[:, None] * cum[:, -1:]
    j = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)
    before = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), 0.0)
    at = j * _BLOCK + torch.arange(_BLOCK, device=w.device)[None, :]  # [n, _BLOCK]
    inner = torch.where(at < vocab, w.gather(1, at.clamp(max=vocab - 1)), 0.0).cumsum(-1)
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1:], torch.zeros_like(inner[:, -1:])))
    t = torch.searchsorted(inner, rest.clamp_(min=0), right=True).clamp_(max=_BLOCK - 1)
    return (j[:, 0] * _BLOCK + t[:, 0]).clamp_(max=vocab - 1)
