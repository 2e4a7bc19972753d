"""What a verify step keeps of a draft (speculative decoding): each speculating row drafted k
tokens; the target's forward over them gave k + 1 distributions; these functions say which of
the drafted tokens stand and which token follows them. Batched torch over rows, on any device,
no host sync.

Contract:
- `accept_greedy(draft, target)`: draft [R, k] ids, target [R, k + 1] the target's argmax at
  each position (given the draft before it). A row keeps the longest prefix of its draft equal to
  the target's choices, then the target's own token: at the first mismatch, or the bonus after k
  matches. So its tokens are exactly those one-at-a-time greedy decoding gives from the same
  argmaxes.
- `accept_sampled(draft, p, q, keys, index)`: rejection sampling (Leviathan et al. 2023, Chen et
  al. 2023). p [R, k + 1, V]: the target's probabilities at each position after every sampling
  rule (temperature, penalties, bias, min_p/top_p/top_k, a grammar's mask); q [R, k, V]: the
  draft's probabilities the drafted tokens were drawn from. Drafted token d_i is kept with
  probability min(1, p_i(d_i) / q_i(d_i)); the first one not kept is replaced by a draw from
  the residual max(0, p_i - q_i), normalised; if all k are kept, a bonus token is drawn from
  p_k. Each output token is then distributed exactly as the target's distribution at its
  position, given the tokens before it, whatever the draft (a draft's quality changes only how
  many tokens a step keeps).
- Randomness is a function of (row key, output index) only (`cairn.workers.sampler.uniforms`):
  the output token with index j (the row's first drafted token is output index `index`) is kept
  or not by a uniform of (keep key, j), and drawn, where it is drawn, by the inverse CDF of its
  distribution at a uniform of (key, j): the same uniform the sampler's own draw takes at that
  index. A seeded request thus draws reproducibly however its steps are cut.
Both return (tokens [R, k + 1] int64, -1 past each row's end; counts [R]: tokens kept, drafted
ones plus the one after them, 1 to k + 1).
"""

from __future__ import annotations

import torch

from cairn.workers.sampler import uniforms

KEEP_SALT = 0x5EC0DEC0FFEE  # the keep test's uniforms: another stream than the draws' of the same key


def accept_greedy(draft: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = draft.shape[1]
    kept = _leading(draft == target[:, :k])
    return _cut(target, kept + 1), kept + 1


def accept_sampled(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                   index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = draft.shape
    steps = index[:, None] + torch.arange(k + 1, device=draft.device)[None, :]  # output index of each position
    if k:
        p_draft = p[:, :k].gather(2, draft[:, :, None])[:, :, 0]
        q_draft = q.gather(2, draft[:, :, None])[:, :, 0]
        u_keep = uniforms((keys ^ KEEP_SALT)[:, None].expand(rows, k), steps[:, :k])
        keep = u_keep * q_draft < p_draft  # u < p / q without dividing (q = 0: kept iff p > 0)
        kept = _leading(keep)
    else:
        kept = torch.zeros(rows, dtype=torch.long, device=draft.device)
    at = kept[:, None, None]
    target = p.gather(1, at.expand(rows, 1, p.shape[2]))[:, 0]  # [R, V]: the distribution where the draw is
    if k:
        stopped = (kept < k)[:, None]
        draft_there = q.gather(1, at.clamp(max=k - 1).expand(rows, 1, q.shape[2]))[:, 0]
        residual = (target - draft_there).clamp_(min=0)
        # p_i == q_i leaves no residual, and then no draft is ever rejected there: the draw is unused
        target = torch.where(stopped & (residual.sum(-1, keepdim=True) > 0), residual, target)
    u_draw = uniforms(keys, index + kept)
    drawn = _inverse_cdf(target, u_draw)
    tokens = torch.cat((draft, drawn[:, None]), dim=1) if k else drawn[:, None]
    if k:
        tokens = tokens.scatter(1, kept[:, None], drawn[:, None])  # the drawn token right after the kept ones
    return _cut(tokens, kept + 1), kept + 1


def _leading(matches: torch.Tensor) -> torch.Tensor:
    """[R]: how many of each row's first entries are all true."""
    return matches.long().cumprod(dim=1).sum(dim=1)


def _cut(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """tokens with -1 past each row's first `counts` entries."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    return torch.where(positions < counts[:, None], tokens, -1)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of non-negative `weights` [R, V] (not normalised), at uniforms u [R]: the
    first token whose cumulative weight exceeds u times the total. A token of weight 0 is never
    drawn."""
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u.double()[:, None] * total, right=True)[:, 0]
    return drawn.clamp_(max=weights.shape[1] - 1)
