"""What the prefix cache may take back, and in which order (design rule 7): one LRU over cached
pages and stored checkpoints, and the bytes they would free.

An item is listed while it is evictable: a page nobody holds, a checkpoint no admission has
pinned; both are named by their chain hash (a page keeps its name when the cache moves it to
another block). Both kinds share one clock, so "least recently used" compares a page with a checkpoint;
they are kept as two queues (each in clock order) so either kind's coldest is found at once.
A demoted checkpoint (its conversation moved on: rule 7) goes colder than anything used, and so
does a demoted page (a partial page a deeper one superseded).

Units: an evicted page frees one arena block, a checkpoint `slot_blocks`; `evictable_blocks`
counts what evicting everything listed would free, `evictable_bytes` the same in bytes. Plain
Python; the prefix cache decides when to evict and does it, this module only keeps the order.

Pages are held by the thousand at once (a long prompt's hit run), so holding one costs the LRU
nothing: a page keeps its place while held, and reading the order skips pages that are held
(`is_held`, the page pool's word) or were listed again since (a queue of (tick, page) in listing
order, checked against a dict of page -> tick of its last listing; stale entries are dropped when
read, and when they outnumber the live ones). A released page is listed again at the hot end;
an evicted one is unlisted. The evictable page count is the page pool's cached count
(`cached_pages`), which holding and releasing already keep.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

PAGE, CHECKPOINT = "page", "checkpoint"


class CacheBudget:
    def __init__(self, block_bytes: int, slot_blocks: int, is_held: Callable[[bytes], bool] = lambda h: False,
                 cached_pages: Callable[[], int] | None = None):
        """is_held(page hash): the page pool's say; cached_pages(): how many pages are cached."""
        self.block_bytes, self.slot_blocks = block_bytes, slot_blocks
        self._is_held = is_held
        self._cached_pages = cached_pages if cached_pages is not None else (lambda: len(self._pages))
        self._pages: dict[bytes, int] = {}  # listed page hash (held ones keep theirs) -> tick of last listing
        self._page_order: deque[tuple[int, bytes]] = deque()  # (tick, page hash) as listed; stale ones skipped
        self._ckpts: OrderedDict[bytes, int] = OrderedDict()  # checkpoint hash -> tick of last use
        self._tick = 0
        self._cold = -1  # demoted pages' ticks count down from here: colder than anything listed

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Evictable pages: the cached ones."""
        return self._cached_pages()

    @property
    def num_checkpoints(self) -> int:
        return len(self._ckpts)

    @property
    def evictable_blocks(self) -> int:
        return self._cached_pages() + len(self._ckpts) * self.slot_blocks

    @property
    def evictable_bytes(self) -> int:
        return self.evictable_blocks * self.block_bytes

    def has_place(self, page_hash: bytes) -> bool:
        """The page has a place in the order (listed since it was last cached)."""
        return page_hash in self._pages

    def has_checkpoint(self, page_hash: bytes) -> bool:
        return page_hash in self._ckpts

    # ---- listing -------------------------------------------------------------------------------
    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def list_page(self, page_hash: bytes) -> None:
        """The page became evictable: it goes to the hot end."""
        tick = self._next_tick()
        self._pages[page_hash] = tick
        self._page_order.append((tick, page_hash))
        if len(self._page_order) > 2 * len(self._pages) + 1024:  # mostly stale: keep the live entries
            pages = self._pages
            self._page_order = deque(e for e in self._page_order if pages.get(e[1]) == e[0])

    def list_checkpoint(self, page_hash: bytes) -> None:
        self._ckpts[page_hash] = self._next_tick()

    def unlist_page(self, page_hash: bytes) -> bool:
        """The page is gone (evicted); False if it was not listed."""
        return self._pages.pop(page_hash, None) is not None

    def unlist_checkpoint(self, page_hash: bytes) -> bool:
        return self._ckpts.pop(page_hash, None) is not None

    def touch_checkpoint(self, page_hash: bytes) -> None:
        """A listed checkpoint was asked for again: it goes to the hot end."""
        if self.unlist_checkpoint(page_hash):
            self.list_checkpoint(page_hash)

    def demote(self, page_hash: bytes) -> None:
        """A listed checkpoint goes colder than anything used (its conversation moved on)."""
        self._ckpts[page_hash] = -1
        self._ckpts.move_to_end(page_hash, last=False)

    def demote_page(self, page_hash: bytes) -> None:
        """A listed page goes colder than anything used (a partial page a deeper one superseded)."""
        if page_hash in self._pages:
            self._cold -= 1
            self._pages[page_hash] = self._cold
            self._page_order.appendleft((self._cold, page_hash))

    # ---- order -----------------------------------------------------------------------------------
    def _first_page(self) -> tuple[int, bytes] | None:
        """The coldest live (tick, page) entry, dropping stale ones in front of it."""
        order, pages, held = self._page_order, self._pages, self._is_held
        while order:
            tick, page_hash = order[0]
            if pages.get(page_hash) == tick and not held(page_hash):
                return tick, page_hash
            order.popleft()  # stale, or held: a held page is listed again when released
        return None

    def coldest_page(self) -> bytes | None:
        first = self._first_page()
        return first[1] if first is not None else None

    def coldest_checkpoint(self) -> bytes | None:
        return next(iter(self._ckpts), None)

    def coldest(self) -> tuple[str, bytes] | None:
        """The least recently used item, (PAGE, hash) or (CHECKPOINT, hash); None if nothing is
        evictable."""
        page = self._first_page()
        ckpt = next(iter(self._ckpts.items()), None)
        if ckpt is not None and (page is None or ckpt[1] < page[0]):
            return CHECKPOINT, ckpt[0]
        return (PAGE, page[1]) if page is not None else None

    def cold_first(self) -> Iterator[tuple[str, bytes]]:
        """Every listed item, coldest first, read lazily: stop iterating before evicting."""
        live, held = self._pages, self._is_held
        pages = ((h, t) for t, h in self._page_order if live.get(h) == t and not held(h))
        ckpts = iter(self._ckpts.items())
        page, ckpt = next(pages, None), next(ckpts, None)
        while page is not None or ckpt is not None:
            if ckpt is not None and (page is None or ckpt[1] < page[1]):
                yield CHECKPOINT, ckpt[0]
                ckpt = next(ckpts, None)
            else:
                yield PAGE, page[0]
                page = next(pages, None)
