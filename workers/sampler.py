"""Turns the logits of one step into one token per sampling sequence.

Greedy rows (temperature 0 or top_k 1) take the argmax, batched. Other rows apply temperature,
then top-k, then top-p (the smallest set of most likely tokens whose probability reaches p; the
most likely token always stays), and draw with a generator seeded from (seed, output index), so
a seeded request gives the same tokens alone, batched, chunked or preempted. Requests without a
seed draw from the engine's own generator. A temperature so small that the scaled logits
overflow is greedy (what such a temperature means).

Logprobs, when asked, are log_softmax of the raw logits (before temperature and filters), for
the chosen token and the `logprobs` most likely alternatives.

Faults stay in their row: a row whose logits are not finite, or whose draw fails, yields a
`SequenceFault` in its place; every other row is sampled as if it were alone.
"""

from __future__ import annotations

import torch

import kernels
from workers.errors import SequenceFault
from workers.sequence import Sequence, TokenLogprob

_SEED_STRIDE = 1_000_003  # mixes (seed, output index) into one generator seed


class Sampler:
    def __init__(self, seed: int = 0):
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None] | SequenceFault]:
        """logits: [N, vocab] fp32, one row per sequence in `seqs`; one result per row."""
        if all(s.params.temperature == 0 and s.params.logprobs is None for s in seqs):  # argmax on the device
            # a row with a NaN or an infinity has its maximum there: it reads back as -1, and the
            # step's one read of the device is these ids
            ids = kernels.argmax_rows(logits).tolist()
            if min(ids, default=0) >= 0:
                return [(t, None) for t in ids]
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        logits = logits.float().cpu()
        tokens = torch.argmax(logits, dim=-1).tolist()
        out: list[tuple[int, TokenLogprob | None] | SequenceFault] = []
        for row, seq in enumerate(seqs):
            if not finite[row]:
                out.append(SequenceFault("the model's logits for this request were not finite"))
                continue
            try:
                token = tokens[row] if seq.params.greedy else self._draw(logits[row], seq)
                k = seq.params.logprobs
                out.append((token, None if k is None else self._logprob(logits[row], token, k)))
            except Exception as e:  # this row's sampling only: the others go on
                out.append(SequenceFault(f"sampling failed: {type(e).__name__}"))
        return out

    @staticmethod
    def _logprob(row: torch.Tensor, token: int, k: int) -> TokenLogprob:
        lp = torch.log_softmax(row, dim=-1)
        top_vals, top_ids = torch.topk(lp, k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        return TokenLogprob(token, float(lp[token]), list(zip(top_ids.tolist(), top_vals.tolist())))

    def _draw(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        scaled = row / p.temperature
        if not bool(torch.isfinite(scaled).all()):  # so cold it overflows: that temperature means greedy
            return int(torch.argmax(row))
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=0) - sorted_probs  # mass of strictly likelier tokens
            drop = before >= p.top_p
            drop[0] = False
            probs = probs.scatter(0, order[drop], 0.0)
        if p.seed is not None:
            gen = torch.Generator().manual_seed((p.seed * _SEED_STRIDE + len(seq.output_token_ids)) % 2**63)
        else:
            gen = self._generator
        return int(torch.multinomial(probs, 1, generator=gen))
