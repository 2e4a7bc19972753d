"""Turns the logits of one step into one token per sampling sequence.

Greedy rows (temperature 0 or top_k 1) take the argmax, batched. Other rows apply temperature,
then top-k, then top-p (the smallest set of most likely tokens whose probability reaches p; the
most likely token always stays), and draw with a generator seeded from (seed, output index), so
a seeded request gives the same tokens alone, batched, chunked or preempted. Requests without a
seed draw from the engine's own generator.

Logprobs, when asked, are log_softmax of the raw logits (before temperature and filters), for
the chosen token and the `logprobs` most likely alternatives.
"""

from __future__ import annotations

import torch

from workers.sequence import Sequence, TokenLogprob

_SEED_STRIDE = 1_000_003  # mixes (seed, output index) into one generator seed


class Sampler:
    def __init__(self, seed: int = 0):
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, TokenLogprob | None]]:
        """logits: [N, vocab] fp32, one row per sequence in `seqs`."""
        if all(s.params.temperature == 0 and s.params.logprobs is None for s in seqs):  # argmax on the device
            return [(t, None) for t in torch.argmax(logits, dim=-1).tolist()]
        logits = logits.float().cpu()
        tokens = torch.argmax(logits, dim=-1)
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                tokens[row] = self._draw(logits[row], seq)
        need_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        logprobs: dict[int, TokenLogprob] = {}
        if need_logprobs:
            lp = torch.log_softmax(logits[need_logprobs], dim=-1)
            for j, row in enumerate(need_logprobs):
                k = seqs[row].params.logprobs
                chosen = int(tokens[row])
                top_vals, top_ids = torch.topk(lp[j], k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
                logprobs[row] = TokenLogprob(chosen, float(lp[j, chosen]),
                                             list(zip(top_ids.tolist(), top_vals.tolist())))
        return [(int(tokens[i]), logprobs.get(i)) for i in range(len(seqs))]

    def _draw(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        scaled = row / p.temperature
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
