"""Where the prefix cache puts things and what leaves when room is needed (design rule 7).

`Placement` is a component of `cairn.workers.cache.prefix_cache.PrefixCache`, handed the cache's parts
it works on (the page pool, arena, LRU budget, checkpoint store, host tier, event queue and
stats) at construction. It:
- holds and releases pages, pins checkpoints, takes pages and state slots, evicting the least
  recently used evictable item as needed; a state slot needs a whole arena group, and emptying
  one moves its cached pages to free blocks (a copy) rather than evicting them;
- evicts: a page with its cached descendants and every checkpoint on them, a checkpoint alone.
  With a host tier (`cairn.workers.cache.host_tier`) what is evicted is demoted there, when the tier
  can make room for all of it, and otherwise dropped, taking what the tier holds under it
  along. Sub-page checkpoints are demoted by the same rules as whole-page ones: alone when the
  LRU picks them, with their floor page when it goes;
- promotes host pages back to device blocks for an admission;
- clears: drops everything no running sequence holds, and the host tier (operators, tests);
- takes blocks for, and names, pages imported from a peer (`cairn.workers.cache.transfer`).
Every copy this implies is queued as a `cairn.workers.plan.BlockCopy` (`take_block_copies`) for the
runner to make before the next step, in order; every change of residency is an event.
"""

from __future__ import annotations

from cairn.cache_service.events import DEVICE, HOST, AllCleared, PagesRemoved, PagesStored, StateRemoved, StateStored
from cairn.workers.cache.arena import Arena, ArenaLayout
from cairn.workers.cache.cache_budget import CHECKPOINT, CacheBudget
from cairn.workers.cache.checkpoint_store import Checkpoint, CheckpointStore
from cairn.workers.cache.event_queue import EventQueue
from cairn.workers.cache.host_tier import HostTier
from cairn.workers.cache.page_pool import PagePool
from cairn.workers.cache.stats import CacheStats
from cairn.workers.plan import DEMOTE, MOVE, PROMOTE, BlockCopy
from cairn.workers.sequence import Sequence


class Placement:
    def __init__(self, layout: ArenaLayout, page_size: int, pages: PagePool, arena: Arena, budget: CacheBudget,
                 checkpoints: CheckpointStore, host: HostTier, events: EventQueue, stats: CacheStats):
        self.layout, self.page_size, self.slot_blocks = layout, page_size, layout.slot_blocks
        self.pages, self.arena, self.budget, self.checkpoints, self.host = pages, arena, budget, checkpoints, host
        self.events, self.stats = events, stats
        self.copies: list[BlockCopy] = []  # queued for the runner, in order
        self.pinned: list[bytes] = []  # checkpoints an admission of this pass resumes from
        self.host_released: list[int] = []  # host blocks promoted out of in this pass: free at its end
        self.dropping = False  # clear(): what is evicted is dropped, not demoted

    # ---- imports from a peer (cairn.workers.cache.transfer) -------------------------------------------
    def hold_chain(self, hashes: list[bytes]) -> list[int]:
        """Holds the device pages of `hashes` (a chain's head, all resident) while an import
        takes blocks; `release_chain` gives them back."""
        pages = self.pages.pages_of(hashes)
        self.arena.pages_held(self.pages.acquire_all(pages))
        return pages

    def release_chain(self, pages: list[int]) -> None:
        for page in reversed(pages):
            self.unhold(page)

    def room_for_pages(self, n: int) -> bool:
        """Whether `n` device blocks for pages can be had now, evicting as needed, under the cap."""
        return self.arena.num_free_blocks + self.budget.evictable_blocks >= n and \
            self.under_page_cap(self.pages.num_held + n)

    def take_free_pages(self, n: int) -> list[int]:
        """`n` device blocks for pages, held by the caller (evicting as needed: `room_for_pages`
        first); `release_page` each once it is registered."""
        return self.take_pages(n)

    def adopt_page(self, page: int, page_hash: bytes, parent: bytes | None) -> None:
        """Names a taken page (its K/V imported) by its hash; a host copy is superseded."""
        self.pages.register(page, page_hash, parent)
        if page_hash in self.host.pages:
            self.host.free_blocks([self.host.pop_page(page_hash)])

    def release_page(self, page: int) -> None:
        self.unhold(page)

    def promote(self, seq: Sequence, hashes: tuple[bytes, ...], blocks: list[int]) -> list[int]:
        """Brings host pages `hashes` (the next ones of `seq`'s chain after its device run, taken
        out of the host tier on `blocks`) back to device blocks, held by `seq`; queues their
        copies. The host blocks are freed only when the pass ends (`end_pass`), so no demotion
        queued in this pass lands on them: on CUDA the promotions run on a copy stream of their
        own, after the pass's other copies, and may still be reading them (cairn.workers.execution.runner)."""
        first = len(seq.cache.page_ids)
        parent = seq.cache.page_hashes[first - 1] if first else None
        pages = self.take_pages(len(hashes))
        up, ps = parent, self.page_size
        for j, (page, page_hash, block) in enumerate(zip(pages, hashes, blocks), start=first):
            self.pages.register(page, page_hash, up, tuple(seq.cache_tokens[j * ps:(j + 1) * ps]), seq.hash_root)
            self.copies.append(BlockCopy(PROMOTE, block, page))
            up = page_hash
        self.host_released.extend(blocks)  # free at the pass's end: a promotion may still be reading them
        self.events.put(PagesStored(hashes, parent, DEVICE))
        self.stats.pages_promoted += len(hashes)
        self.stats.bytes_to_device += len(hashes) * self.layout.block_bytes
        return pages

    def end_pass(self, demoted: set[bytes]) -> None:
        """A scheduling pass ended: the checkpoints its admissions pinned are listed again (those
        in `demoted` at the cold end, on the device or on the host: a conversation that resumed
        from a host checkpoint and moved past it leaves it colder than what is still ahead of
        some conversation), the host's pins go and the host blocks promoted out of are freed."""
        for page_hash in self.pinned:
            ckpt = self.checkpoints.get(page_hash)
            if ckpt is not None and not self.budget.has_checkpoint(page_hash):
                self.budget.list_checkpoint(page_hash)
                self.arena.slot_evictable(ckpt.slot, True)
                if page_hash in demoted:
                    self.budget.demote(page_hash)
        self.pinned.clear()
        self.host.unpin_all()
        for page_hash in demoted:
            if page_hash in self.host.checkpoints:
                self.host.demote(CHECKPOINT, page_hash)
        self.host.free_blocks(self.host_released)
        self.host_released = []

    # ---- holding and taking ---------------------------------------------------------------------
    def hold(self, page: int) -> int:
        if self.pages.acquire(page):  # it was cached: no longer evictable (the LRU skips held pages)
            self.arena.page_held(page, True)
        return page

    def _held_hash(self, page_hash: bytes) -> bool:
        page = self.pages.page_of(page_hash)
        return page is not None and self.pages.is_held(page)

    def unhold(self, page: int) -> None:
        state = self.pages.release(page)
        if state != "held":
            self.arena.page_held(page, False)
            if state == "cached":
                self.budget.list_page(self.pages.hash_of(page))
            else:
                self.arena.free_page(page)

    def pin(self, ckpt: Checkpoint) -> None:
        if self.budget.unlist_checkpoint(ckpt.page_hash):
            self.arena.slot_evictable(ckpt.slot, False)
            self.pinned.append(ckpt.page_hash)

    def under_page_cap(self, pages: int) -> bool:
        cap = self.layout.max_pages
        return cap is None or pages <= cap

    def free_for_pages(self, n: int) -> bool:
        """Whether `take_pages(n)` would evict nothing: free blocks and the page cap suffice."""
        cap = self.layout.max_pages
        return self.arena.num_free_blocks >= n and (cap is None or self.pages.num_resident + n <= cap)

    def take_pages(self, n: int) -> list[int]:
        cap = self.layout.max_pages
        while cap is not None and self.pages.num_resident + n > cap:  # only a page eviction helps
            self.evict_page(self.pages.page_of(self.budget.coldest_page()))
        while self.arena.num_free_blocks < n:
            self.evict_coldest()
        out = []
        for _ in range(n):
            page = self.arena.take_page()
            self.pages.take(page)
            out.append(page)
        return out

    def take_slot(self) -> int:
        slot = self.arena.take_slot()
        if slot is None and self.slot_blocks:
            self.empty_a_group()
            slot = self.arena.take_slot()
        if slot is None:
            raise RuntimeError("no state slot could be had; call can_admit or take_checkpoint_slot")
        return slot

    GROUP_CANDIDATES = 8  # unblocked groups weighed when one must be emptied for a state slot

    def empty_a_group(self) -> None:
        """Empties an unblocked group for a state slot. Candidates are the groups of the coldest
        evictable items. When the coldest is a checkpoint, its slot is taken (it is evicted);
        else, of the candidates holding pages, the one holding the fewest. Its pages move to free
        blocks elsewhere (their K/V is copied before the step: `take_block_copies`), so the slot
        costs a copy, not the pages; with no block free, the coldest items go, in LRU order,
        until one is free outside the group or the page itself went. A checkpoint is not lost
        for sitting among cold pages, nor a hot chain for sharing a group with a cold page."""
        arena, candidates = self.arena, []
        for kind, item in self.budget.cold_first():
            group = self.checkpoints.get(item).slot if kind == CHECKPOINT else \
                arena.group_of_page(self.pages.page_of(item))
            if group is not None and not arena.is_blocked(group) and group not in candidates:
                candidates.append(group)
                if len(candidates) == self.GROUP_CANDIDATES:
                    break
        if not candidates:
            return
        if arena.is_slot(candidates[0]):  # the coldest item is a checkpoint: it goes
            self.evict_checkpoint(self.checkpoints.in_slot(candidates[0]).page_hash)
            return
        group = min((g for g in candidates if not arena.is_slot(g)), key=arena.pages_in)
        pages = [b for b in arena.pages_of_group(group) if not arena.is_free(b)]  # all cached: unblocked
        for page in pages:
            dst = arena.take_page(outside=group)
            while dst is None and self.pages.hash_of(page) is not None and self.budget.coldest() is not None:
                self.evict_coldest()  # in LRU order, until a block outside is free or this page went
                if arena.has_empty_group():
                    return  # a checkpoint went (or this group's pages did): its group is the slot
                dst = arena.take_page(outside=group)
            if self.pages.hash_of(page) is None:  # evicted meanwhile, with an ancestor
                if dst is not None:
                    arena.page_held(dst, False)
                    arena.free_page(dst)
                continue
            if dst is None:
                self.evict_page(page)
                continue
            arena.page_held(dst, False)  # a cached page: it blocks nothing
            self.pages.move(page, dst)
            arena.free_page(page)
            self.copies.append(BlockCopy(MOVE, page, dst))

    def take_block_copies(self) -> list[BlockCopy]:
        """(MOVE | COPY | DEMOTE | PROMOTE, from block, to block) queued since the last call, in order:
        the runner makes them before the step that comes with them, before anything else, in
        this order (a block freed by a demotion may be written by a later copy)."""
        copies, self.copies = self.copies, []
        return copies

    # ---- eviction ---------------------------------------------------------------------------
    def clear(self) -> None:
        """Drops everything not held by a running sequence, and the host tier; announces the
        result as a fresh picture (AllCleared, then what remains)."""
        self.dropping = True
        try:
            while self.budget.coldest() is not None:
                self.evict_coldest()
        finally:
            self.dropping = False
        self.host.clear()
        pages, states = self.device_picture()
        self.events.restart([AllCleared(), *(PagesStored((page_hash,), parent) for page_hash, parent in pages),
                             *(StateStored(h) for h in states)])

    def device_picture(self) -> tuple[list[tuple[bytes, bytes | None]], list[bytes]]:
        """What the index knows of the device: (page hash, parent) pairs parents first, the
        sub-page checkpoints' index keys after their floors; the pages with a state (whole-page,
        or a sub-page one's floor) and those keys."""
        subs = [(c.index_key, c.floor) for c in self.checkpoints.sub_pages() if c.index_key is not None]
        return self.pages.registered() + subs, self.checkpoints.state_pages() + [k for k, _ in subs]

    def host_picture(self) -> tuple[list[tuple[bytes, bytes | None]], list[bytes]]:
        """The same for the host tier (a state there whose page also has one on the device, at its
        end or inside the page after it, is the device's, as its events say: `state_event`)."""
        device, host = self.checkpoints, self.host
        subs = [(c.index_key, c.floor) for c in host.checkpoints.values() if c.index_key is not None]
        return host.registered() + subs, [h for h in host.state_pages()
                                          if device.get(h) is None and not device.has_sub_page(h)] + [k for k, _ in subs]

    def evict_coldest(self) -> None:
        kind, item = self.budget.coldest()
        self.evict_checkpoint(item) if kind == CHECKPOINT else self.evict_page(self.pages.page_of(item))

    def evict_checkpoint(self, page_hash: bytes) -> None:
        self.budget.unlist_checkpoint(page_hash)
        blocks = self.host_blocks(self.slot_blocks)
        if blocks is None:
            self.remove_checkpoint(page_hash, listed=True)
            return
        ckpt = self.checkpoints.get(page_hash)
        self.demote_checkpoint(page_hash, blocks, listed=True)
        self.state_event(ckpt.state_page)
        self.sub_event(ckpt, HOST)

    def state_event(self, page_hash: bytes | None) -> None:
        """Tells the index where the state at the end of page `page_hash` now is: on the device
        while a checkpoint there or a sub-page one inside the next page is (the index knows
        states by page: a sub-page one stands for a resume at least at its floor), else on the
        host if that tier has one, else nowhere. None (a state inside the first page, under no
        page): nothing to tell."""
        if page_hash is None:
            return
        if self.checkpoints.get(page_hash) is not None or self.checkpoints.has_sub_page(page_hash):
            self.events.put(StateStored(page_hash))
        elif page_hash in self.host.checkpoints or self.host.has_sub_page(page_hash):
            self.events.put(StateStored(page_hash, HOST))
        else:
            self.events.put(StateRemoved(page_hash))

    def sub_event(self, ckpt: Checkpoint, medium: str | None) -> None:
        """Tells the index a sub-page checkpoint is now in `medium` (None: gone), by its
        `index_key`: a page after its floor, with a state there (the floor's own state is
        `state_event`'s). Nothing for a whole-page one, or one inside the first page."""
        key = ckpt.index_key
        if key is None:
            return
        if medium is None:
            self.events.put(PagesRemoved((key,)))
        else:
            self.events.put(PagesStored((key,), ckpt.floor, medium))
            self.events.put(StateStored(key, medium))

    def evict_page(self, first: int) -> None:
        """Evicts a cached page with its cached descendants, their checkpoints and the sub-page
        ones inside the pages after them: demoted to the host tier when it has room for all of
        them, else dropped (and with them, what the host tier holds under them)."""
        evicted = self.pages.evict(first)  # deepest first
        states = []  # (checkpoint key, listed): whole-page ones and sub-page ones, all on these pages
        for e in evicted:
            self.budget.unlist_page(e.page_hash)
            self.arena.free_page(e.page)
            self.stats.pages_evicted += 1
            states += [(sub.page_hash, self.budget.unlist_checkpoint(sub.page_hash))
                       for sub in self.checkpoints.at_floor(e.page_hash)]
            if self.checkpoints.get(e.page_hash) is not None:  # a pinned one goes all the same
                states.append((e.page_hash, self.budget.unlist_checkpoint(e.page_hash)))
        blocks = self.host_blocks(len(evicted) + len(states) * self.slot_blocks)
        told = [e for e in evicted if not e.partial]  # the index never hears of a partial page
        if blocks is None:
            for key, listed in states:
                self.remove_checkpoint(key, listed)
            if told:
                self.events.put(PagesRemoved(tuple(e.page_hash for e in told)))
            if self.host:
                for e in evicted:
                    self.host.drop_below(e.page_hash)
            return
        for e in evicted:
            block = blocks.pop()
            self.copies.append(BlockCopy(DEMOTE, e.page, block))
            self.host.add_page(e.page_hash, e.parent, block, e.tokens, e.root, e.partial)
        self.stats.pages_demoted += len(evicted)
        self.stats.bytes_to_host += len(evicted) * self.layout.block_bytes
        state_pages, demoted = [], []
        for key, listed in states:
            demoted.append(self.checkpoints.get(key))
            state_pages.append(demoted[-1].state_page)  # on an evicted page: never None
            self.demote_checkpoint(key, [blocks.pop() for _ in range(self.slot_blocks)], listed)
        run: list[bytes] = []  # parents first, one PagesStored per run of a chain
        for e in reversed(told):
            if run and e.parent != run[-1]:
                self.events.put(PagesStored(tuple(run), self.host.pages[run[0]].parent, HOST))
                run = []
            run.append(e.page_hash)
        if run:
            self.events.put(PagesStored(tuple(run), self.host.pages[run[0]].parent, HOST))
        for page_hash in dict.fromkeys(state_pages):
            self.events.put(StateStored(page_hash, HOST))
        for ckpt in demoted:
            self.sub_event(ckpt, HOST)

    def host_blocks(self, n: int) -> list[int] | None:
        """`n` host blocks for a demotion; None: no host tier, no room, or the cache is clearing."""
        return None if self.dropping or not self.host else self.host.take_blocks(n)

    def demote_checkpoint(self, page_hash: bytes, blocks: list[int], listed: bool) -> None:
        ckpt = self.checkpoints.remove(page_hash)
        self.copies.extend(BlockCopy(DEMOTE, b, h) for b, h in zip(self.arena.pages_of_group(ckpt.slot), blocks))
        self.arena.free_slot(ckpt.slot, blocked=not listed)
        self.host.add_checkpoint(ckpt, blocks)
        ckpt.slot = -1  # no device slot: its blocks are the host's
        self.stats.checkpoints_evicted += 1
        self.stats.checkpoints_demoted += 1
        self.stats.bytes_to_host += self.slot_blocks * self.layout.block_bytes

    def host_removed(self, pages: list[bytes], states: list[bytes], subs: list[bytes] = ()) -> None:
        """The host tier let these go (evicted, or dropped with a device page): tell the index.
        `subs`: the index keys of the sub-page checkpoints among them."""
        if pages or subs:
            self.events.put(PagesRemoved(tuple(pages) + tuple(subs)))
        for page_hash in states:
            self.state_event(page_hash)

    def remove_checkpoint(self, page_hash: bytes, listed: bool) -> None:
        ckpt = self.checkpoints.remove(page_hash)
        self.arena.free_slot(ckpt.slot, blocked=not listed)
        self.stats.checkpoints_evicted += 1
        self.state_event(ckpt.state_page)
        self.sub_event(ckpt, None)

