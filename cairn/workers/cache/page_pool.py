"""Attention KV pages: who holds them (reference counts) and what they are named (chain hashes).

Plain Python, no tensors: the runner owns the KV tensors, the arena (`cairn.workers.cache.arena`) decides
which block a new page takes; this pool keeps the rest. A page is held by reference count. A
whole page can be registered under its chain hash (cairn.cache_service.hashing) with its parent's
hash; when its last holder releases it, a registered page stays cached for reuse, an
unregistered one is free again (its block goes back to the arena). A page registered with its
tokens can also serve part of itself: `partial_match` finds, among a page's registered children
(or a hash root's first pages) computed under the same hash root (a tenant's, a salt's: never
another's), the one sharing the most leading tokens with a prompt's next page (copy-on-write
reuse). A partial page (`register(..., partial=True)`) is a sequence's last page kept when it
ended inside it (`PrefixCache.release`): it holds K/V for its tokens only, under a key of its own
(`cairn.cache_service.hashing.partial_page_hash`) that no whole page's hash equals, and it serves
only partial matches; the index never hears of it (`registered` leaves it out), as of a page
nobody can name by a prompt's chain. The prefix cache decides
eviction order; `evict` unregisters a cached page and, with it, every cached descendant on its
chain (they are unreachable from the root without it).

Invariant the prefix cache relies on: a held page's ancestors are held too (a sequence holds
its whole chain), so a cached page has only cached descendants. `check()` verifies the counts.
"""

from __future__ import annotations

from typing import NamedTuple


class EvictedPage(NamedTuple):
    page: int  # the block it was on (free now)
    page_hash: bytes
    parent: bytes | None
    tokens: tuple[int, ...] | None  # what it was computed over, when known
    root: bytes  # the hash root it was computed under
    partial: bool = False  # a sequence's last page, kept for partial matches (its tokens: its length)


class PagePool:
    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._parent: dict[bytes, bytes | None] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self._tokens: dict[bytes, tuple[bytes, tuple[int, ...]]] = {}  # (hash root, tokens): partial matches
        self._firsts: dict[bytes, set[bytes]] = {}  # hash root -> its first pages with tokens (no parent)
        self._partial: set[bytes] = set()  # the partial pages' keys
        self._num_cached = 0

    # ---- counts ----------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @property
    def num_resident(self) -> int:
        """Held and cached pages: those taking an arena block."""
        return len(self._refs) + self._num_cached

    # ---- holding ---------------------------------------------------------------------------
    def take(self, page: int) -> None:
        """A page on a free block, now held once."""
        self._refs[page] = 1

    def acquire(self, page: int) -> bool:
        """One more holder of a held or cached page; True if it was cached (now held)."""
        refs = self._refs.get(page, 0)
        self._refs[page] = refs + 1
        if refs == 0:
            self._num_cached -= 1
            return True
        return False

    def acquire_all(self, pages: list[int]) -> list[int]:
        """`acquire` for each of `pages` (a sequence's hit run), in one pass; returns those that
        were cached."""
        refs, was_cached = self._refs, []
        for page in pages:
            n = refs.get(page, 0)
            refs[page] = n + 1
            if not n:
                was_cached.append(page)
        self._num_cached -= len(was_cached)
        return was_cached

    def cached_hashes(self) -> list[bytes]:
        """Hashes of the cached pages (registered, unreferenced)."""
        return [h for p, h in self._hash_of.items() if p not in self._refs]

    def cached_among(self, pages: list[int]) -> list[int]:
        """Those of `pages` nobody holds (they are cached: registered, unreferenced)."""
        return [p for p in pages if p not in self._refs]

    def pages_of(self, page_hashes: list[bytes]) -> list[int]:
        """The page of each hash; every one must be registered."""
        return list(map(self._page_of.__getitem__, page_hashes))

    def release(self, page: int) -> str:
        """Drops one holder; says what the page is now: "held", "cached" or "free"."""
        refs = self._refs[page] - 1
        if refs:
            self._refs[page] = refs
            return "held"
        del self._refs[page]
        if page in self._hash_of:
            self._num_cached += 1
            return "cached"
        return "free"

    def is_held(self, page: int) -> bool:
        return page in self._refs

    def is_held_hash(self, page_hash: bytes) -> bool:
        """Whether the page named `page_hash` is resident and held by a sequence."""
        page = self.page_of(page_hash)
        return page is not None and self.is_held(page)

    def held_pages(self) -> set[int]:
        return set(self._refs)

    def resident_pages(self) -> set[int]:
        return set(self._refs) | set(self._hash_of)

    # ---- hashes ----------------------------------------------------------------------------
    def page_of(self, page_hash: bytes) -> int | None:
        return self._page_of.get(page_hash)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    def register(self, page: int, page_hash: bytes, parent: bytes | None,
                 tokens: tuple[int, ...] | None = None, root: bytes = b"", partial: bool = False) -> bool:
        """Names a held, full page by its chain hash (with its `tokens` and the hash `root` of
        the sequence that computed it, when known, for `partial_match`); with `partial`, a page
        holding K/V for its `tokens` alone, fewer than a page, named by its partial key. False if
        that hash already names another page (a duplicate computed concurrently): this page
        stays private."""
        if page_hash in self._page_of or page in self._hash_of or (partial and tokens is None):
            return False
        if partial:
            self._partial.add(page_hash)
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        self._parent[page_hash] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(page_hash)
        if tokens is not None:
            self._tokens[page_hash] = (root, tokens)
            if parent is None:
                self._firsts.setdefault(root, set()).add(page_hash)
        return True

    def partial_match(self, parent: bytes | None, tokens: list[int], root: bytes = b"") -> tuple[int | None, int]:
        """(page, m): of `parent`'s registered children (None: `root`'s first pages) whose tokens
        are known and that were computed under `root`, the one whose first m tokens equal the
        first m of `tokens`, m as large as possible (None, 0: none shares even one). A page that
        matched whole would have been a hit, so m < its length. (A child of a public prefix's
        last page computed under another root is another tenant's first page of its own: it
        never matches.)"""
        best, best_m = None, 0
        for child in self._children.get(parent, ()) if parent is not None else self._firsts.get(root, ()):
            entry = self._tokens.get(child)
            if entry is None or entry[0] != root or not tokens or entry[1][0] != tokens[0]:
                continue
            known = entry[1]
            m, n = 1, min(len(known), len(tokens))
            while m < n and known[m] == tokens[m]:
                m += 1
            if m > best_m:
                best, best_m = self._page_of[child], m
        return best, best_m

    def is_partial(self, page_hash: bytes) -> bool:
        """Whether `page_hash` names a partial page (a sequence's last page, kept)."""
        return page_hash in self._partial

    def partial_children(self, parent: bytes | None, root: bytes) -> list[bytes]:
        """The partial pages after `parent` (None: `root`'s first pages)."""
        under = self._children.get(parent, ()) if parent is not None else self._firsts.get(root, ())
        return [h for h in under if h in self._partial]

    def tokens_of(self, page_hash: bytes) -> tuple[int, ...] | None:
        """What the page was computed over, when known."""
        entry = self._tokens.get(page_hash)
        return entry[1] if entry is not None else None

    def move(self, src: int, dst: int) -> None:
        """A cached page now lives on block `dst` (its K/V copied there): same hash, new id."""
        if src in self._refs or src not in self._hash_of or dst in self._hash_of or dst in self._refs:
            raise RuntimeError(f"move({src}, {dst}): only a cached page moves, to a free block")
        page_hash = self._hash_of.pop(src)
        self._hash_of[dst] = page_hash
        self._page_of[page_hash] = dst

    def evict(self, page: int) -> list[EvictedPage]:
        """Unregisters a cached page and its cached descendants; returns each, deepest first,
        with what it was computed over (the host tier keeps that for partial matches). Their
        blocks are free: the caller gives them back to the arena."""
        if page in self._refs or page not in self._hash_of:
            raise RuntimeError(f"evict({page}): only cached pages can be evicted")
        freed: list[EvictedPage] = []
        self._evict_chain(self._hash_of[page], freed)
        return freed

    def _evict_chain(self, page_hash: bytes, freed: list[EvictedPage]) -> None:
        for child in list(self._children.get(page_hash, ())):
            self._evict_chain(child, freed)
        page = self._page_of.pop(page_hash)
        if page in self._refs:  # the invariant above forbids this; fail loudly rather than corrupt
            raise RuntimeError(f"page {page} is held but its ancestor was evicted")
        del self._hash_of[page]
        parent = self._parent.pop(page_hash)
        root, tokens = self._tokens.pop(page_hash, (b"", None))
        if parent is None and tokens is not None:
            firsts = self._firsts[root]
            firsts.discard(page_hash)
            if not firsts:
                del self._firsts[root]
        if parent is not None and parent in self._children:
            self._children[parent].discard(page_hash)
            if not self._children[parent]:
                del self._children[parent]
        self._children.pop(page_hash, None)
        self._num_cached -= 1
        partial = page_hash in self._partial
        self._partial.discard(page_hash)
        freed.append(EvictedPage(page, page_hash, parent, tokens, root, partial))

    def registered(self) -> list[tuple[bytes, bytes | None]]:
        """Every (hash, parent) registered, parents before children (for snapshots): whole pages
        only (the index never hears of a partial page)."""
        out: list[tuple[bytes, bytes | None]] = []
        roots = [h for h, p in self._parent.items() if (p is None or p not in self._page_of) and h not in self._partial]
        stack = list(reversed(roots))
        while stack:
            h = stack.pop()
            out.append((h, self._parent[h]))
            stack.extend(sorted(c for c in self._children.get(h, ()) if c not in self._partial))
        return out

    def partial_pages(self) -> list[tuple[bytes, bytes | None]]:
        """Every partial page's (key, parent)."""
        return [(h, self._parent[h]) for h in self._partial]

    def check(self) -> None:
        cached = set(self._hash_of) - set(self._refs)
        if len(cached) != self._num_cached or len(self._page_of) != len(self._hash_of):
            raise AssertionError(f"page pool corrupt: cached {len(cached)} counted {self._num_cached}, "
                                 f"hashes {len(self._page_of)} pages {len(self._hash_of)}")
