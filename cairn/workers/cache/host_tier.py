"""The host tier: what the device cache evicts, kept in host memory instead of dropped.

Plain Python, no tensors: the runner owns the host memory (`cairn.workers.execution.runner`: one buffer of
`num_blocks` blocks of the device arena's block size, pinned on CUDA, a separate pool on CPU) and
copies blocks as the prefix cache's block copies say (`take_block_copies`); this module decides
which host block holds what, and what leaves when room is needed.

- A page takes one host block; a checkpoint takes `slot_blocks` host blocks, any ones (on the
  host a state need not be contiguous: it is copied block by block into a device slot).
- Checkpoints are whole-page (keyed by the page they end) or sub-page (inside the page after
  their `floor`, keyed as on the device: `cairn.workers.cache.checkpoint_store`); `at_floor` finds
  the sub-page ones. A page keeps the tokens it was computed over and their hash root, so a
  prompt that shares only its head can copy that head (`partial_match`, as on the device).
- A hash lives in one tier at a time: a page or checkpoint moves here when the device evicts it
  (a demotion) and leaves when a request takes it back (`pop_page`, a promotion) or the device
  computes it again (the device copy supersedes this one). A checkpoint restored from here stays
  here: the request copies it into its own running state.
- Chains: the device pages of a chain are a prefix of it, its host pages follow (a host page's
  parent is on the device or here; its children are here). So a host page goes with its host
  descendants and the checkpoints on them and inside the pages after them (design rule 7, the
  same rule as on the device), and when the device drops a page outright, the host pages under
  it go too, and the sub-page checkpoints here whose floor it was (`drop_below`).
- Eviction is least recently stored or used first (`touch`); a checkpoint or page pinned by an
  admission (until the scheduling pass ends, `unpin_all`: the copies out of it are queued) stays. `take_blocks` evicts until the blocks
  asked for are free, or refuses (None) without evicting when they never could be.
Everything that leaves is reported through `on_removed(pages, state_pages)` (the pages whose
state went: a sub-page checkpoint's floor), so the prefix cache can tell the index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from cairn.workers.cache.cache_budget import CHECKPOINT, PAGE
from cairn.workers.cache.checkpoint_store import Checkpoint



@dataclass(slots=True)
class HostPage:
    block: int
    parent: bytes | None
    tokens: tuple[int, ...] | None = None  # what its K/V was computed over (None: unknown)
    root: bytes = b""  # the hash root it was computed under (`PagePool.partial_match`)
    partial: bool = False  # a sequence's last page, kept for partial matches (the index never hears of it)


class HostTier:
    def __init__(self, num_blocks: int, slot_blocks: int,
                 on_removed: Callable[[list[bytes], list[bytes], list[bytes]], None] = lambda pages, states, subs: None):
        self.num_blocks, self.slot_blocks = num_blocks, slot_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.pages: dict[bytes, HostPage] = {}
        self._children: dict[bytes, set[bytes]] = {}  # parent hash (device or host) -> host pages under it
        self._firsts: dict[bytes, set[bytes]] = {}  # hash root -> its first pages here with tokens (no parent)
        self.checkpoints: dict[bytes, Checkpoint] = {}
        self._ckpt_blocks: dict[bytes, list[int]] = {}
        self._floors: dict[bytes, dict[bytes, Checkpoint]] = {}  # floor page -> sub-page checkpoints here
        self._lru: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # coldest first
        self._pinned: set[bytes] = set()  # checkpoints an admission of this pass copies out of
        self._pinned_pages: set[bytes] = set()  # pages whose head an admission of this pass copies
        self._on_removed = on_removed
        self.pages_evicted = self.checkpoints_evicted = 0

    def __bool__(self) -> bool:
        return self.num_blocks > 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_of(self, page_hash: bytes) -> list[int]:
        """The host blocks of the checkpoint at `page_hash`, in slot order."""
        return self._ckpt_blocks[page_hash]

    def at_floor(self, floor: bytes) -> list[Checkpoint]:
        """The sub-page checkpoints here inside the page after `floor`."""
        return list(self._floors.get(floor, {}).values())

    def has_sub_page(self, floor: bytes) -> bool:
        return floor in self._floors

    def state_pages(self) -> list[bytes]:
        """The pages with a state here at their end or inside the page after them (the index's view)."""
        return [p for p in dict.fromkeys(c.state_page for c in self.checkpoints.values()) if p is not None]

    def partial_match(self, parent: bytes | None, tokens: list[int], root: bytes = b"") -> tuple[bytes | None, int]:
        """(page hash, m): of `parent`'s children here (None: `root`'s first pages) whose tokens
        are known and that were computed under `root`, the one whose first m tokens equal the
        first m of `tokens`, m as large as possible ((None, 0): none shares even one). The
        device's rule (`PagePool.partial_match`), over host pages."""
        best, best_m = None, 0
        for child in self._children.get(parent, ()) if parent is not None else self._firsts.get(root, ()):
            page = self.pages[child]
            known = page.tokens
            if known is None or page.root != root or not tokens or known[0] != tokens[0]:
                continue
            m, n = 1, min(len(known), len(tokens))
            while m < n and known[m] == tokens[m]:
                m += 1
            if m > best_m:
                best, best_m = child, m
        return best, best_m

    # ---- room ----------------------------------------------------------------------------------
    def take_blocks(self, n: int, keeping: list[bytes] = ()) -> list[int] | None:
        """`n` free host blocks, evicting the coldest unpinned items until they are free, the
        pages here among `keeping` pinned meanwhile; None (nothing evicted) when even an empty
        tier, less what is pinned, has fewer."""
        held = [h for h in keeping if h in self.pages and h not in self._pinned_pages]
        self._pinned_pages.update(held)
        try:
            if n > self.num_blocks - len(self._pinned) * self.slot_blocks - len(self._pinned_pages):
                return None
            while len(self._free) < n:
                if not self._evict_coldest():
                    return None
            return [self._free.pop() for _ in range(n)]
        finally:
            self._pinned_pages.difference_update(held)

    def free_blocks(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def _evict_coldest(self) -> bool:
        for kind, page_hash in self._lru:
            if kind == PAGE:
                if self._pins_under(page_hash):
                    continue
                self.pages_evicted += 1
                self._drop_subtree(page_hash, evicted=True)
                return True
            if page_hash not in self._pinned:
                self.checkpoints_evicted += 1
                self._drop_checkpoints([page_hash])
                return True
        return False

    # ---- adding ------------------------------------------------------------------------------
    def add_page(self, page_hash: bytes, parent: bytes | None, block: int,
                 tokens: tuple[int, ...] | None = None, root: bytes = b"", partial: bool = False) -> None:
        self.pages[page_hash] = HostPage(block, parent, tokens, root, partial)
        if parent is not None:
            self._children.setdefault(parent, set()).add(page_hash)
        elif tokens is not None:
            self._firsts.setdefault(root, set()).add(page_hash)
        self._lru[(PAGE, page_hash)] = None

    def add_checkpoint(self, ckpt: Checkpoint, blocks: list[int]) -> None:
        self.checkpoints[ckpt.page_hash] = ckpt
        self._ckpt_blocks[ckpt.page_hash] = blocks
        if ckpt.floor is not None:
            self._floors.setdefault(ckpt.floor, {})[ckpt.page_hash] = ckpt
        self._lru[(CHECKPOINT, ckpt.page_hash)] = None

    def touch(self, kind: str, page_hash: bytes) -> None:
        """Used again: to the hot end."""
        self._lru.move_to_end((kind, page_hash))

    def demote(self, kind: str, page_hash: bytes) -> None:
        """Superseded: to the cold end."""
        if (kind, page_hash) in self._lru:
            self._lru.move_to_end((kind, page_hash), last=False)

    def pin(self, page_hash: bytes) -> None:
        """The checkpoint is being restored in this scheduling pass: not evictable until its end."""
        self._pinned.add(page_hash)
        self.touch(CHECKPOINT, page_hash)

    def pin_page(self, page_hash: bytes) -> None:
        """An admission copies this page's head in this pass: not evictable until its end."""
        self._pinned_pages.add(page_hash)
        self.touch(PAGE, page_hash)

    def unpin_all(self) -> None:
        self._pinned.clear()
        self._pinned_pages.clear()

    def _pins_under(self, page_hash: bytes) -> bool:
        """Whether evicting the host page `page_hash` (its descendants and their checkpoints
        with it) would take something pinned."""
        if not self._pinned and not self._pinned_pages:
            return False
        stack = [page_hash]
        while stack:
            h = stack.pop()
            if h in self._pinned_pages or h in self._pinned or \
                    any(k in self._pinned for k in self._floors.get(h, ())):
                return True
            stack.extend(self._children.get(h, ()))
        return False

    # ---- leaving -------------------------------------------------------------------------------
    def pop_page(self, page_hash: bytes) -> int:
        """Takes the page out of the tier (promoted, or computed again on the device) and returns
        its block, which the caller frees once the copy out of it is queued. Its children stay:
        their parent is now on the device. Its checkpoint, if any, stays."""
        page = self.pages.pop(page_hash)
        del self._lru[(PAGE, page_hash)]
        self._unlink(page_hash, page.parent)
        if page.parent is None and page.tokens is not None:
            self._unlink(page_hash, page.root, self._firsts)
        return page.block

    def drop_checkpoint(self, page_hash: bytes) -> bool:
        """Drops the checkpoint at `page_hash` if it is here (superseded by a device one, or its
        page is gone); its blocks are free at once. Not reported: the caller tells the index."""
        if page_hash not in self.checkpoints:
            return False
        self._forget_checkpoint(page_hash)
        return True

    def drop_below(self, page_hash: bytes) -> None:
        """The device dropped page `page_hash` outright: its checkpoint here, the sub-page ones
        inside the page after it, and every host page under it (with their checkpoints) go,
        reported."""
        gone = ([page_hash] if page_hash in self.checkpoints else []) + list(self._floors.get(page_hash, ()))
        if gone:
            self._drop_checkpoints(gone)
        for child in list(self._children.get(page_hash, ())):
            self._drop_subtree(child, evicted=False)

    def clear(self) -> None:
        """Drops everything, unreported (the caller announces a fresh picture)."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.pages.clear()
        self._children.clear()
        self._firsts.clear()
        self.checkpoints.clear()
        self._ckpt_blocks.clear()
        self._floors.clear()
        self._lru.clear()
        self._pinned.clear()
        self._pinned_pages.clear()

    def _drop_subtree(self, page_hash: bytes, evicted: bool) -> None:
        pages: list[bytes] = []
        stack = [page_hash]
        while stack:
            h = stack.pop()
            pages.append(h)
            stack.extend(self._children.get(h, ()))
        states = [h for h in pages if h in self.checkpoints] + \
            [k for h in pages for k in self._floors.get(h, ())]
        state_pages, subs = self._forget_checkpoints(states)
        told = [h for h in pages if not self.pages[h].partial]  # the index never heard of a partial page
        for h in reversed(pages):  # deepest first
            self._free.append(self.pop_page(h))
            self._children.pop(h, None)
        self._on_removed(told, state_pages, subs)

    def _drop_checkpoints(self, hashes: list[bytes]) -> None:
        self._on_removed([], *self._forget_checkpoints(hashes))

    def _forget_checkpoints(self, hashes: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Forgets them; returns the pages whose state they were (a sub-page one's floor), once
        each, and the sub-page ones' index keys (`Checkpoint.index_key`)."""
        gone = [self.checkpoints[h] for h in hashes]
        for h in hashes:
            self._forget_checkpoint(h)
        pages = [p for p in dict.fromkeys(c.state_page for c in gone) if p is not None]
        return pages, [c.index_key for c in gone if c.index_key is not None]

    def _forget_checkpoint(self, page_hash: bytes) -> None:
        ckpt = self.checkpoints.pop(page_hash)
        if ckpt.floor is not None:
            at = self._floors[ckpt.floor]
            del at[page_hash]
            if not at:
                del self._floors[ckpt.floor]
        self._free.extend(self._ckpt_blocks.pop(page_hash))
        del self._lru[(CHECKPOINT, page_hash)]
        self._pinned.discard(page_hash)

    def _unlink(self, page_hash: bytes, parent: bytes | None, under: dict[bytes, set[bytes]] | None = None) -> None:
        under = self._children if under is None else under
        if parent is not None:
            siblings = under.get(parent)
            if siblings is not None:
                siblings.discard(page_hash)
                if not siblings:
                    del under[parent]

    # ---- reporting -------------------------------------------------------------------------------
    def registered(self) -> list[tuple[bytes, bytes | None]]:
        """Every (hash, parent) here, parents before children (for snapshots): whole pages only,
        as on the device (`PagePool.registered`)."""
        out: list[tuple[bytes, bytes | None]] = []
        pages = self.pages
        stack = sorted((h for h, p in pages.items() if p.parent not in pages and not p.partial), reverse=True)
        while stack:
            h = stack.pop()
            out.append((h, pages[h].parent))
            stack.extend(sorted((c for c in self._children.get(h, ()) if not pages[c].partial), reverse=True))
        return out

    def check(self, device_has: Callable[[bytes], bool]) -> None:
        """Integrity: blocks add up; every host page's parent is on the device or here, and on
        neither tier twice; every checkpoint's page is resident somewhere."""
        used = len(self.pages) + self.slot_blocks * len(self.checkpoints)
        blocks = [p.block for p in self.pages.values()] + [b for bs in self._ckpt_blocks.values() for b in bs]
        if used + len(self._free) != self.num_blocks or len(set(blocks) | set(self._free)) != self.num_blocks:
            raise AssertionError(f"host tier blocks: {used} used + {len(self._free)} free != {self.num_blocks}")
        if len(self._lru) != len(self.pages) + len(self.checkpoints):
            raise AssertionError("host tier LRU is off")
        for h, page in self.pages.items():
            if device_has(h):
                raise AssertionError("a page is on the device and the host at once")
            if page.parent is not None and page.parent not in self.pages and not device_has(page.parent):
                raise AssertionError("a host page's parent is resident nowhere")
        for ckpt in self.checkpoints.values():
            page = ckpt.state_page  # (None inside the first page: no page under it)
            if page is not None and page not in self.pages and not device_has(page):
                raise AssertionError("a host checkpoint's page (or floor page) is resident nowhere")
        if sum(map(len, self._floors.values())) != sum(c.floor is not None for c in self.checkpoints.values()):
            raise AssertionError("host tier sub-page index is off")
