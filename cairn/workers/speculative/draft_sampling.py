"""Drafts drawn apart, and the rejection test that keeps them (speculative decoding, for sampled
rows without a seed; `Sampler._sample_rows` calls both after its own draws):

- `draw_apart`: the drafter's rows of unseeded sampled sequences draw from q, the head's
  distribution after the rows' rules (`kernels.row_probs`), with uniforms of a stream of their
  own (the key xor `DRAFT_SALT`, at the output index), and each sequence keeps q
  (`Sequence.draft_q`) for its verify row;
- `keep_or_resample`: a verify row whose draft d was drawn so keeps d with probability
  min(1, p(d) / q(d)) (p: the target's distribution after the rules; the test's uniform from
  the key xor `KEEP_SALT`), else draws from the residual max(0, p - q), which never draws d:
  each token is distributed as p, and a draft is kept at sum(min(p, q)), more often than a shared
  uniform's inverse CDFs agree.

Seeded and greedy rows need neither: their drafts are drawn with the very uniform their verify
row draws with (cairn.workers.speculative, item 1). Tensors on the rows' device; no host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cairn import kernels
from cairn.workers.sequence import Sequence
from cairn.workers.uniforms import uniforms

# the streams of an unseeded row's draft draws and keep tests: other uniforms than its token
# draws' of the same key
DRAFT_SALT, KEEP_SALT = 0x0D2AF7ED5A17, 0x5EC0DEC0FFEE


@dataclass
class SampledRows:
    """The sampled rows of a step, as the sampler uploaded them: `at` (host) and `rows` (device)
    their positions among the step's rows, their temperature, top-k, top-p and min-p on the
    device and on the host (`host`: top-k, top-p and min-p lists by position in the step), their
    keys and output indices."""
    at: np.ndarray
    rows: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    key: torch.Tensor
    index: torch.Tensor
    host: tuple[list[int], list[float], list[float]]

    def distribution(self, x: torch.Tensor, at: list[int]):
        """Rows `at` (sampled ones) of the changed logits `x`: the distribution each draws from,
        and what gives its uniforms at (key ^ salt, output index)."""
        sub = torch.from_numpy(np.searchsorted(self.at, at)).to(x.device)
        host = tuple([values[a] for a in at] for values in self.host)
        dist = kernels.row_probs(x.index_select(0, self.rows.index_select(0, sub)), self.temperature.index_select(0, sub),
                                 self.top_k.index_select(0, sub), self.top_p.index_select(0, sub),
                                 self.min_p.index_select(0, sub), host)
        return dist, lambda salt: uniforms(self.key.index_select(0, sub) ^ salt, self.index.index_select(0, sub))


def draw_apart(ids: torch.Tensor, x: torch.Tensor, sampled: SampledRows,
               apart: list[tuple[int, Sequence, int]]) -> torch.Tensor:
    """`ids` with the drafter's rows `apart` ((position, sequence, draft index)) drawn from q with
    uniforms of their own; each sequence keeps its rows' q from that draft on."""
    at = [a for a, _, _ in apart]
    q, u = sampled.distribution(x, at)
    ids = ids.index_copy(0, torch.tensor(at, device=x.device), kernels.draw_rows(q, u(DRAFT_SALT)))
    for (_, seq, j), row in zip(apart, q):
        seq.draft_q[j:] = [row]  # (the draft before it was drawn from draft_q[j - 1])
    return ids


def keep_or_resample(ids: torch.Tensor, x: torch.Tensor, sampled: SampledRows,
                     verified: list[tuple[int, int, torch.Tensor]]) -> torch.Tensor:
    """`ids` with the verify rows `verified` ((position, its draft, the q it was drawn from))
    taking their draft with probability min(1, p / q), else a draw from the residual."""
    at = [a for a, _, _ in verified]
    p, u = sampled.distribution(x, at)
    q = torch.stack([q for _, _, q in verified])
    d = torch.tensor([d for _, d, _ in verified], device=x.device)[:, None]
    keep = u(KEEP_SALT) * q.gather(1, d)[:, 0] < p.gather(1, d)[:, 0]
    residual = kernels.draw_rows((p - q).clamp_(min=0), u(0))
    return ids.index_copy(0, torch.tensor(at, device=x.device), torch.where(keep, d[:, 0], residual))
