"""A sequence's last page, kept when the sequence ends inside it (design rules 2 and 4).

A reply that ends inside the page its prompt ended in leaves that page partly computed: K/V for
the prompt's tail and the tokens decoded after it, and a state checkpoint at the prompt's end
(`prompt_end`, a sub-page one) with nothing under it once the page is gone. Agents send such
replies all the time (a short tool call, a stop string, a low `max_tokens`), and the next request
of the conversation extends that prompt. So when a sequence ends (finished, aborted, failed or
preempted), `PartialPages.keep` names its last started page, if K/V was written into part of it,
as a partial page (`PagePool.register(..., partial=True)`): the tokens it was computed over, under
a key of its own (`cairn.cache_service.hashing.partial_page_hash`), found by `partial_match` like
any cached page's head. On a recurrent model it is kept only when a state it serves is there:
a sub-page checkpoint inside it, at or under its tokens, on either tier. Kept, it is an ordinary
cached page: the one LRU, evicted with its floor page or alone, demoted to the host tier and
copied back from there like any page.

Supersession, as for checkpoints (rule 7): a request that copied a partial page's head and then
stores a page of its own at that index (the whole page, once computed, or a partial page of its
own when it too ends inside it) sends the partial page to the cold end: its conversation moved
on, and the new page shares its head up to the resume point.

What is kept is known by index, never announced (the index scores whole pages); the sub-page
checkpoint above it is announced as its floor's state, as before.
"""

from __future__ import annotations

from cairn.cache_service.hashing import branch_root, partial_page_hash
from cairn.workers.cache.cache_budget import PAGE, CacheBudget
from cairn.workers.cache.host_tier import HostTier
from cairn.workers.cache.lookup import Lookup, Match, extend_hashes
from cairn.workers.cache.page_pool import PagePool
from cairn.workers.cache.stats import CacheStats
from cairn.workers.sequence import PENDING, Sequence


class PartialPages:
    def __init__(self, page_size: int, recurrent: bool, pages: PagePool, budget: CacheBudget, host: HostTier,
                 lookup: Lookup, stats: CacheStats):
        self.page_size, self.recurrent = page_size, recurrent
        self.pages, self.budget, self.host, self.lookup, self.stats = pages, budget, host, lookup, stats

    def copied(self, seq: Sequence, m: Match) -> None:
        """`seq`'s admission copies the head of page `m.copy_from` (or of host page
        `m.copy_from_host`) into its page `m.hit_pages`: remembered when that is a partial page."""
        c = seq.cache
        c.copied_partial = None
        if m.copy_from is not None:
            key = self.pages.hash_of(m.copy_from)
            if key is not None and self.pages.is_partial(key):
                c.copied_partial = (key, m.hit_pages)
        elif m.copy_from_host is not None:
            page = self.host.pages.get(m.copy_from_host)
            if page is not None and page.partial:
                c.copied_partial = (m.copy_from_host, m.hit_pages)

    def stored(self, seq: Sequence, index: int) -> None:
        """`seq` stored a page of its own at page `index`: the partial page it copied there goes
        to the cold end of its tier."""
        c = seq.cache
        if c.copied_partial is None or c.copied_partial[1] != index:
            return
        key, c.copied_partial = c.copied_partial[0], None
        if self.pages.page_of(key) is not None:
            self.budget.demote_page(key)
        elif key in self.host.pages:
            self.host.demote(PAGE, key)
        self.stats.partial_pages_superseded += 1

    def keep(self, seq: Sequence) -> None:
        """Names `seq`'s last page a partial page when the K/V it computed ends inside it (and,
        on a recurrent model, a sub-page checkpoint inside it has it under it). Called while
        `seq` still holds its pages; releasing them then caches the page."""
        c, ps = seq.cache, self.page_size
        end = min(seq.num_computed, len(seq.token_ids))
        depth, cut = divmod(end, ps)
        if not cut or depth >= len(c.page_ids) or depth < c.shared_pages or c.register_stopped or \
                c.registered_pages < depth:
            return
        floor = extend_hashes(seq, depth, ps)[depth - 1] if depth else None
        base = floor if depth else seq.hash_root
        if self.recurrent:  # worth keeping only under a state inside it
            ckpt, _ = self.lookup.sub_page_resume(seq, base, end)
            if ckpt is None or ckpt.position(ps) <= depth * ps:
                return
        tokens = tuple(seq.cache_tokens[depth * ps:end])
        if PENDING in tokens:  # a token not yet read (async scheduling): its K/V is not known to be there
            return
        key = partial_page_hash(branch_root(base, seq.hash_root), tokens)
        if self.pages.register(c.page_ids[depth], key, floor, tokens, seq.hash_root, partial=True):
            self.stats.partial_pages_kept += 1
            if key in self.host.pages:  # computed again: the device copy supersedes the host's
                self.host.free_blocks([self.host.pop_page(key)])
            self.stored(seq, depth)
