"""Which drafted tokens stand (the acceptance rule, once): a verify segment's rows were each sampled
as the sequence's output token of its index would be; `kept_tokens` keeps the drafted tokens
equal to the draws before them, then the first draw that differs (or the bonus after all of
them), cut before a faulted row and after a token that stops the sequence. So a sequence's
tokens are exactly those one-at-a-time decoding gives from the same draws (held to a batched torch
form of the rule in tests/support/acceptance_oracle.py). Host lists in, host lists out.
"""

from __future__ import annotations

from cairn.workers.engine_errors import SequenceFault
from cairn.workers.plan import Segment


def kept_tokens(segments: list[Segment], results: list[list], stop_reason) -> list[tuple[int, int]]:
    """For each verify segment, (its tokens that stand, its drafted tokens accepted), from its rows'
    sampled `results` (one per position, a (token, logprob) or a `SequenceFault`): the drafts equal
    to the draws before them (one-at-a-time decoding's rule, applied on the host to what the
    sampler read back), cut before the first faulted row and after the first token that stops the
    sequence (`stop_reason(seq, token, length)`, the scheduler's). 0 kept: its first row faulted."""
    out = []
    for seg, rows in zip(segments, results):
        draft, accepted = seg.seq.draft, 0
        while accepted < seg.drafts and rows[accepted].__class__ is not SequenceFault and \
                rows[accepted][0] == draft[accepted]:
            accepted += 1
        kept, length = 0, len(seg.seq.token_ids)
        while kept <= accepted and rows[kept].__class__ is not SequenceFault:
            kept += 1
            if stop_reason(seg.seq, rows[kept - 1][0], length + kept) is not None:
                break
        out.append((kept, accepted))
    return out
