"""The prefix cache's lookup (design rule 4): where a prompt can resume, and what that costs.

`Lookup.match(seq)`: h = the longest run of `seq`'s pages resident on the device; with a host
tier (`cairn.workers.cache.host_tier`) the run goes on over the chain's host pages to `top`. Every
usable resume point across both tiers is a candidate:
- K/V: whole pages up to the resume point's page (the device's, then host pages promoted), and
  for a resume point inside a page, that page's head: the page itself when the prompt repeats
  it whole (on the device, or promoted), else the head of a cached page that shares it (a
  partial match after the run, `PagePool.partial_match` on the device or
  `HostTier.partial_match` on the host), copied into the request's own page (copy-on-write);
- state (recurrent models): a whole-page checkpoint at a page boundary, or a sub-page one
  inside a page (`CheckpointStore.at_floor`, `HostTier.at_floor`), on either tier, under n - 1
  tokens; without recurrent layers the K/V alone is the resume point.
Each candidate is priced by `cairn.workers.cache.tier_cost` (host copies it needs + prefill it
leaves) and the cheapest is taken, the cold start included: with copies priced at nothing
(rates not yet measured), that is the deepest. Tokens from the resume point up to the hit pages
are recomputed only to rebuild the state; their K/V, already in the shared pages, is not
written again.

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
        hashes.append(next_page_hash(hashes[-1] if hashes else seq.hash_root, seq.cache_tokens[j * ps:(j + 1) * ps]))
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
    kv_tokens: int = 0  # tokens of the prompt whose K/V a tier holds, a partial page's included
    copy_from_host: bytes | None = None  # as copy_from, a host page (by hash): its head is copied up

    @property
    def device_pages(self) -> int:
        return self.hit_pages - len(self.promote)

    @property
    def tier(self) -> str:
        """Where the resume point came from: the device alone, or the host too."""
        return HOST if self.promote or self.from_host or self.copy_from_host is not None else DEVICE


@dataclass(frozen=True)
class _Partial:
    """The head of page `top` shared with a cached page after the run: `shared` tokens of it."""
    shared: int = 0
    device: int | None = None  # the device page to copy it from
    host: bytes | None = None  # or the host page


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
        top, host = h, self.host  # the host pages of the chain follow its device run
        if host:
            while top < n // ps and hashes[top] in host.pages:
                top += 1
        partial = self._partial_page(seq, hashes, h, top)
        kv = top * ps + partial.shared  # tokens whose K/V a tier holds
        if not self.recurrent:
            return self._attention_only(n, h, top, partial, hashes)
        best = Match(h, 0, 0, None, kv_tokens=kv)  # cold
        best_cost = self.resume_cost(best, n)
        for j in range(min(top, last_resumable_page(n, ps)), -1, -1):
            candidates = []
            # a sub-page checkpoint inside page j: deeper than the boundary's (inside the first
            # page, its floor is the chain's hash root)
            floor = hashes[j - 1] if j else seq.hash_root
            sub, sub_on_host = self.sub_page_resume(seq, floor, min(cap, kv if j == top else (j + 1) * ps))
            if sub is not None:
                candidates.append(self._at(h, j, sub.position(ps), sub, sub_on_host, hashes, partial, top, kv))
            ckpt, from_host = self.checkpoints.get(floor) if j else None, False
            if ckpt is None and host and j:
                ckpt = host.checkpoints.get(floor)
                from_host = ckpt is not None
            if ckpt is not None and ckpt.usable_by(seq.cache_tokens, ps):
                candidates.append(self._at(h, j, resume_at_token(max(h, j), j, n, ps, recurrent=True), ckpt,
                                           from_host, hashes, partial, top, kv))
            for m in candidates:
                cost = self.resume_cost(m, n)
                if cost < best_cost:
                    best, best_cost = m, cost
            if any(m.tier == DEVICE for m in candidates):
                break  # a device resume point copies nothing: shallower ones only cost more
        return best

    def _at(self, h: int, j: int, resume: int, ckpt: Checkpoint, from_host: bool, hashes: list[bytes],
            partial: _Partial, top: int, kv: int) -> Match:
        """Resuming at `resume` from `ckpt` (after page j, or inside page j): the pages under it
        from the device, then the host; a resume inside page j needs page j's head too."""
        ps = self.page_size
        if resume <= max(h, j) * ps:  # its K/V is in whole pages: the device run, or promoted up to j
            return Match(max(h, j), j, resume, ckpt, promote=tuple(hashes[h:j]), from_host=from_host,
                         kv_tokens=kv)
        if j < top:  # page j is resident whole: the device's (j < h), or promoted with the rest
            return Match(max(h, j + 1), j, resume, ckpt, promote=tuple(hashes[h:j + 1]), from_host=from_host,
                         kv_tokens=kv)
        return Match(top, j, resume, ckpt, promote=tuple(hashes[h:top]), from_host=from_host,
                     copy_from=partial.device, copy_from_host=partial.host, kv_tokens=kv)

    def _attention_only(self, n: int, h: int, top: int, partial: _Partial, hashes: list[bytes]) -> Match:
        """Without recurrent layers the K/V hit is the resume point: the device run, or the run
        over the host pages after it, each with the head of the page after it when a cached
        page shares it; the cheaper."""
        ps, cap = self.page_size, last_resumable_token(n)
        kv = top * ps + partial.shared
        m = Match(h, h, resume_at_token(h, h, n, ps, recurrent=False), None, kv_tokens=kv)
        if top == h and partial.shared and min(kv, cap) > h * ps:
            m = Match(h, h, min(kv, cap), None, copy_from=partial.device, copy_from_host=partial.host, kv_tokens=kv)
        if top > h:
            r = min(kv, cap) if partial.shared and min(kv, cap) > top * ps else \
                resume_at_token(top, top, n, ps, recurrent=False)
            deeper = Match(top, top, r, None, promote=tuple(hashes[h:top]), kv_tokens=kv,
                           copy_from_host=partial.host if r > top * ps else None)
            if self.resume_cost(deeper, n) < self.resume_cost(m, n):
                return deeper
        return m

    def _partial_page(self, seq: Sequence, hashes: list[bytes], h: int, top: int) -> _Partial:
        """A cached page after page top - 1 (top 0: a first page of `seq`'s hash root) whose first
        m tokens are the first m of `seq`'s page top, m as large as possible (shared 0: none): on
        the device (only when the run is all the device's, top == h: a host page's children are
        on the host) or on the host, the device's when both share as much. Copied into the
        request's own page top, it gives K/V up to the divergence instead of the page floor."""
        ps, n = self.page_size, seq.num_tokens
        if top * ps >= n:
            return _Partial()
        tokens, parent = seq.cache_tokens[top * ps:min(n, (top + 1) * ps)], hashes[top - 1] if top else None
        device, shared = self.pages.partial_match(parent, tokens, seq.hash_root) if top == h else (None, 0)
        on_host, host_shared = self.host.partial_match(parent, tokens, seq.hash_root) if self.host else (None, 0)
        if host_shared > shared:
            return _Partial(host_shared, host=on_host)
        return _Partial(shared, device=device)

    def sub_page_resume(self, seq: Sequence, floor: bytes, limit: int) -> tuple[Checkpoint | None, bool]:
        """(the deepest sub-page checkpoint on page `floor` that `seq` repeats, at most at
        `limit`, whether it is on the host), over both tiers, the device's when both are as
        deep; (None, False): none. Taken under `seq`'s own hash root (after a public prefix,
        another tenant's is not its)."""
        best, on_host, ps = None, False, self.page_size
        candidates = [(c, False) for c in self.checkpoints.at_floor(floor)]
        if self.host:
            candidates += [(c, True) for c in self.host.at_floor(floor)]
        for ckpt, host in candidates:
            pos = ckpt.position(ps)
            if pos <= limit and ckpt.root == seq.hash_root and (best is None or pos > best.position(ps)) \
                    and ckpt.usable_by(seq.cache_tokens, ps):
                best, on_host = ckpt, host
        return best, on_host

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
        copy = (len(m.promote) + (m.copy_from_host is not None)) * self.layout.block_bytes + \
            (self.layout.slot_bytes if m.from_host else 0)
        return self.tier_cost.seconds(copy, num_tokens - m.resume_token)
