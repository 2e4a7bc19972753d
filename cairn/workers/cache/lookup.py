"""The prefix cache's lookup (design rule 4): where a prompt can resume, and what that costs.

`Lookup.match(seq)`: h = the longest run of `seq`'s pages resident on the device; d = the
deepest checkpoint at or under h pages (and under n - 1 tokens) the prompt may use; the resume
point follows from `cairn.cache_service.scoring.resume_at_token`. Tokens from there up to h pages are
recomputed only to rebuild the state; their K/V, already in the shared pages, is not written
again. With a host tier (`cairn.workers.cache.host_tier`), the run goes on over the chain's host pages
after its device ones, and a checkpoint may be on the host: each usable resume point is priced
by `cairn.workers.cache.tier_cost` (host copies it needs + prefill it leaves) and the cheapest is
taken, the cold start included. A partly matching page after the run (`PagePool.partial_match`)
or a sub-page checkpoint inside a page moves the resume point past the page floor.

Reads the cache's parts, changes nothing but `seq`'s hash chain (extended as far as its pages).
"""

from __future__ import annotations

from dataclasses import dataclass

from cairn.cache_service.events import DEVICE, HOST
from cairn.cache_service.hashing import next_page_hash
from cairn.cache_service.scoring import last_resumable_page, last_resumable_token, resume_at_token
from cairn.workers.cache.arena import ArenaLayout
from cairn.workers.cache.checkpoint_store import Checkpoint, CheckpointStore
from cairn.workers.cache.host_tier import HostTier
from cairn.workers.cache.page_pool import PagePool
from cairn.workers.cache.tier_cost import TierCost
from cairn.workers.sequence import Sequence


def extend_hashes(seq: Sequence, upto_pages: int, page_size: int) -> list[bytes]:
    """`seq`'s chain (`seq.cache.page_hashes`), extended to at least `upto_pages` hashes."""
    hashes, ps = seq.cache.page_hashes, page_size
    while len(hashes) < upto_pages:
        j = len(hashes)
        hashes.append(next_page_hash(hashes[-1] if hashes else seq.hash_root, seq.token_ids[j * ps:(j + 1) * ps]))
    return hashes


@dataclass
class Match:
    hit_pages: int  # resident page run used: the device run, then the pages promoted after it
    state_pages: int  # depth of the checkpoint resumed from (0: none)
    resume_token: int  # tokens skipped = cached_tokens
    checkpoint: Checkpoint | None
    page_ids: list[int] | None = None  # the device run's pages, once looked up (can_admit, admit)
    promote: tuple[bytes, ...] = ()  # host pages brought back, after the device run
    from_host: bool = False  # the checkpoint is on the host: copied from there into the state
    copy_from: int | None = None  # a cached page whose head (up to resume_token) the request's page
    # hit_pages copies: the resume point is past the page floor (copy-on-write)
    kv_tokens: int = 0  # tokens of the prompt whose K/V the device holds, a partial page's included

    @property
    def device_pages(self) -> int:
        return self.hit_pages - len(self.promote)

    @property
    def tier(self) -> str:
        """Where the resume point came from: the device alone, or the host too."""
        return HOST if self.promote or self.from_host else DEVICE


class Lookup:
    def __init__(self, layout: ArenaLayout, page_size: int, recurrent: bool, pages: PagePool,
                 checkpoints: CheckpointStore, host: HostTier, tier_cost: TierCost):
        self.layout, self.page_size, self.recurrent = layout, page_size, recurrent
        self.pages, self.checkpoints, self.host, self.tier_cost = pages, checkpoints, host, tier_cost

    def match(self, seq: Sequence) -> Match:
        n, ps = seq.num_tokens, self.page_size
        cap = last_resumable_token(n)  # the last prompt token is always computed
        hashes = extend_hashes(seq, n // ps, ps)
        h = self.device_run(hashes, n // ps)
        source, shared = self._partial_page(seq, hashes, h)  # a cached page sharing page h's head
        kv = h * ps + shared  # tokens whose K/V the device holds
        top, host = h, self.host  # the host pages of the chain follow its device run
        if host:
            while top < n // ps and hashes[top] in host.pages:
                top += 1
        if not self.recurrent:
            r = min(kv, cap) if shared else resume_at_token(h, h, n, ps, recurrent=False)
            m = Match(h, h, r, None, copy_from=source if r > h * ps else None, kv_tokens=kv)
            if top > h:
                deeper = Match(top, top, resume_at_token(top, top, n, ps, recurrent=False), None,
                               promote=tuple(hashes[h:top]))
                if self.resume_cost(deeper, n) < self.resume_cost(m, n):
                    return deeper
            return m
        best = Match(h, 0, 0, None, kv_tokens=kv)  # cold
        best_cost = self.resume_cost(best, n)
        for j in range(min(top, last_resumable_page(n, ps)), 0, -1):
            if j <= h:  # a sub-page checkpoint inside page j: deeper than the boundary's, on the device
                sub = self.sub_page_resume(seq, hashes[j - 1], min(cap, kv if j == h else (j + 1) * ps))
                if sub is not None:
                    m = Match(h, j, sub.position(ps), sub,
                              copy_from=source if sub.position(ps) > h * ps else None, kv_tokens=kv)
                    if self.resume_cost(m, n) < best_cost:
                        best = m
                    break
            ckpt, from_host = self.checkpoints.get(hashes[j - 1]), False
            if ckpt is None and host:
                ckpt = host.checkpoints.get(hashes[j - 1])
                from_host = ckpt is not None
            if ckpt is None or not ckpt.usable_by(seq.token_ids, ps):
                continue
            m = Match(max(h, j), j, resume_at_token(max(h, j), j, n, ps, recurrent=True), ckpt,
                      promote=tuple(hashes[h:j]), from_host=from_host, kv_tokens=kv)
            cost = self.resume_cost(m, n)
            if cost < best_cost:
                best, best_cost = m, cost
            if not m.promote and not from_host:
                break  # a device resume point copies nothing: shallower ones only cost more
        return best

    def _partial_page(self, seq: Sequence, hashes: list[bytes], h: int) -> tuple[int | None, int]:
        """(page, m): a cached page after page h - 1 whose first m tokens are the first m of
        `seq`'s page h, m as large as possible ((None, 0): none). Copied into the request's own
        page h, it gives K/V up to the divergence instead of the page floor."""
        ps, n = self.page_size, seq.num_tokens
        if h == 0 or h * ps >= n:
            return None, 0
        return self.pages.partial_match(hashes[h - 1], seq.token_ids[h * ps:min(n, (h + 1) * ps)], seq.hash_root)

    def sub_page_resume(self, seq: Sequence, floor: bytes, limit: int) -> Checkpoint | None:
        """The deepest sub-page checkpoint on page `floor` that `seq` repeats, at most at `limit`,
        taken under `seq`'s own hash root (after a public prefix, another tenant's is not its)."""
        best, ps = None, self.page_size
        for ckpt in self.checkpoints.at_floor(floor):
            pos = ckpt.position(ps)
            if pos <= limit and ckpt.root == seq.hash_root and (best is None or pos > best.position(ps)) \
                    and ckpt.usable_by(seq.token_ids, ps):
                best = ckpt
        return best

    def device_run(self, hashes: list[bytes], upto: int | None = None) -> int:
        """How many of the first `upto` (default: all) pages of the chain `hashes` are on the
        device. The device pages of a chain are a prefix of it (a page is registered after its
        parent and evicted with its descendants), so the run's end is found by bisection."""
        page_of = self.pages.page_of
        h, hi = 0, len(hashes) if upto is None else upto
        while h < hi:
            mid = (h + hi + 1) // 2
            if page_of(hashes[mid - 1]) is not None:
                h = mid
            else:
                hi = mid - 1
        return h

    def resume_cost(self, m: Match, num_tokens: int) -> float:
        """Seconds to resume at `m` (`cairn.workers.cache.tier_cost`): its host copies and its prefill."""
        copy = len(m.promote) * self.layout.block_bytes + (self.layout.slot_bytes if m.from_host else 0)
        return self.tier_cost.seconds(copy, num_tokens - m.resume_token)
