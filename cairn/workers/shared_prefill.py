"""Two prompts that share pages nobody has computed yet are computed once: a waiting prompt whose
next pages a running sequence is computing right now waits a step and resumes from them, and the
running one keeps a checkpoint where the two prompts part (a `branch` checkpoint), so the waiting
one resumes there instead of recomputing the shared part beside it. The scheduler asks before
each admission (`defer_for_twin`), over the whole prompt pages the running sequences compute from
this step on (`inflight_pages`, extended as it admits: `add_inflight`). Plans, not tensors.
"""

from __future__ import annotations

from cairn.workers.cache.checkpoint_policy import BRANCH, EVERY, CheckpointPolicy
from cairn.workers.cache.prefix_cache import PrefixCache
from cairn.workers.sequence import Sequence


def inflight_pages(cache: PrefixCache, running: list[Sequence]) -> dict[bytes, Sequence]:
    """Whole prompt pages the running sequences compute from this step on, by hash."""
    inflight: dict[bytes, Sequence] = {}
    for seq in running:
        add_inflight(cache, inflight, seq)
    return inflight


def add_inflight(cache: PrefixCache, inflight: dict[bytes, Sequence], seq: Sequence) -> None:
    """`seq`'s whole prompt pages not registered yet join `inflight` (the first computing one wins)."""
    whole = seq.num_tokens // cache.page_size
    if seq.cache.registered_pages < whole:
        hashes = cache.extend_hashes(seq, whole)
        for j in range(seq.cache.registered_pages, whole):
            inflight.setdefault(hashes[j], seq)


def defer_for_twin(cache: PrefixCache, policy: CheckpointPolicy, seq: Sequence, hit_pages: int,
                   inflight: dict[bytes, Sequence]) -> bool:
    """True if a running sequence is computing `seq`'s next pages right now: `seq` waits a
    step and resumes from them, and the running one checkpoints where the two part."""
    hashes, whole = seq.cache.page_hashes, seq.num_tokens // cache.page_size
    if hit_pages >= whole or hashes[hit_pages] not in inflight:
        return False
    if cache.recurrent and not ({BRANCH, EVERY} & policy.kinds):
        return False  # no state would be kept where they part: waiting would gain nothing
    owner, k = inflight[hashes[hit_pages]], hit_pages
    while k < whole and inflight.get(hashes[k]) is owner:
        k += 1
    if cache.recurrent:
        cache.want_checkpoint(owner, k * cache.page_size, BRANCH)
    return True
