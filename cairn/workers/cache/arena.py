"""The cache's one memory arena: its layout, and which blocks hold pages and which hold states.

One budget pays for everything the cache keeps on the device (design rule 7), so everything
comes out of one arena of `num_blocks` equal blocks of `block_bytes`:
- a KV page (every attention layer's K and V of `page_size` tokens) takes one block;
- a recurrent-state slot (every linear layer's conv and delta-rule state) takes `slot_blocks`
  consecutive blocks, aligned: slot g is blocks [g * slot_blocks, (g + 1) * slot_blocks), the
  "group" g. Running sequences' states and checkpoints are both slots, from this one allocator.
The runner lays tensors over the arena accordingly (`cairn.workers.execution.runner`); this module is the plain
Python side: sizes (`ArenaLayout`) and placement (`Arena`), no tensors.

Placement keeps groups whole for slots: pages take the free block with the lowest id (blocks past
the last whole group first, since no slot can use them), slots the empty group with the highest
id, so pages and states grow toward each other. A group is "blocked" while it holds a held page
or a slot that may not be evicted (a running state, a pending or pinned checkpoint); a slot can
be had only from an empty group or by evicting everything in an unblocked one. The prefix cache
decides what to evict (`cairn.workers.cache.cache_budget`) and tells the arena what is held; the arena
answers where, and counts.

A model without recurrent layers has no state bytes: its slots are ids that index nothing
(`slot_blocks` 0), handed out up to `virtual_slots`.

Speculative decoding (`num_speculative_tokens` k) adds `spare_slots` = k x `max_num_seqs` + 1 state
slots (k x `speculative_max_num_seqs` + 1 where that is given) after the cache's blocks, from group
`spare_start` on: a verify step keeps the state after each drafted token there until it knows which
stand (cairn.workers.speculative); the last one, `padding_slot`, takes the state saves of a graphed
verify step's padding rows (cairn.workers.execution.decode_graphs). The cache never places anything
there, so it holds what it holds without speculation; `arena_bytes` counts them, `cache_bytes` does
not.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from cairn.workers.model.model_config import ModelConfig
from cairn.workers.engine_options import EngineOptions

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_BUDGET = 256 * 2**20
DEFAULT_CHECKPOINTS = 256  # room made for checkpoints when the arena is sized by num_pages
STATE_ALIGN = 16  # bytes: the fp32 delta-rule state starts at this alignment inside a slot


def page_bytes(cfg: ModelConfig, page_size: int, dtype_bytes: int) -> int:
    """Bytes one KV page costs across all attention layers (K and V)."""
    return page_size * len(cfg.attention_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def conv_state_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of one sequence's conv states across all linear layers (model dtype)."""
    return len(cfg.linear_layers) * math.prod(cfg.conv_state_shape) * dtype_bytes


def ssm_state_bytes(cfg: ModelConfig) -> int:
    """Bytes of one sequence's delta-rule states across all linear layers (fp32)."""
    return len(cfg.linear_layers) * math.prod(cfg.ssm_state_shape) * 4


@dataclass(frozen=True)
class ArenaLayout:
    block_bytes: int             # one KV page across all attention layers
    slot_bytes: int              # one recurrent state (conv part, padding, delta-rule part); 0: none
    slot_blocks: int             # blocks one slot spans; 0 for a model without recurrent layers
    num_blocks: int              # the arena is num_blocks * block_bytes bytes
    ssm_offset: int = 0          # bytes into a slot where the fp32 delta-rule state starts
    max_pages: int | None = None        # cap on resident pages (held + cached); None: the arena's
    max_checkpoints: int | None = None  # cap on checkpoints (pending + stored); None: the arena's
    virtual_slots: int = 0       # slot ids of a model without recurrent layers
    host_blocks: int = 0         # blocks of the host tier (cairn.workers.cache.host_tier), same size; 0: none
    spare_slots: int = 0         # state slots after the cache's blocks, for verify steps (module doc)

    def __post_init__(self) -> None:
        if self.block_bytes < 1 or self.num_blocks < 1:
            raise ValueError(f"an arena needs blocks of at least one byte, got {self.num_blocks} x {self.block_bytes}")
        if self.slot_blocks and self.num_blocks < self.slot_blocks + 1:
            raise ValueError(f"the cache's {self.arena_bytes} bytes hold no state slot and a page "
                             f"({self.slot_blocks} + 1 blocks of {self.block_bytes} bytes): raise cache_memory_bytes")

    @property
    def cache_bytes(self) -> int:
        """The cache's blocks: what it places pages and slots in."""
        return self.num_blocks * self.block_bytes

    @property
    def padding_slot(self) -> int:
        """The last spare slot (module doc); -1 without spare slots."""
        return self.spare_start + self.spare_slots - 1 if self.spare_slots else -1

    @property
    def spare_start(self) -> int:
        """The first spare slot: the first group wholly after the cache's blocks."""
        return -(-self.num_blocks // self.slot_blocks) if self.slot_blocks else 0

    @property
    def arena_bytes(self) -> int:
        """The whole arena: the cache's blocks, then the spare slots."""
        if not self.spare_slots:
            return self.cache_bytes
        return (self.spare_start + self.spare_slots) * self.slot_blocks * self.block_bytes

    @property
    def spare_bytes(self) -> int:
        """The spare slots' bytes, and the blocks that align them to a group."""
        return self.arena_bytes - self.cache_bytes

    @property
    def num_groups(self) -> int:
        """Slots the arena could hold at most (every block in a state)."""
        return self.num_blocks // self.slot_blocks if self.slot_blocks else self.virtual_slots

    @property
    def page_capacity(self) -> int:
        """Pages the arena could hold at most (no state slot taken)."""
        return min(self.num_blocks, self.max_pages) if self.max_pages is not None else self.num_blocks

    @classmethod
    def plan(cls, cfg: ModelConfig, options: EngineOptions, dtype_bytes: int) -> ArenaLayout:
        """The arena for `cfg` under `options`: `cache_memory_bytes` sizes it (default 256 MiB);
        `num_pages` alone sizes it to that many pages plus room for every running state and
        `max_checkpoints` (default 256) checkpoints, and caps pages there."""
        block = page_bytes(cfg, options.page_size, dtype_bytes)
        conv = conv_state_bytes(cfg, dtype_bytes)
        ssm_offset = -(-conv // STATE_ALIGN) * STATE_ALIGN
        slot = ssm_offset + ssm_state_bytes(cfg) if cfg.recurrent else 0
        slot_blocks = -(-slot // block)
        ckpts = options.max_checkpoints
        if options.cache_memory_bytes is None and options.num_pages is not None:
            if ckpts is None and slot_blocks:
                ckpts = DEFAULT_CHECKPOINTS
            blocks = options.num_pages + (options.max_num_seqs + (ckpts or 0)) * slot_blocks
        else:
            budget = options.cache_memory_bytes or DEFAULT_BUDGET
            blocks = budget // block
            if blocks < slot_blocks + 1:
                raise ValueError(f"cache_memory_bytes {budget} holds no state slot and a page "
                                 f"({(slot_blocks + 1) * block} bytes at least)")
        return cls(block_bytes=block, slot_bytes=slot, slot_blocks=slot_blocks, num_blocks=blocks,
                   ssm_offset=ssm_offset if slot else 0, max_pages=options.num_pages,
                   max_checkpoints=ckpts if slot_blocks else 0,
                   virtual_slots=0 if slot_blocks else options.max_num_seqs,
                   host_blocks=options.host_cache_bytes // block,
                   spare_slots=options.num_speculative_tokens * options.verifying_seqs + 1
                   if slot_blocks and options.num_speculative_tokens else 0)


class Arena:
    """Placement over an `ArenaLayout`: free blocks, page blocks, slot groups, and which groups
    are blocked. Refused placements are results (None), never exceptions."""

    def __init__(self, layout: ArenaLayout):
        self.layout = layout
        self.k = k = layout.slot_blocks
        self.num_blocks = n = layout.num_blocks
        self.num_groups = n // k if k else 0
        whole = self.num_groups * k  # blocks [whole, n) can never be part of a slot
        self._free = bytearray(b"\1") * n
        self._num_free = n
        # free blocks, lowest first, tail blocks before any group's. Lazy: an entry whose block was
        # taken since is skipped when it comes up; a block has one entry at most (`_queued`), so
        # the heap never outgrows the arena however blocks churn.
        self._free_heap = [(0, b) for b in range(whole, n)] + [(1, b) for b in range(whole)]
        self._queued = bytearray(b"\1") * n
        self._pages_in = [0] * self.num_groups     # blocks of the group holding pages
        self._blocked = [0] * self.num_groups      # held pages + 1 if its slot may not be evicted
        self._slot = bytearray(self.num_groups)    # 1: the group is a slot
        self._num_slots = 0
        self._num_unblocked = self.num_groups
        self._empty = [-g for g in range(self.num_groups)]  # max-heap of empty groups (lazy, one entry each)
        heapq.heapify(self._empty)
        self._empty_queued = bytearray(b"\1") * self.num_groups
        self._virtual = list(range(layout.virtual_slots - 1, -1, -1))

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_slots(self) -> int:
        """Slots in use (running states and checkpoints)."""
        return self._num_slots if self.k else self.layout.virtual_slots - len(self._virtual)

    @property
    def used_bytes(self) -> int:
        return (self.num_blocks - self._num_free) * self.layout.block_bytes

    @property
    def num_unblocked(self) -> int:
        """Groups a slot could be had from, evicting what they hold if need be."""
        return self._num_unblocked

    def group_of_page(self, page: int) -> int | None:
        g = page // self.k if self.k else None
        return g if g is not None and g < self.num_groups else None

    def is_blocked(self, group: int) -> bool:
        return self._blocked[group] > 0

    def has_free_slot(self) -> bool:
        """Whether `take_slot` would succeed now, evicting nothing."""
        return bool(self._virtual) if not self.k else self.has_empty_group()

    def has_empty_group(self) -> bool:
        while self._empty and not self._is_empty(-self._empty[0]):
            self._empty_queued[-heapq.heappop(self._empty)] = 0
        return bool(self._empty)

    def _queue_block(self, b: int) -> None:
        if not self._queued[b]:
            self._queued[b] = 1
            heapq.heappush(self._free_heap, (1 if self.group_of_page(b) is not None else 0, b))

    def _queue_group(self, g: int) -> None:
        if not self._empty_queued[g]:
            self._empty_queued[g] = 1
            heapq.heappush(self._empty, -g)

    def _is_empty(self, g: int) -> bool:
        return not self._slot[g] and self._pages_in[g] == 0

    # ---- pages ---------------------------------------------------------------------------------
    def take_page(self, outside: int | None = None) -> int | None:
        """The lowest free block (not in group `outside`, if given), now a page held by the
        caller; None if there is none."""
        passed = []
        taken = None
        while self._free_heap:
            entry = heapq.heappop(self._free_heap)
            b = entry[1]
            if not self._free[b]:
                self._queued[b] = 0
                continue  # stale
            if outside is not None and self.group_of_page(b) == outside:
                passed.append(entry)
                continue
            taken = b
            break
        for entry in passed:
            heapq.heappush(self._free_heap, entry)
        if taken is not None:
            self._queued[taken] = 0
            self._free[taken] = 0
            self._num_free -= 1
            g = self.group_of_page(taken)
            if g is not None:
                self._pages_in[g] += 1
                self._block(g)
        return taken

    def pages_in(self, group: int) -> int:
        """Blocks of `group` holding pages."""
        return self._pages_in[group]

    def free_page(self, page: int) -> None:
        """A page's block is free again; the page is not held (`page_held(page, False)` first)."""
        self._free[page] = 1
        self._num_free += 1
        self._queue_block(page)
        g = self.group_of_page(page)
        if g is not None:
            self._pages_in[g] -= 1
            if self._pages_in[g] == 0:
                self._queue_group(g)

    def page_held(self, page: int, held: bool) -> None:
        """A page went from unheld (cached) to held, or back: its group is blocked while held."""
        g = self.group_of_page(page)
        if g is not None:
            self._block(g) if held else self._unblock(g)

    def pages_held(self, pages: list[int]) -> None:
        """`page_held(page, True)` for each of `pages` (a hit run: in one loop)."""
        k, groups, blocked = self.k, self.num_groups, self._blocked
        if not k:
            return
        for page in pages:
            g = page // k
            if g < groups:
                if not blocked[g]:
                    self._num_unblocked -= 1
                blocked[g] += 1

    # ---- slots ---------------------------------------------------------------------------------
    def take_slot(self) -> int | None:
        """The highest empty group as a slot, blocked (a running state or a pending checkpoint),
        or None when no group is empty (the caller evicts an unblocked one first)."""
        if not self.k:
            return self._virtual.pop() if self._virtual else None
        if not self.has_empty_group():
            return None
        g = -heapq.heappop(self._empty)
        self._empty_queued[g] = 0
        self._slot[g] = 1
        self._num_slots += 1
        base = g * self.k
        for b in range(base, base + self.k):
            self._free[b] = 0  # its heap entries go stale
        self._num_free -= self.k
        self._block(g)
        return g

    def free_slot(self, slot: int, blocked: bool) -> None:
        """Gives a slot back; `blocked`: whether it was blocked (running or pending) until now."""
        if not self.k:
            self._virtual.append(slot)
            return
        if blocked:
            self._unblock(slot)
        self._slot[slot] = 0
        self._num_slots -= 1
        base = slot * self.k
        for b in range(base, base + self.k):
            self._free[b] = 1
            self._queue_block(b)
        self._num_free += self.k
        self._queue_group(slot)

    def slot_evictable(self, slot: int, evictable: bool) -> None:
        """A stored checkpoint's slot may be evicted (listed) or not (pinned by a resume)."""
        if self.k:
            self._unblock(slot) if evictable else self._block(slot)

    def is_slot(self, group: int) -> bool:
        return bool(self._slot[group])

    def pages_of_group(self, group: int) -> range:
        return range(group * self.k, (group + 1) * self.k)

    def is_free(self, block: int) -> bool:
        return bool(self._free[block])

    # ---- blocking ------------------------------------------------------------------------------
    def _block(self, g: int) -> None:
        self._blocked[g] += 1
        if self._blocked[g] == 1:
            self._num_unblocked -= 1

    def _unblock(self, g: int) -> None:
        self._blocked[g] -= 1
        if self._blocked[g] == 0:
            self._num_unblocked += 1

    def check(self, held_pages: set[int], page_blocks: set[int], blocked_slots: set[int]) -> None:
        """Integrity: the arena agrees with what the pools say is held, resident and in use."""
        slots = [g for g in range(self.num_groups) if self._slot[g]]
        free = self._free.count(1)
        if free != self._num_free or free + len(page_blocks) + len(slots) * self.k != self.num_blocks or \
                any(self._free[p] for p in page_blocks) or len(slots) != self._num_slots:
            raise AssertionError(f"arena corrupt: free={free}/{self._num_free} pages={len(page_blocks)} "
                                 f"slots={len(slots)} total blocks={self.num_blocks}")
        pages, held = [0] * self.num_groups, [0] * self.num_groups
        for p in page_blocks:
            if (g := self.group_of_page(p)) is not None:
                pages[g] += 1
                held[g] += p in held_pages
        for g in range(self.num_groups):
            blocked = held[g] + (g in blocked_slots)
            if pages[g] != self._pages_in[g] or blocked != self._blocked[g] or (self._slot[g] and pages[g]) or \
                    (self._slot[g] and any(self._free[b] for b in self.pages_of_group(g))):
                raise AssertionError(f"arena group {g}: pages {self._pages_in[g]} (expected {pages[g]}), "
                                     f"blocked {self._blocked[g]} (expected {blocked}), slot {self._slot[g]}")
        if sum(1 for b in self._blocked if not b) != self._num_unblocked:
            raise AssertionError("arena: unblocked group count is off")
