"""The host tier: what the device cache evicts, kept in host memory instead of dropped.

Plain Python, no tensors: the runner owns the host memory (`cairn.workers.execution.runner`: one buffer of
`num_blocks` blocks of the device arena's block size, pinned on CUDA, a separate pool on CPU) and
copies blocks as the prefix cache's block copies say (`take_block_copies`); this module decides
which host block holds what, and what leaves when room is needed.

- A page takes one host block; a checkpoint takes `slot_blocks` host blocks, any ones (on the
  host a state need not be contiguous: it is copied block by block into a device slot).
- A hash lives in one tier at a time: a page or checkpoint moves here when the device evicts it
  (a demotion) and leaves when a request takes it back (`pop_page`, a promotion) or the device
  computes it again (the device copy supersedes this one). A checkpoint restored from here stays
  here: the request copies it into its own running state.
- Chains: the device pages of a chain are a prefix of it, its host pages follow (a host page's
  parent is on the device or here; its children are here). So a host page goes with its host
  descendants and the checkpoints on them (design rule 7, the same rule as on the device), and
  when the device drops a page outright, the host pages under it go too (`drop_below`).
- Eviction is least recently stored or used first (`touch`); a checkpoint pinned by an admission
  (until the scheduling pass ends, `unpin_all`) stays. `take_blocks` evicts until the blocks
  asked for are free, or refuses (None) without evicting when they never could be.
Everything that leaves is reported through `on_removed(pages, states)`, so the prefix cache can
tell the index.
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


class HostTier:
    def __init__(self, num_blocks: int, slot_blocks: int,
                 on_removed: Callable[[list[bytes], list[bytes]], None] = lambda pages, states: None):
        self.num_blocks, self.slot_blocks = num_blocks, slot_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.pages: dict[bytes, HostPage] = {}
        self._children: dict[bytes, set[bytes]] = {}  # parent hash (device or host) -> host pages under it
        self.checkpoints: dict[bytes, Checkpoint] = {}
        self._ckpt_blocks: dict[bytes, list[int]] = {}
        self._lru: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # coldest first
        self._pinned: set[bytes] = set()
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

    # ---- room ----------------------------------------------------------------------------------
    def take_blocks(self, n: int) -> list[int] | None:
        """`n` free host blocks, evicting the coldest unpinned items until they are free; None
        (nothing evicted) when even an empty tier, less what is pinned, has fewer."""
        if n > self.num_blocks - len(self._pinned) * self.slot_blocks:
            return None
        while len(self._free) < n:
            if not self._evict_coldest():
                return None
        return [self._free.pop() for _ in range(n)]

    def free_blocks(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def _evict_coldest(self) -> bool:
        for kind, page_hash in self._lru:
            if kind == PAGE:
                self.pages_evicted += 1
                self._drop_subtree(page_hash, evicted=True)
                return True
            if page_hash not in self._pinned:
                self.checkpoints_evicted += 1
                self._drop_checkpoints([page_hash])
                return True
        return False

    # ---- adding ------------------------------------------------------------------------------
    def add_page(self, page_hash: bytes, parent: bytes | None, block: int) -> None:
        self.pages[page_hash] = HostPage(block, parent)
        if parent is not None:
            self._children.setdefault(parent, set()).add(page_hash)
        self._lru[(PAGE, page_hash)] = None

    def add_checkpoint(self, ckpt: Checkpoint, blocks: list[int]) -> None:
        self.checkpoints[ckpt.page_hash] = ckpt
        self._ckpt_blocks[ckpt.page_hash] = blocks
        self._lru[(CHECKPOINT, ckpt.page_hash)] = None

    def touch(self, kind: str, page_hash: bytes) -> None:
        """Used again: to the hot end."""
        self._lru.move_to_end((kind, page_hash))

    def pin(self, page_hash: bytes) -> None:
        """The checkpoint is being restored in this scheduling pass: not evictable until its end."""
        self._pinned.add(page_hash)
        self.touch(CHECKPOINT, page_hash)

    def unpin_all(self) -> None:
        self._pinned.clear()

    # ---- leaving -------------------------------------------------------------------------------
    def pop_page(self, page_hash: bytes) -> int:
        """Takes the page out of the tier (promoted, or computed again on the device) and returns
        its block, which the caller frees once the copy out of it is queued. Its children stay:
        their parent is now on the device. Its checkpoint, if any, stays."""
        page = self.pages.pop(page_hash)
        del self._lru[(PAGE, page_hash)]
        self._unlink(page_hash, page.parent)
        return page.block

    def drop_checkpoint(self, page_hash: bytes) -> bool:
        """Drops the checkpoint at `page_hash` if it is here (superseded by a device one, or its
        page is gone); its blocks are free at once. Not reported: the caller tells the index."""
        if page_hash not in self.checkpoints:
            return False
        self._forget_checkpoint(page_hash)
        return True

    def drop_below(self, page_hash: bytes) -> None:
        """The device dropped page `page_hash` outright: its checkpoint here and every host page
        under it (with their checkpoints) go, reported."""
        if page_hash in self.checkpoints:
            self._drop_checkpoints([page_hash])
        for child in list(self._children.get(page_hash, ())):
            self._drop_subtree(child, evicted=False)

    def clear(self) -> None:
        """Drops everything, unreported (the caller announces a fresh picture)."""
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.pages.clear()
        self._children.clear()
        self.checkpoints.clear()
        self._ckpt_blocks.clear()
        self._lru.clear()
        self._pinned.clear()

    def _drop_subtree(self, page_hash: bytes, evicted: bool) -> None:
        pages: list[bytes] = []
        stack = [page_hash]
        while stack:
            h = stack.pop()
            pages.append(h)
            stack.extend(self._children.get(h, ()))
        states = [h for h in pages if h in self.checkpoints]
        for h in states:
            self._forget_checkpoint(h)
        for h in reversed(pages):  # deepest first
            self._free.append(self.pop_page(h))
            self._children.pop(h, None)
        self._on_removed(pages, states)

    def _drop_checkpoints(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._forget_checkpoint(h)
        self._on_removed([], hashes)

    def _forget_checkpoint(self, page_hash: bytes) -> None:
        del self.checkpoints[page_hash]
        self._free.extend(self._ckpt_blocks.pop(page_hash))
        del self._lru[(CHECKPOINT, page_hash)]
        self._pinned.discard(page_hash)

    def _unlink(self, page_hash: bytes, parent: bytes | None) -> None:
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(page_hash)
                if not siblings:
                    del self._children[parent]

    # ---- reporting -------------------------------------------------------------------------------
    def registered(self) -> list[tuple[bytes, bytes | None]]:
        """Every (hash, parent) here, parents before children (for snapshots)."""
        out: list[tuple[bytes, bytes | None]] = []
        stack = sorted((h for h, p in self.pages.items() if p.parent not in self.pages), reverse=True)
        while stack:
            h = stack.pop()
            out.append((h, self.pages[h].parent))
            stack.extend(sorted(self._children.get(h, ()), reverse=True))
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
        for h in self.checkpoints:
            if h not in self.pages and not device_has(h):
                raise AssertionError("a host checkpoint's page is resident nowhere")
