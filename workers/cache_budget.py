"""What the prefix cache may take back, and in which order (design rule 7): one LRU over cached
pages and stored checkpoints, and the bytes they would free.

An item is listed while it is evictable: a page nobody holds, a checkpoint no admission has
pinned; both are named by their chain hash (a page keeps its name when the cache moves it to
another block). Both kinds share one clock, so "least recently used" compares a page with a checkpoint;
they are kept as two queues (each in clock order) so either kind's coldest is found at once.
A demoted checkpoint (its conversation moved on: rule 7) goes colder than anything used.

Units: an evicted page frees one arena block, a checkpoint `slot_blocks`; `evictable_blocks`
counts what evicting everything listed would free, `evictable_bytes` the same in bytes. Plain
Python; the prefix cache decides when to evict and does it, this module only keeps the order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

PAGE, CHECKPOINT = "page", "checkpoint"


class CacheBudget:
    def __init__(self, block_bytes: int, slot_blocks: int):
        self.block_bytes, self.slot_blocks = block_bytes, slot_blocks
        self._pages: OrderedDict[bytes, int] = OrderedDict()  # page hash -> tick of last use
        self._ckpts: OrderedDict[bytes, int] = OrderedDict()  # checkpoint hash -> tick of last use
        self._tick = 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def num_checkpoints(self) -> int:
        return len(self._ckpts)

    @property
    def evictable_blocks(self) -> int:
        return len(self._pages) + len(self._ckpts) * self.slot_blocks

    @property
    def evictable_bytes(self) -> int:
        return self.evictable_blocks * self.block_bytes

    def has_page(self, page_hash: bytes) -> bool:
        return page_hash in self._pages

    def has_checkpoint(self, page_hash: bytes) -> bool:
        return page_hash in self._ckpts

    # ---- listing -------------------------------------------------------------------------------
    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def list_page(self, page_hash: bytes) -> None:
        """The page became evictable: it goes to the hot end."""
        self._pages[page_hash] = self._next_tick()

    def list_checkpoint(self, page_hash: bytes) -> None:
        self._ckpts[page_hash] = self._next_tick()

    def unlist_page(self, page_hash: bytes) -> bool:
        """The page is held again or gone; False if it was not listed."""
        return self._pages.pop(page_hash, None) is not None

    def unlist_pages(self, page_hashes: list[bytes]) -> None:
        """Unlists listed pages (all of them must be listed)."""
        pop = self._pages.pop
        for page_hash in page_hashes:
            pop(page_hash)

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

    # ---- order -----------------------------------------------------------------------------------
    def coldest_page(self) -> bytes | None:
        return next(iter(self._pages), None)

    def coldest_checkpoint(self) -> bytes | None:
        return next(iter(self._ckpts), None)

    def coldest(self) -> tuple[str, bytes] | None:
        """The least recently used item, (PAGE, hash) or (CHECKPOINT, hash); None if nothing is
        evictable."""
        page = next(iter(self._pages.items()), None)
        ckpt = next(iter(self._ckpts.items()), None)
        if ckpt is not None and (page is None or ckpt[1] < page[1]):
            return CHECKPOINT, ckpt[0]
        return (PAGE, page[0]) if page is not None else None

    def cold_first(self) -> Iterator[tuple[str, bytes]]:
        """Every listed item, coldest first, read lazily: stop iterating before evicting."""
        pages, ckpts = iter(self._pages.items()), iter(self._ckpts.items())
        page, ckpt = next(pages, None), next(ckpts, None)
        while page is not None or ckpt is not None:
            if ckpt is not None and (page is None or ckpt[1] < page[1]):
                yield CHECKPOINT, ckpt[0]
                ckpt = next(ckpts, None)
            else:
                yield PAGE, page[0]
                page = next(pages, None)
