"""The tests' oracle for what a verify step keeps of a draft (speculative decoding): each
speculating row drafted k tokens; the target's forward over them gave k + 1 choices;
`accept_greedy` says which of the drafted tokens stand and which token follows them. Batched
torch over rows, on any device: a second, independent form of the rule the engine applies on
the host (cairn.workers.speculative.acceptance.kept_tokens), held against it in
tests/workers/test_acceptance.py.

Contract: `accept_greedy(draft, target)`: draft [R, k] ids, target [R, k + 1] the target's token at
each position (given the draft before it). A row keeps the longest prefix of its draft equal to
the target's choices, then the target's own token: at the first mismatch, or the bonus after k
matches. So its tokens are exactly those one-at-a-time decoding gives from the same choices.
Returns (tokens [R, k + 1] int64, -1 past each row's end; counts [R]: tokens kept, drafted ones
plus the one after them, 1 to k + 1).
"""

from __future__ import annotations

import torch


def accept_greedy(draft: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k = draft.shape[1]
    kept = _leading(draft == target[:, :k])
    return _cut(target, kept + 1), kept + 1


def _leading(matches: torch.Tensor) -> torch.Tensor:
    """[R]: how many of each row's first entries are all true."""
    return matches.long().cumprod(dim=1).sum(dim=1)


def _cut(tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """tokens with -1 past each row's first `counts` entries."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    return torch.where(positions < counts[:, None], tokens, -1)
