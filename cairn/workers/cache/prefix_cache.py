"""The hybrid prefix cache: attention pages at every whole page, recurrent-state checkpoints at
chosen positions, one arena, and the events that tell the index (design rules 2-8).

`PrefixCache` is the one object the engine and the scheduler talk to. It owns its parts as
components (the map: `cairn.workers.cache`): the arena, page pool, checkpoint store, LRU budget, host
tier and event queue, and three that work on them: `Lookup` (where a prompt resumes),
`Placement` (where things go and what is evicted) and `CheckpointSlots` (states taken during
steps). It owns everything a sequence holds (`Sequence.cache`, a `SequenceCache`): pages,
state slot, page-table row, hash chain, checkpoint targets and the finish capture. Its
protocol, per sequence:
- `match` (rule 4, `cairn.workers.cache.lookup`): the cheapest usable resume point.
- `can_admit` then `admit`: ask before you take. `can_admit` has no side effect: it counts what
  the admission would make unevictable (cached hit pages, the checkpoint it resumes from) and
  answers whether the new pages and a state slot fit. `admit` then holds the hit pages, pins the
  checkpoint until `end_pass`, promotes host pages under the resume point, takes the slot and
  pages (evicting as needed) and sets targets; a host checkpoint is copied straight into the
  request's state slot (it stays on the host).
- `can_grow` / `grow`: pages for a running sequence's next tokens.
- Each admitted sequence also holds a row of the runner's page table; every change of a row
  (pages taken, a twin's page swapped in) is queued as a `cairn.workers.plan.PageTableWrite` for the
  next plan (`take_page_table_writes`), so the runner keeps its table without rebuilding it.
- `take_checkpoint_slot`, `finish_capture`, `commit_checkpoint`, `register_pages` during steps.
- `finish` (stores the finish capture) or `release` (abort, preemption): give everything back,
  pages tail first, so chains are evicted tail first; a last page the sequence ended inside
  stays cached as a partial page (`cairn.workers.cache.partial_pages`).

Eviction (rule 7, `cairn.workers.cache.placement`): the least recently used evictable item
(`cairn.workers.cache.cache_budget`) goes first; a page goes with its cached descendants and every
checkpoint on them, to the host tier when there is one with room, else dropped. A state slot
needs a whole arena group (`cairn.workers.cache.arena`): when none is empty, the coldest item in an
unblocked group decides which group is emptied (its pages moved, not dropped). A request that
resumed from a checkpoint demotes it once it stores a deeper one, unless the checkpoint is only
where prompts part (a hint, a branch) or lies at one of the request's hints; a prompt passing an
earlier prompt's end at one of its hints keeps it warm (an agent's next query parts there).
Nothing a running sequence holds is ever evicted; a refused allocation is a result, not an
error. Events (rule 8): every change of what is resident is queued (`cairn.workers.cache.event_queue`)
and drained by the engine.
"""

from __future__ import annotations

from cairn.cache_service.events import PagesStored
from cairn.workers.cache import integrity
from cairn.workers.cache.arena import Arena, ArenaLayout
from cairn.workers.cache.cache_budget import CHECKPOINT, CacheBudget
from cairn.workers.cache.checkpoint_policy import END, END_KINDS, CheckpointPolicy
from cairn.workers.cache.checkpoint_slots import CheckpointSlots
from cairn.workers.cache.checkpoint_store import CheckpointStore
from cairn.workers.cache.event_queue import EventQueue
from cairn.workers.cache.host_tier import HostTier
from cairn.workers.cache.lookup import Lookup, Match, extend_hashes
from cairn.workers.cache.page_pool import PagePool
from cairn.workers.cache.partial_pages import PartialPages
from cairn.workers.cache.placement import Placement
from cairn.workers.cache.stats import CacheStats
from cairn.workers.cache.tier_cost import TierCost
from cairn.workers.plan import COPY, PROMOTE, BlockCopy, PageTableWrite
from cairn.workers.sequence import Sequence
from cairn.workers.slot import HostSlot, Slot


class PrefixCache:
    def __init__(self, layout: ArenaLayout, policy: CheckpointPolicy, page_size: int, recurrent: bool,
                 max_rows: int = 65, record_events: bool = True):
        """max_rows: sequences that may hold pages at once (page-table rows). record_events:
        queue events from the start (else from the first `forget_events`, when a snapshot
        introduces the cache to whoever drains it)."""
        self.layout, self.policy, self.page_size, self.recurrent = layout, policy, page_size, recurrent
        self.slot_blocks = layout.slot_blocks
        self.max_rows = max_rows
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._table_writes: list[PageTableWrite] = []
        self._running_slots: set[int] = set()
        # the parts
        self.arena = Arena(layout)
        self.pages = PagePool()
        self.checkpoints = CheckpointStore()
        self.budget = CacheBudget(layout.block_bytes, layout.slot_blocks, is_held=self.pages.is_held_hash,
                                  cached_pages=lambda: self.pages.num_cached)
        self.host = HostTier(layout.host_blocks, layout.slot_blocks,
                             on_removed=lambda pages, states, subs: self.placement.host_removed(pages, states, subs))
        self.events = EventQueue(record_events)
        self.stats = CacheStats()
        # the parts that work on them
        self.lookup = Lookup(layout, page_size, recurrent, self.pages, self.checkpoints, self.host, TierCost())
        self.placement = Placement(layout, page_size, self.pages, self.arena, self.budget, self.checkpoints,
                                   self.host, self.events, self.stats)
        self.partial = PartialPages(page_size, recurrent, self.pages, self.budget, self.host, self.lookup, self.stats)
        self.slots = CheckpointSlots(layout, page_size, policy, self.pages, self.arena, self.budget,
                                     self.checkpoints, self.host, self.placement, self.stats)

    @property
    def tier_cost(self) -> TierCost:
        """The measured price of a host copy against prefill, by which `match` weighs resume points."""
        return self.lookup.tier_cost

    @tier_cost.setter
    def tier_cost(self, cost: TierCost) -> None:
        self.lookup.tier_cost = cost

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- hashes ---------------------------------------------------------------------------
    def adopt_hashes(self, seq: Sequence, page_hashes: list[bytes]) -> None:
        """The hashes of `seq`'s whole prompt pages, computed by the ingress (checked by the
        engine): the chain starts from them instead of being hashed here."""
        seq.cache.page_hashes = list(page_hashes)

    def extend_hashes(self, seq: Sequence, upto_pages: int) -> list[bytes]:
        """`seq`'s chain, extended to at least `upto_pages` hashes."""
        return extend_hashes(seq, upto_pages, self.page_size)

    # ---- lookup (cairn.workers.cache.lookup) ---------------------------------------------------------
    def match(self, seq: Sequence) -> Match:
        return self.lookup.match(seq)

    def device_run(self, hashes: list[bytes], upto: int | None = None) -> int:
        return self.lookup.device_run(hashes, upto)

    # ---- admission: ask, then take ----------------------------------------------------------
    def _new_pages(self, m: Match, num_tokens: int) -> int:
        """Device blocks the admission takes for pages: its new ones and those it promotes."""
        return max(0, self.pages_for_tokens(m.resume_token + num_tokens) - m.hit_pages) + len(m.promote)

    def _hit_page_ids(self, seq: Sequence, m: Match) -> list[int]:
        if m.page_ids is None:
            m.page_ids = self.pages.pages_of(seq.cache.page_hashes[:m.device_pages])
        return m.page_ids

    @staticmethod
    def _copied(m: Match) -> list[int]:
        return [] if m.copy_from is None else [m.copy_from]

    def can_admit(self, seq: Sequence, m: Match, num_tokens: int) -> bool:
        """Whether `admit(seq, m, num_tokens)` would succeed now. No side effects (beyond
        remembering the hit run's pages in `m`)."""
        cached_hits = self.pages.cached_among(self._hit_page_ids(seq, m) + self._copied(m))
        pin = m.checkpoint if m.checkpoint is not None and self.budget.has_checkpoint(m.checkpoint.page_hash) else None
        new = self._new_pages(m, num_tokens)
        if not self._free_rows:
            return False
        room = self.arena.num_free_blocks + self.budget.evictable_blocks - len(cached_hits) - \
            (self.slot_blocks if pin else 0)
        if room < new + self.slot_blocks or not self.placement.under_page_cap(self.pages.num_held + len(cached_hits) + new):
            return False
        if not self.slot_blocks:
            return self.arena.num_slots < self.layout.virtual_slots
        arena = self.arena
        if arena.has_empty_group() or arena.num_unblocked > len(cached_hits) + 1:
            return True  # an empty group, or more unblocked ones than this admission could block
        # no group is empty: one must be unblocked after this admission too
        newly_blocked = {g for g in map(arena.group_of_page, cached_hits) if g is not None and not arena.is_blocked(g)}
        if pin is not None:
            newly_blocked.add(pin.slot)
        return arena.num_unblocked > len(newly_blocked)

    def admit(self, seq: Sequence, m: Match, num_tokens: int) -> int | None:
        """Holds `seq`'s hit pages, brings back the host pages it promotes, takes its state slot
        and the pages for its first `num_tokens` tokens from the resume point, pins the
        checkpoint it resumes from (until `end_pass`) and credits its kinds. Returns that
        checkpoint's slot when it is on the device (None: a fresh state, or, with
        `m.from_host`, the checkpoint's host blocks are queued to be copied into the state
        slot). The caller checked `can_admit`."""
        c = seq.cache
        c.page_ids = list(self._hit_page_ids(seq, m))
        was_cached = self.pages.acquire_all(c.page_ids + self._copied(m))  # no longer evictable (the LRU
        self.arena.pages_held(was_cached)  # skips held pages); the page copied from, until it is copied
        c.register_stopped = False
        c.resumed_from = None
        restore = None
        if m.copy_from_host is not None:
            self.host.pin_page(m.copy_from_host)  # its head is copied below: before anything makes room
        if m.checkpoint is not None:
            ckpt = m.checkpoint
            if m.from_host:
                self.host.pin(ckpt.page_hash)  # before anything below makes room on the host
            else:
                self.placement.pin(ckpt)
                restore = ckpt.slot
            position = ckpt.position(self.page_size)
            moves_on = self.policy.moves_on(ckpt.kinds, position, seq.hints)  # demoted past a deeper one
            c.resumed_from = (ckpt.page_hash, position) if moves_on else None
            self.policy.record_hit(ckpt.kinds, ckpt.admitted_at)
            self.stats.checkpoints_used += 1
            self.stats.count("used", ckpt.kinds)
        taken = [self.host.pop_page(h) for h in m.promote]  # out of reach of what makes room below
        c.state_slot = self.placement.take_slot()
        self._running_slots.add(c.state_slot)
        if m.promote:
            c.page_ids += self.placement.promote(seq, m.promote, taken)
        c.shared_pages = c.registered_pages = m.hit_pages
        if m.from_host:
            blocks = self.host.blocks_of(m.checkpoint.page_hash)
            self.placement.copies.extend(BlockCopy(PROMOTE, b, d)
                                         for b, d in zip(blocks, self.arena.pages_of_group(c.state_slot)))
            self.stats.checkpoints_from_host += 1
            self.stats.bytes_to_device += self.slot_blocks * self.layout.block_bytes
        c.page_ids += self.placement.take_pages(self._new_pages(m, num_tokens) - len(m.promote))
        self.partial.copied(seq, m)
        if m.copy_from is not None:  # copy-on-write: the cached page's head becomes this one's
            self.placement.copies.append(BlockCopy(COPY, m.copy_from, c.page_ids[m.hit_pages]))
            self.placement.unhold(m.copy_from)
        elif m.copy_from_host is not None:  # the same from a host page, which stays on the host
            self.placement.copies.append(BlockCopy(PROMOTE, self.host.pages[m.copy_from_host].block,
                                                   c.page_ids[m.hit_pages]))
            self.stats.bytes_to_device += self.layout.block_bytes
        c.row = self._free_rows.pop()
        self._table_writes.append(PageTableWrite(c.row, 0, list(c.page_ids)))
        self._touch_hinted(seq, m.resume_token)
        c.checkpoint_targets = self.policy.prompt_targets(
            seq.num_tokens, self.page_size, m.resume_token, max(m.hit_pages * self.page_size, m.kv_tokens),
            seq.hints)
        return restore

    def _touch_hinted(self, seq: Sequence, upto: int) -> None:
        """An earlier prompt's end checkpoint that this prompt passes at one of its hints (at or
        before `upto`) goes to the hot end: the template says a later prompt of this
        conversation parts there (an agent's next query parts where its current one's first
        request ended). Message starts passed are left to age."""
        c, ps = seq.cache, self.page_size
        for pos in seq.hints:
            if pos > upto:
                break
            depth, cut = divmod(pos, ps)
            if (not depth and not cut) or depth > len(c.page_hashes):
                continue
            floor = c.page_hashes[depth - 1] if depth else seq.hash_root
            if cut:
                ckpt, on_host = self.lookup.sub_page_resume(seq, floor, pos)
            else:  # a state at a page's end: on the device, or demoted to the host tier
                ckpt, on_host = self.checkpoints.get(floor), False
                if ckpt is None and self.host:
                    ckpt = self.host.checkpoints.get(floor)
                    on_host = ckpt is not None
            if ckpt is not None and ckpt.position(ps) == pos and ckpt.kinds & END_KINDS:
                if on_host:
                    self.host.touch(CHECKPOINT, ckpt.page_hash)
                else:
                    self.budget.touch_checkpoint(ckpt.page_hash)

    def want_checkpoint(self, seq: Sequence, position: int, kind: str) -> None:
        """Asks `seq` to checkpoint after `position` tokens too (a twin waits to resume there)."""
        seq.cache.checkpoint_targets.setdefault(position, set()).add(kind)

    def end_pass(self) -> None:
        """Ends a scheduling pass: checkpoints pinned by admissions become evictable again (just
        used), those their conversation moved on from go to the cold end."""
        self.placement.end_pass(self.slots.demoted)
        self.slots.demoted.clear()

    # ---- growth -------------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self.pages_for_tokens(upto_tokens) - len(seq.cache.page_ids)
        return need <= 0 or self.placement.room_for_pages(need)

    def can_take_free_pages(self, n: int) -> bool:
        """Whether `n` pages can be had from free blocks alone, evicting nothing: taken and given
        back, they leave the cache as it was (free blocks are taken lowest first)."""
        return n <= 0 or self.placement.free_for_pages(n)

    def grow(self, seq: Sequence, upto_tokens: int) -> None:
        """Pages for `seq`'s tokens up to `upto_tokens`; the caller checked `can_grow`."""
        c = seq.cache
        new = self.placement.take_pages(self.pages_for_tokens(upto_tokens) - len(c.page_ids))
        if new:
            self._table_writes.append(PageTableWrite(c.row, len(c.page_ids), new))
            c.page_ids += new

    def take_page_table_writes(self) -> list[PageTableWrite]:
        """The page-table changes since the last call, in order (for the next step's plan)."""
        writes, self._table_writes = self._table_writes, []
        return writes

    # ---- checkpoints during steps -------------------------------------------------------------
    def checkpoint_room(self) -> bool:
        return self.slots.room()

    def take_checkpoint_slot(self) -> int | None:
        return self.slots.take()

    def take_host_checkpoint_slot(self) -> HostSlot | None:
        return self.slots.take_host()

    def drop_pending_if_any(self, slot: Slot) -> None:
        self.slots.drop_pending_if_any(slot)

    def take_block_copies(self) -> list[BlockCopy]:
        """The block copies queued since the last call, in order (`Placement.take_block_copies`)."""
        return self.placement.take_block_copies()

    def finish_capture(self, seq: Sequence, page: int, at_end: bool = True) -> Slot | None:
        """The slot to take `seq`'s state after page `page` into, kept as a finish checkpoint
        when `seq` finishes (`CheckpointSlots.finish_capture`)."""
        return self.slots.finish_capture(seq, page, at_end)

    def commit_checkpoint(self, seq: Sequence, slot: Slot, position: int, kinds: set[str],
                          exact_tail: tuple[int, ...] | None = None) -> bool:
        return self.slots.commit(seq, slot, position, kinds, exact_tail)

    def register_pages(self, seq: Sequence) -> None:
        """Registers every whole page `seq` has computed (prompt and output), under its hash.

        A page whose hash a concurrent twin registered first (two prompts with one prefix,
        prefilled in the same steps) is swapped for the twin's page, which holds the same K/V;
        ours goes back to the arena. So a sequence always holds its whole chain."""
        c, ps = seq.cache, self.page_size
        full = seq.num_computed // ps
        if c.register_stopped or c.registered_pages >= full:
            return
        hashes = self.extend_hashes(seq, full)
        run_start, run = c.registered_pages, []  # one PagesStored per consecutive run
        for j in range(c.registered_pages, full):
            page_hash, parent = hashes[j], hashes[j - 1] if j else None
            twin = self.pages.page_of(page_hash)
            if twin is not None:
                self._flush_run(hashes, run_start, run)
                run_start, run = j + 1, []
                self.placement.hold(twin)
                self.placement.unhold(c.page_ids[j])
                c.page_ids[j] = twin
                self._table_writes.append(PageTableWrite(c.row, j, [twin]))
            elif self.pages.register(c.page_ids[j], page_hash, parent, tuple(seq.cache_tokens[j * ps:(j + 1) * ps]),
                                     seq.hash_root):
                run.append(page_hash)
                if page_hash in self.host.pages:  # computed again: the device copy supersedes it
                    self.host.free_blocks([self.host.pop_page(page_hash)])
                self.partial.stored(seq, j)
            else:
                c.register_stopped = True  # cannot happen while every chain is held whole
                break
            c.registered_pages = j + 1
        self._flush_run(hashes, run_start, run)

    def _flush_run(self, hashes: list[bytes], start: int, run: list[bytes]) -> None:
        if run:
            self.events.put(PagesStored(tuple(run), hashes[start - 1] if start else None))

    # ---- ending -------------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """`seq` ended normally: its finish capture becomes a checkpoint, then `release`."""
        c = seq.cache
        if c.finish_slot is not None and c.finish_page:
            kind = self.policy.captures_finish
            tail = tuple(seq.cache_tokens[c.finish_page * self.page_size:]) if kind == END else None
            self.commit_checkpoint(seq, c.finish_slot, c.finish_page * self.page_size, {kind}, exact_tail=tail)
            c.finish_slot = c.finish_page = None
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Returns everything `seq` holds: pages tail first (its last page kept as a partial
        page when it ended inside it: `PartialPages.keep`), its state slot, its finish capture."""
        c = seq.cache
        if c.page_ids:
            self.partial.keep(seq)
        for page in reversed(c.page_ids):
            self.placement.unhold(page)
        c.page_ids = []
        if c.row is not None:
            self._free_rows.append(c.row)
            c.row = None
        if c.state_slot is not None:
            self._running_slots.discard(c.state_slot)
            self.arena.free_slot(c.state_slot, blocked=True)
            c.state_slot = None
        if c.finish_slot is not None:
            self.slots.drop_pending(c.finish_slot)
            c.finish_slot = c.finish_page = None

    def remove_checkpoint(self, page_hash: bytes) -> bool:
        """Drops one stored checkpoint (operators and tests); False if absent or pinned."""
        if not self.budget.unlist_checkpoint(page_hash):
            return False
        self.placement.remove_checkpoint(page_hash, listed=True)
        return True

    def clear(self) -> None:
        """Drops everything not held by a running sequence, and the host tier
        (`Placement.clear`: the result is announced as a fresh picture)."""
        self.placement.clear()

    # ---- reporting --------------------------------------------------------------------------
    def drain_events(self) -> list:
        return self.events.drain()

    def snapshot(self) -> tuple[list[tuple[bytes, bytes | None]], list[bytes]]:
        """What the index knows of the device now (`Placement.device_picture`): (page hash,
        parent) pairs parents first, and the pages with a state; a sub-page checkpoint is both,
        by its index key, after its floor."""
        return self.placement.device_picture()

    def host_snapshot(self) -> tuple[list[tuple[bytes, bytes | None]], list[bytes]]:
        """The same for the host tier (`Placement.host_picture`)."""
        return self.placement.host_picture()

    def forget_events(self) -> None:
        self.events.forget()

    @property
    def events_dropped(self) -> bool:
        return self.events.dropped

    @property
    def used_bytes(self) -> int:
        """Arena bytes in use: held and cached pages, running states, checkpoints."""
        return self.arena.used_bytes

    @property
    def budget_bytes(self) -> int:
        return self.layout.cache_bytes

    @property
    def checkpoint_bytes(self) -> int:
        """Arena bytes of checkpoints, pending and stored."""
        return self.slots.bytes

    @property
    def running_slots(self) -> frozenset[int]:
        """State slots held by admitted sequences."""
        return frozenset(self._running_slots)

    def check(self) -> None:
        """Integrity: pools, arena and LRU agree (`cairn.workers.cache.integrity`)."""
        integrity.check(self)
