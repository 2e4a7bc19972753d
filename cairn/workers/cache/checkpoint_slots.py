"""Checkpoint slots during steps: taken before a step, written by it, then stored or dropped.

`CheckpointSlots` is a component of `cairn.workers.cache.prefix_cache.PrefixCache`:
- `room`: whether a slot can be had without evicting anything (the policy's verdicts bind only
  when it cannot); `take`: a pending device slot, evicting to make room (None: none can be had);
  `take_host`: with a host tier, when no device slot can be had, a `cairn.workers.plan.HostSlot` the
  state is copied to after the step;
- `finish_capture`: the slot a sequence's state is taken into at the last page boundary it
  crossed, stored as its finish checkpoint when it finishes (the policy's `captures_finish`);
- `commit`: the written state becomes `seq`'s checkpoint after `position` tokens: at a page
  boundary, keyed by that page; inside a page, a sub-page one on the page before it (on the
  device, or on the host when it was written to a `HostSlot`). Refused (dropped) when its page
  is gone or it is already stored. A request that
  resumed from a checkpoint demotes it once it stores a deeper one (`demoted`, at the pass's
  end while an admission pins it);
- `store`: a written slot under a key (a commit, or an import from a peer);
- `drop_pending`: a pending slot given back unwritten.
"""

from __future__ import annotations

from cairn.cache_service.events import DEVICE, HOST
from cairn.cache_service.hashing import branch_root, next_page_hash
from cairn.workers.cache.arena import Arena, ArenaLayout
from cairn.workers.cache.cache_budget import CacheBudget
from cairn.workers.cache.checkpoint_policy import CheckpointPolicy
from cairn.workers.cache.checkpoint_store import Checkpoint, CheckpointStore
from cairn.workers.cache.host_tier import HostTier
from cairn.workers.cache.lookup import extend_hashes
from cairn.workers.cache.page_pool import PagePool
from cairn.workers.cache.placement import Placement
from cairn.workers.cache.stats import CacheStats
from cairn.workers.sequence import Sequence
from cairn.workers.slot import HostSlot, Slot


class CheckpointSlots:
    def __init__(self, layout: ArenaLayout, page_size: int, policy: CheckpointPolicy, pages: PagePool, arena: Arena,
                 budget: CacheBudget, checkpoints: CheckpointStore, host: HostTier, placement: Placement,
                 stats: CacheStats):
        self.layout, self.page_size, self.slot_blocks, self.policy = layout, page_size, layout.slot_blocks, policy
        self.pages, self.arena, self.budget, self.checkpoints, self.host = pages, arena, budget, checkpoints, host
        self.placement, self.stats = placement, stats
        self._host_pending: set[HostSlot] = set()
        self._host_slot_ids = 0
        self.demoted: set[bytes] = set()  # moved on from while pinned: demoted when the pass ends

    @property
    def bytes(self) -> int:
        """Arena bytes of checkpoints, pending and stored."""
        return (self.checkpoints.num_stored + self.checkpoints.num_pending) * self.slot_blocks * self.layout.block_bytes

    def room(self) -> bool:
        """Whether a checkpoint slot can be had without evicting anything: under the cap, and an
        empty group in the arena (the policy's verdicts bind only when this is False)."""
        if not self.slot_blocks or self.layout.max_checkpoints == 0:
            return False
        return not self._at_cap() and self.arena.has_free_slot()

    def _at_cap(self) -> bool:
        cap = self.layout.max_checkpoints
        return cap is not None and self.checkpoints.num_stored + self.checkpoints.num_pending >= cap

    def take(self) -> int | None:
        """A pending checkpoint slot, evicting to make room; None when none can be had."""
        if not self.slot_blocks or self.layout.max_checkpoints == 0:
            return None
        while self._at_cap():
            coldest = self.budget.coldest_checkpoint()
            if coldest is None:
                return None
            self.placement.evict_checkpoint(coldest)
        if not self.arena.has_empty_group() and not self.arena.num_unblocked:
            self.stats.checkpoints_without_slot += 1
            return None
        slot = self.placement.take_slot()
        self.checkpoints.add_pending(slot)
        self.stats.state_bytes_peak = max(self.stats.state_bytes_peak, self.bytes)
        return slot

    def take_host(self) -> HostSlot | None:
        """With a host tier, when no device slot can be had: a pending checkpoint written straight
        to host blocks after the step, which `commit` and `drop_pending` take like a
        slot. None: no tier, or no room."""
        blocks = self.placement.host_blocks(self.slot_blocks)
        if blocks is None:
            return None
        self._host_slot_ids += 1
        slot = HostSlot(self._host_slot_ids, tuple(blocks))
        self._host_pending.add(slot)
        return slot

    def drop_pending(self, slot: Slot) -> None:
        if isinstance(slot, HostSlot):
            self._host_pending.remove(slot)
            self.host.free_blocks(list(slot.blocks))
            return
        self.checkpoints.drop_pending(slot)
        self.arena.free_slot(slot, blocked=True)

    def drop_pending_if_any(self, slot: Slot) -> None:
        """Gives back `slot` if it is still a pending checkpoint (a commit that failed midway)."""
        if slot in self._host_pending or (isinstance(slot, int) and self.checkpoints.is_pending(slot)):
            self.drop_pending(slot)

    def finish_capture(self, seq: Sequence, page: int, at_end: bool = True) -> Slot | None:
        """The slot to take `seq`'s state after page `page` into, the last boundary it crossed
        (None: not captured); it is stored as a finish checkpoint when `seq` finishes. With no
        device slot to be had, a `HostSlot` when the boundary ends the step's segment
        (`at_end`: the state is copied from the sequence's slot after the step)."""
        c, kind = seq.cache, self.policy.captures_finish
        if kind is None:
            return None
        if c.finish_admitted is None:
            room = self.room()
            wasted = not room and self.policy.reply_rewritten(seq.num_prompt_tokens, seq.hints)
            c.finish_admitted = not wasted and bool(self.policy.admit({kind}, room=room))
        if not c.finish_admitted:
            return None
        if c.finish_slot is None:
            c.finish_slot = self.take()
            if c.finish_slot is None and at_end and self.host:
                c.finish_slot = self.take_host()
        if c.finish_slot is None or (isinstance(c.finish_slot, HostSlot) and not at_end):
            return None
        c.finish_page = page
        return c.finish_slot

    def commit(self, seq: Sequence, slot: Slot, position: int, kinds: set[str],
               exact_tail: tuple[int, ...] | None = None) -> bool:
        """Stores the state in pending `slot` as `seq`'s checkpoint after `position` tokens: at a
        page boundary, keyed by that page; inside a page, a sub-page one on the page before it.
        Refused (False) when its page is gone or it is already stored (on either tier, for a
        `HostSlot`)."""
        depth, cut = divmod(position, self.page_size)
        on_host = isinstance(slot, HostSlot)
        tail = tuple(seq.cache_tokens[position - cut:position])
        floor = extend_hashes(seq, depth, self.page_size)[depth - 1] if depth else seq.hash_root
        if tail:  # keyed under this sequence's root: a floor may be a public page every tenant shares
            key = next_page_hash(branch_root(floor, seq.hash_root), tail)
        else:
            key = floor if depth else None
        existing = self.checkpoints.get(key) if key is not None else None
        if key is None or (depth and self.pages.page_of(floor) is None) or existing is not None or \
                (on_host and key in self.host.checkpoints):
            self.drop_pending(slot)
            self.stats.checkpoints_dropped += 1
            if existing is not None:
                existing.kinds |= kinds
                self.budget.touch_checkpoint(key)
            return False
        if on_host:  # written to the host tier (no device slot could be had)
            self._host_pending.remove(slot)
            ckpt = Checkpoint(key, -1, depth, set(kinds), exact_tail, tail, floor if tail else None,
                              self.policy.clock, seq.hash_root)
            self.host.add_checkpoint(ckpt, list(slot.blocks))
            self.placement.state_event(floor if depth else None)
            self.placement.sub_event(ckpt, HOST)
            self.stats.checkpoints_stored += 1
            self.stats.checkpoints_to_host += 1
            self.stats.count("stored", kinds)
        else:
            self.store(slot, key, depth, kinds, exact_tail, tail, floor if tail else None, seq.hash_root)
        resumed = seq.cache.resumed_from
        if resumed is not None and position > resumed[1]:
            old = resumed[0]  # the conversation moved on: its old resume point goes cold
            if self.budget.has_checkpoint(old):
                self.budget.demote(old)
            else:
                self.demoted.add(old)  # still pinned by this scheduling pass: demote at its end
            seq.cache.resumed_from = None
        return True

    def store(self, slot: int, page_hash: bytes, depth: int, kinds: set[str],
                         exact_tail: tuple[int, ...] | None = None, tail: tuple[int, ...] = (),
                         floor: bytes | None = None, root: bytes | None = None) -> None:
        """Pending `slot` (written) becomes the checkpoint keyed `page_hash`: after that page,
        which is on the device and has none yet, or, with `floor`, the sub-page one `tail`
        tokens into the page after `floor` (a host copy of either is superseded)."""
        ckpt = self.checkpoints.store(slot, page_hash, depth, kinds, exact_tail, tail, floor, self.policy.clock, root)
        self.host.drop_checkpoint(page_hash)  # a host copy is superseded (the state event below tells the index)
        self.budget.list_checkpoint(page_hash)
        self.arena.slot_evictable(slot, True)
        self.placement.state_event(page_hash if floor is None else floor if depth else None)
        self.placement.sub_event(ckpt, DEVICE)
        self.stats.checkpoints_stored += 1
        self.stats.count("stored", kinds)
