"""The hybrid prefix cache: attention pages at every whole page, recurrent-state checkpoints at
chosen page boundaries, one arena, and the events that tell the index (design rules 2-8).

It owns everything a sequence holds (`Sequence.cache`, a `SequenceCache`): pages, state slot,
hash chain, checkpoint targets and the finish capture. Its protocol, per sequence:
- `match` (rule 4): h = the longest run of resident pages; d = the deepest checkpoint at or
  under h pages (and under n - 1 tokens) the prompt may use; the resume point follows from
  `cache_service.scoring.resume_at_token`. Tokens from there up to h pages are recomputed only
  to rebuild the state; their K/V, already in the shared pages, is not written again.
  With a host tier (`workers.host_tier`), the run goes on over the chain's host pages after
  its device ones, and a checkpoint may be on the host: each usable resume point is priced by
  `workers.tier_cost` (host copies it needs + prefill it leaves) and the cheapest is taken,
  the cold start included. Host pages under it are promoted at admission; a host checkpoint is
  copied straight into the request's state slot (it stays on the host).
- `can_admit` then `admit`: ask before you take. `can_admit` has no side effect: it counts what
  the admission would make unevictable (cached hit pages, the checkpoint it resumes from) and
  answers whether the new pages and a state slot fit. `admit` then holds the hit pages, pins the
  checkpoint until `end_pass`, takes the slot and pages (evicting as needed) and sets targets.
- `can_grow` / `grow`: pages for a running sequence's next tokens.
- Each admitted sequence also holds a row of the runner's page table; every change of a row
  (pages taken, a twin's page swapped in) is queued as a `PageTableWrite` for the next plan
  (`take_page_table_writes`), so the runner keeps its table without rebuilding it each step.
- `take_checkpoint_slot`, `finish_capture`, `commit_checkpoint`, `register_pages` during steps.
- `finish` (stores the finish capture) or `release` (abort, preemption): give everything back,
  pages tail first, so chains are evicted tail first.

Eviction (rule 7, `workers.cache_placement`): the least recently used evictable item
(`workers.cache_budget`) goes first; a page goes with its cached descendants and every
checkpoint on them, to the host tier when there is one with room, else dropped. A state slot
needs a whole arena group (`workers.arena`): when none is empty, the coldest item in an
unblocked group decides which group is emptied (its pages moved, not dropped). A request that
resumed from a checkpoint demotes it once it stores a deeper one, unless the checkpoint is only
where prompts part (a hint, a branch) or lies at one of the request's hints; a prompt passing an
earlier prompt's end at one of its hints keeps it warm (an agent's next query parts there). Nothing a running sequence holds is ever evicted; a refused allocation is a
result, not an error. Events (rule 8): every change of what is resident is queued here and
drained by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_service.events import DEVICE, HOST, AllCleared, PagesStored, StateStored
from cache_service.hashing import branch_root, next_page_hash
from cache_service.scoring import resume_at_token
from workers.arena import Arena, ArenaLayout
from workers.cache_budget import CacheBudget
from workers.cache_placement import COPY, PROMOTE, CachePlacement
from workers.checkpoint_policy import END, END_KINDS, CheckpointPolicy
from workers.checkpoint_store import Checkpoint, CheckpointStore
from workers.host_tier import HostTier
from workers.page_pool import PagePool
from workers.sequence import Sequence
from workers.tier_cost import TierCost


@dataclass
class Match:
    hit_pages: int  # resident page run used: the device run, then the pages promoted after it
    state_pages: int  # depth of the checkpoint resumed from (0: none)
    resume_token: int  # tokens skipped = cached_tokens
    checkpoint: Checkpoint | None
    page_ids: list[int] | None = None  # the device run's pages, once looked up (can_admit, admit)
    promote: tuple[bytes, ...] = ()  # host pages brought back, after the device run
    from_host: bool = False  # the checkpoint is on the host: copied from there into the state
    copy_from: int | None = None  # a cached page whose head (up to resume_token) the request's page
    # hit_pages copies: the resume point is past the page floor (copy-on-write)
    kv_tokens: int = 0  # tokens of the prompt whose K/V the device holds, a partial page's included

    @property
    def device_pages(self) -> int:
        return self.hit_pages - len(self.promote)

    @property
    def tier(self) -> str:
        """Where the resume point came from: the device alone, or the host too."""
        return HOST if self.promote or self.from_host else DEVICE


@dataclass(slots=True)
class PageTableWrite:
    row: int  # the sequence's row of the runner's page table
    start: int  # index (pages) of the first page written
    page_ids: list[int]


@dataclass
class CacheStats:
    pages_evicted: int = 0
    checkpoints_stored: int = 0
    checkpoints_used: int = 0
    checkpoints_evicted: int = 0
    checkpoints_dropped: int = 0  # refused at commit (duplicate or page gone)
    checkpoints_without_slot: int = 0  # wanted, but every arena group was held by running sequences
    checkpoints_to_host: int = 0  # of those, written straight to the host tier instead
    pages_demoted: int = 0  # of the pages evicted from the device, those kept on the host
    checkpoints_demoted: int = 0
    pages_promoted: int = 0  # host pages brought back to the device for a request
    checkpoints_from_host: int = 0  # resumes that copied their checkpoint from the host
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    state_bytes_peak: int = 0  # the most arena bytes checkpoints (pending and stored) held at once
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)


class PrefixCache(CachePlacement):
    def __init__(self, layout: ArenaLayout, policy: CheckpointPolicy, page_size: int, recurrent: bool,
                 max_rows: int = 65, record_events: bool = True):
        """max_rows: sequences that may hold pages at once (page-table rows). record_events:
        queue events from the start (else from the first `forget_events`, when a snapshot
        introduces the cache to whoever drains it)."""
        self.layout, self.policy, self.page_size, self.recurrent = layout, policy, page_size, recurrent
        self.max_rows = max_rows
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._table_writes: list[PageTableWrite] = []
        self._copies: list[tuple[str, int, int]] = []
        self.arena = Arena(layout)
        self.pages = PagePool()
        self.checkpoints = CheckpointStore()
        self.budget = CacheBudget(layout.block_bytes, layout.slot_blocks, is_held=self._held_hash,
                                  cached_pages=lambda: self.pages.num_cached)
        self.slot_blocks = layout.slot_blocks
        self.host = HostTier(layout.host_blocks, layout.slot_blocks, on_removed=self._host_removed)
        self.tier_cost = TierCost()
        self._dropping = False  # clear(): what is evicted is dropped, not demoted
        self._host_pending: dict[int, list[int]] = {}  # pending host checkpoint id (< 0) -> its host blocks
        self._host_released: list[int] = []  # host blocks promoted out of in this pass: free at its end
        self._host_slot_ids = 0
        self._running_slots: set[int] = set()
        self._pinned: list[bytes] = []
        self._demoted: set[bytes] = set()
        self._events: list = []
        self.events_dropped = False
        self.record_events = record_events
        self.stats = CacheStats()

    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- hashes ---------------------------------------------------------------------------
    def adopt_hashes(self, seq: Sequence, page_hashes: list[bytes]) -> None:
        """The hashes of `seq`'s whole prompt pages, computed by the ingress (checked by the
        engine): the chain starts from them instead of being hashed here."""
        seq.cache.page_hashes = list(page_hashes)

    def extend_hashes(self, seq: Sequence, upto_pages: int) -> list[bytes]:
        """`seq`'s chain, extended to at least `upto_pages` hashes."""
        hashes, ps = seq.cache.page_hashes, self.page_size
        while len(hashes) < upto_pages:
            j = len(hashes)
            hashes.append(next_page_hash(hashes[-1] if hashes else seq.hash_root, seq.token_ids[j * ps:(j + 1) * ps]))
        return hashes

    # ---- lookup -----------------------------------------------------------------------------
    def match(self, seq: Sequence) -> Match:
        n, ps = seq.num_tokens, self.page_size
        hashes = self.extend_hashes(seq, n // ps)
        h = self.device_run(hashes, n // ps)
        source, shared = self._partial_page(seq, hashes, h)  # a cached page sharing page h's head
        kv = h * ps + shared  # tokens whose K/V the device holds
        top, host = h, self.host  # the host pages of the chain follow its device run
        if host:
            while top < n // ps and hashes[top] in host.pages:
                top += 1
        if not self.recurrent:
            r = min(kv, n - 1) if shared else resume_at_token(h, h, n, ps, recurrent=False)
            m = Match(h, h, r, None, copy_from=source if r > h * ps else None, kv_tokens=kv)
            if top > h:
                deeper = Match(top, top, resume_at_token(top, top, n, ps, recurrent=False), None,
                               promote=tuple(hashes[h:top]))
                if self._resume_cost(deeper, n) < self._resume_cost(m, n):
                    return deeper
            return m
        best = Match(h, 0, 0, None, kv_tokens=kv)  # cold
        best_cost = self._resume_cost(best, n)
        for j in range(min(top, (n - 1) // ps), 0, -1):
            if j <= h:  # a sub-page checkpoint inside page j: deeper than the boundary's, on the device
                sub = self._sub_page_resume(seq, hashes[j - 1], min(n - 1, kv if j == h else (j + 1) * ps))
                if sub is not None:
                    m = Match(h, j, sub.position(ps), sub,
                              copy_from=source if sub.position(ps) > h * ps else None, kv_tokens=kv)
                    if self._resume_cost(m, n) < best_cost:
                        best = m
                    break
            ckpt, from_host = self.checkpoints.get(hashes[j - 1]), False
            if ckpt is None and host:
                ckpt = host.checkpoints.get(hashes[j - 1])
                from_host = ckpt is not None
            if ckpt is None or not ckpt.usable_by(seq.token_ids, ps):
                continue
            m = Match(max(h, j), j, resume_at_token(max(h, j), j, n, ps, recurrent=True), ckpt,
                      promote=tuple(hashes[h:j]), from_host=from_host, kv_tokens=kv)
            cost = self._resume_cost(m, n)
            if cost < best_cost:
                best, best_cost = m, cost
            if not m.promote and not from_host:
                break  # a device resume point copies nothing: shallower ones only cost more
        return best

    def _partial_page(self, seq: Sequence, hashes: list[bytes], h: int) -> tuple[int | None, int]:
        """(page, m): a cached page after page h - 1 whose first m tokens are the first m of
        `seq`'s page h, m as large as possible ((None, 0): none). Copied into the request's own
        page h, it gives K/V up to the divergence instead of the page floor."""
        ps, n = self.page_size, seq.num_tokens
        if h == 0 or h * ps >= n:
            return None, 0
        return self.pages.partial_match(hashes[h - 1], seq.token_ids[h * ps:min(n, (h + 1) * ps)], seq.hash_root)

    def _sub_page_resume(self, seq: Sequence, floor: bytes, limit: int) -> Checkpoint | None:
        """The deepest sub-page checkpoint on page `floor` that `seq` repeats, at most at `limit`,
        taken under `seq`'s own hash root (after a public prefix, another tenant's is not its)."""
        best, ps = None, self.page_size
        for ckpt in self.checkpoints.at_floor(floor):
            pos = ckpt.position(ps)
            if pos <= limit and ckpt.root == seq.hash_root and (best is None or pos > best.position(ps)) \
                    and ckpt.usable_by(seq.token_ids, ps):
                best = ckpt
        return best

    def device_run(self, hashes: list[bytes], upto: int | None = None) -> int:
        """How many of the first `upto` (default: all) pages of the chain `hashes` are on the
        device. The device pages of a chain are a prefix of it (a page is registered after its
        parent and evicted with its descendants), so the run's end is found by bisection."""
        page_of = self.pages.page_of
        h, hi = 0, len(hashes) if upto is None else upto
        while h < hi:
            mid = (h + hi + 1) // 2
            if page_of(hashes[mid - 1]) is not None:
                h = mid
            else:
                hi = mid - 1
        return h

    def _resume_cost(self, m: Match, num_tokens: int) -> float:
        """Seconds to resume at `m` (`workers.tier_cost`): its host copies and its prefill."""
        copy = len(m.promote) * self.layout.block_bytes + (self.layout.slot_bytes if m.from_host else 0)
        return self.tier_cost.seconds(copy, num_tokens - m.resume_token)

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
        if room < new + self.slot_blocks or not self._pages_under_cap(self.pages.num_held + len(cached_hits) + new):
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
        if m.checkpoint is not None:
            ckpt = m.checkpoint
            if m.from_host:
                self.host.pin(ckpt.page_hash)  # before anything below makes room on the host
            else:
                self._pin(ckpt)
                restore = ckpt.slot
            position = ckpt.position(self.page_size)
            moves_on = self.policy.moves_on(ckpt.kinds, position, seq.hints)  # demoted past a deeper one
            c.resumed_from = (ckpt.page_hash, position) if moves_on else None
            self.policy.record_hit(ckpt.kinds, ckpt.admitted_at)
            self.stats.checkpoints_used += 1
            for k in ckpt.kinds:
                self.stats.by_kind.setdefault(k, {"stored": 0}).setdefault("used", 0)
                self.stats.by_kind[k]["used"] += 1
        taken = [self.host.pop_page(h) for h in m.promote]  # out of reach of what makes room below
        c.state_slot = self._take_slot()
        self._running_slots.add(c.state_slot)
        if m.promote:
            c.page_ids += self._promote(seq, m.promote, taken)
        c.shared_pages = c.registered_pages = m.hit_pages
        if m.from_host:
            blocks = self.host.blocks_of(m.checkpoint.page_hash)
            self._copies.extend((PROMOTE, b, d) for b, d in zip(blocks, self.arena.pages_of_group(c.state_slot)))
            self.stats.checkpoints_from_host += 1
            self.stats.bytes_to_device += self.slot_blocks * self.layout.block_bytes
        c.page_ids += self._take_pages(self._new_pages(m, num_tokens) - len(m.promote))
        if m.copy_from is not None:  # copy-on-write: the cached page's head becomes this one's
            self._copies.append((COPY, m.copy_from, c.page_ids[m.hit_pages]))
            self._unhold(m.copy_from)
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
            if not depth or depth > len(c.page_hashes):
                continue
            floor = c.page_hashes[depth - 1]
            ckpt = self._sub_page_resume(seq, floor, pos) if cut else self.checkpoints.get(floor)
            if ckpt is not None and ckpt.position(ps) == pos and ckpt.kinds & END_KINDS:
                self.budget.touch_checkpoint(ckpt.page_hash)

    def want_checkpoint(self, seq: Sequence, position: int, kind: str) -> None:
        """Asks `seq` to checkpoint after `position` tokens too (a twin waits to resume there)."""
        seq.cache.checkpoint_targets.setdefault(position, set()).add(kind)

    def end_pass(self) -> None:
        """Ends a scheduling pass: checkpoints pinned by admissions become evictable again (just
        used), those their conversation moved on from go to the cold end."""
        for page_hash in self._pinned:
            ckpt = self.checkpoints.get(page_hash)
            if ckpt is not None and not self.budget.has_checkpoint(page_hash):
                self.budget.list_checkpoint(page_hash)
                self.arena.slot_evictable(ckpt.slot, True)
                if page_hash in self._demoted:
                    self.budget.demote(page_hash)
        self._pinned.clear()
        self._demoted.clear()
        self.host.unpin_all()
        self.host.free_blocks(self._host_released)
        self._host_released = []

    # ---- growth -------------------------------------------------------------------------------
    def can_grow(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self.pages_for_tokens(upto_tokens) - len(seq.cache.page_ids)
        return need <= 0 or (self.arena.num_free_blocks + self.budget.evictable_blocks >= need
                             and self._pages_under_cap(self.pages.num_held + need))

    def grow(self, seq: Sequence, upto_tokens: int) -> None:
        """Pages for `seq`'s tokens up to `upto_tokens`; the caller checked `can_grow`."""
        c = seq.cache
        new = self._take_pages(self.pages_for_tokens(upto_tokens) - len(c.page_ids))
        if new:
            self._table_writes.append(PageTableWrite(c.row, len(c.page_ids), new))
            c.page_ids += new

    def take_page_table_writes(self) -> list[PageTableWrite]:
        """The page-table changes since the last call, in order (for the next step's plan)."""
        writes, self._table_writes = self._table_writes, []
        return writes

    # ---- checkpoints during steps -------------------------------------------------------------
    def checkpoint_room(self) -> bool:
        """Whether a checkpoint slot can be had without evicting anything: under the cap, and an
        empty group in the arena (the policy's verdicts bind only when this is False)."""
        if not self.slot_blocks or self.layout.max_checkpoints == 0:
            return False
        return not self._at_checkpoint_cap() and self.arena.has_free_slot()

    def _at_checkpoint_cap(self) -> bool:
        cap = self.layout.max_checkpoints
        return cap is not None and self.checkpoints.num_stored + self.checkpoints.num_pending >= cap

    def take_checkpoint_slot(self) -> int | None:
        """A pending checkpoint slot, evicting to make room; None when none can be had."""
        if not self.slot_blocks or self.layout.max_checkpoints == 0:
            return None
        while self._at_checkpoint_cap():
            coldest = self.budget.coldest_checkpoint()
            if coldest is None:
                return None
            self._evict_checkpoint(coldest)
        if not self.arena.has_empty_group() and not self.arena.num_unblocked:
            self.stats.checkpoints_without_slot += 1
            return None
        slot = self._take_slot()
        self.checkpoints.add_pending(slot)
        self.stats.state_bytes_peak = max(self.stats.state_bytes_peak, self.checkpoint_bytes)
        return slot

    def take_host_checkpoint_slot(self) -> int | None:
        """With a host tier, when no device slot can be had: a pending checkpoint written straight
        to host blocks after the step (`host_blocks_of`), named by a negative id that
        `commit_checkpoint` and `drop_pending` take like a slot. None: no tier, or no room."""
        blocks = self._host_blocks(self.slot_blocks)
        if blocks is None:
            return None
        self._host_slot_ids -= 1
        self._host_pending[self._host_slot_ids] = blocks
        return self._host_slot_ids

    def host_blocks_of(self, slot: int) -> list[int]:
        """The host blocks of a pending host checkpoint (`take_host_checkpoint_slot`)."""
        return self._host_pending[slot]

    def drop_pending(self, slot: int) -> None:
        if slot < 0:
            self.host.free_blocks(self._host_pending.pop(slot))
            return
        self.checkpoints.drop_pending(slot)
        self.arena.free_slot(slot, blocked=True)

    def drop_pending_if_any(self, slot: int) -> None:
        """Gives back `slot` if it is still a pending checkpoint (a commit that failed midway)."""
        if self.checkpoints.is_pending(slot) or slot in self._host_pending:
            self.drop_pending(slot)

    def finish_capture(self, seq: Sequence, page: int, at_end: bool = True) -> int | None:
        """The slot to take `seq`'s state after page `page` into, the last boundary it crossed
        (None: not captured); it is stored as a finish checkpoint when `seq` finishes. With no
        device slot to be had, a host one (negative) when the boundary ends the step's segment
        (`at_end`: the state is copied from the sequence's slot after the step)."""
        c, kind = seq.cache, self.policy.captures_finish
        if kind is None:
            return None
        if c.finish_admitted is None:
            room = self.checkpoint_room()
            wasted = not room and self.policy.reply_rewritten(seq.num_prompt_tokens, seq.hints)
            c.finish_admitted = not wasted and bool(self.policy.admit({kind}, room=room))
        if not c.finish_admitted:
            return None
        if c.finish_slot is None:
            c.finish_slot = self.take_checkpoint_slot()
            if c.finish_slot is None and at_end and self.host:
                c.finish_slot = self.take_host_checkpoint_slot()
        if c.finish_slot is None or (c.finish_slot < 0 and not at_end):
            return None
        c.finish_page = page
        return c.finish_slot

    def commit_checkpoint(self, seq: Sequence, slot: int, position: int, kinds: set[str],
                          exact_tail: tuple[int, ...] | None = None) -> bool:
        """Stores the state in pending `slot` as `seq`'s checkpoint after `position` tokens: at a
        page boundary, keyed by that page; inside a page (a device slot only), a sub-page one on
        the page before it. Refused (False) when its page is gone or it is already stored."""
        depth, cut = divmod(position, self.page_size)
        tail = tuple(seq.token_ids[position - cut:position])
        floor = self.extend_hashes(seq, depth)[depth - 1] if depth else None
        if tail:  # keyed under this sequence's root: a floor may be a public page every tenant shares
            key = next_page_hash(branch_root(floor, seq.hash_root), tail) if floor is not None and slot >= 0 else None
        else:
            key = floor
        existing = self.checkpoints.get(key) if key is not None else None
        if key is None or self.pages.page_of(floor) is None or existing is not None or \
                (slot < 0 and key in self.host.checkpoints):
            self.drop_pending(slot)
            self.stats.checkpoints_dropped += 1
            if existing is not None:
                existing.kinds |= kinds
                self.budget.touch_checkpoint(key)
            return False
        if slot < 0:  # written to the host tier (no device slot could be had)
            self.host.add_checkpoint(Checkpoint(key, -1, depth, set(kinds), exact_tail, admitted_at=self.policy.clock),
                                     self._host_pending.pop(slot))
            self._state_event(key)
            self.stats.checkpoints_stored += 1
            self.stats.checkpoints_to_host += 1
            for k in kinds:
                self.stats.by_kind.setdefault(k, {"stored": 0})["stored"] += 1
        else:
            self.store_checkpoint(slot, key, depth, kinds, exact_tail, tail, floor if tail else None, seq.hash_root)
        resumed = seq.cache.resumed_from
        if resumed is not None and position > resumed[1]:
            old = resumed[0]  # the conversation moved on: its old resume point goes cold
            if self.budget.has_checkpoint(old):
                self.budget.demote(old)
            else:
                self._demoted.add(old)  # still pinned by this scheduling pass: demote at its end
            seq.cache.resumed_from = None
        return True

    def store_checkpoint(self, slot: int, page_hash: bytes, depth: int, kinds: set[str],
                         exact_tail: tuple[int, ...] | None = None, tail: tuple[int, ...] = (),
                         floor: bytes | None = None, root: bytes | None = None) -> None:
        """Pending `slot` (written) becomes the checkpoint keyed `page_hash`: after that page,
        which is on the device and has none yet (a host copy is superseded), or, with `floor`,
        the sub-page one `tail` tokens into the page after `floor`."""
        self.checkpoints.store(slot, page_hash, depth, kinds, exact_tail, tail, floor, self.policy.clock, root)
        if floor is None:
            self.host.drop_checkpoint(page_hash)  # (the state event below moves it in the index)
        self.budget.list_checkpoint(page_hash)
        self.arena.slot_evictable(slot, True)
        self._state_event(page_hash if floor is None else floor)
        self.stats.checkpoints_stored += 1
        for k in kinds:
            self.stats.by_kind.setdefault(k, {"stored": 0})["stored"] += 1

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
                self._hold(twin)
                self._unhold(c.page_ids[j])
                c.page_ids[j] = twin
                self._table_writes.append(PageTableWrite(c.row, j, [twin]))
            elif self.pages.register(c.page_ids[j], page_hash, parent, tuple(seq.token_ids[j * ps:(j + 1) * ps]),
                                     seq.hash_root):
                run.append(page_hash)
                if page_hash in self.host.pages:  # computed again: the device copy supersedes it
                    self.host.free_blocks([self.host.pop_page(page_hash)])
            else:
                c.register_stopped = True  # cannot happen while every chain is held whole
                break
            c.registered_pages = j + 1
        self._flush_run(hashes, run_start, run)

    def _flush_run(self, hashes: list[bytes], start: int, run: list[bytes]) -> None:
        if run:
            self._event(PagesStored(tuple(run), hashes[start - 1] if start else None))

    # ---- ending -------------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> None:
        """`seq` ended normally: its finish capture becomes a checkpoint, then `release`."""
        c = seq.cache
        if c.finish_slot is not None and c.finish_page:
            kind = self.policy.captures_finish
            tail = tuple(seq.token_ids[c.finish_page * self.page_size:]) if kind == END else None
            self.commit_checkpoint(seq, c.finish_slot, c.finish_page * self.page_size, {kind}, exact_tail=tail)
            c.finish_slot = c.finish_page = None
        self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Returns everything `seq` holds: pages tail first, its state slot, its finish capture."""
        c = seq.cache
        for page in reversed(c.page_ids):
            self._unhold(page)
        c.page_ids = []
        if c.row is not None:
            self._free_rows.append(c.row)
            c.row = None
        if c.state_slot is not None:
            self._running_slots.discard(c.state_slot)
            self.arena.free_slot(c.state_slot, blocked=True)
            c.state_slot = None
        if c.finish_slot is not None:
            self.drop_pending(c.finish_slot)
            c.finish_slot = c.finish_page = None

    def remove_checkpoint(self, page_hash: bytes) -> bool:
        """Drops one stored checkpoint (operators and tests); False if absent or pinned."""
        if not self.budget.unlist_checkpoint(page_hash):
            return False
        self._remove_checkpoint(page_hash, listed=True)
        return True

    def clear(self) -> None:
        """Drops everything not held by a running sequence, and the host tier; announces the
        result as a fresh picture (AllCleared, then what remains)."""
        self._dropping = True
        try:
            while self.budget.coldest() is not None:
                self._evict_coldest()
        finally:
            self._dropping = False
        self.host.clear()
        self._events.clear()
        if not self.record_events:
            return
        self._events.append(AllCleared())
        for page_hash, parent in self.pages.registered():
            self._events.append(PagesStored((page_hash,), parent))
        self._events.extend(StateStored(h) for h in self.checkpoints.state_pages())

    # ---- reporting --------------------------------------------------------------------------
    MAX_QUEUED_EVENTS = 65536  # undrained (no index, or a stuck one): dropped, and the next drain resyncs

    def _event(self, event) -> None:
        if not self.record_events:
            return
        if len(self._events) >= self.MAX_QUEUED_EVENTS:
            self._events.clear()
            self.events_dropped = True
        self._events.append(event)

    def drain_events(self) -> list:
        """The events queued since the last drain. If some were dropped meanwhile
        (`events_dropped`), they no longer describe the cache: the caller sends a snapshot."""
        events, self._events = self._events, []
        return events

    def snapshot(self) -> tuple[list[tuple[bytes, bytes | None]], list[bytes]]:
        """What is resident on the device now: (page hash, parent) pairs parents first, and the
        pages with a state (`CheckpointStore.state_pages`)."""
        return self.pages.registered(), self.checkpoints.state_pages()

    def host_snapshot(self) -> tuple[list[tuple[bytes, bytes | None]], list[bytes]]:
        """What the host tier holds now, in the same form (a state there whose page also has a
        sub-page one on the device is the device's, as its events say: `_state_event`)."""
        return self.host.registered(), [h for h in self.host.checkpoints if not self.checkpoints.has_sub_page(h)]

    def forget_events(self) -> None:
        """Drops the queued events: a snapshot sent now supersedes them. Events are queued from
        now on, if they were not already."""
        self._events.clear()
        self.events_dropped = False
        self.record_events = True

    @property
    def num_running_slots(self) -> int:
        """State slots held by admitted sequences."""
        return len(self._running_slots)

    @property
    def used_bytes(self) -> int:
        """Arena bytes in use: held and cached pages, running states, checkpoints."""
        return self.arena.used_bytes

    @property
    def budget_bytes(self) -> int:
        return self.layout.arena_bytes

    @property
    def checkpoint_bytes(self) -> int:
        """Arena bytes of checkpoints, pending and stored."""
        return (self.checkpoints.num_stored + self.checkpoints.num_pending) * self.slot_blocks * self.layout.block_bytes

    def check(self) -> None:
        """Integrity: pools, arena and LRU agree (mini-sglang's idle check)."""
        self.pages.check()
        self.checkpoints.check()
        stored = {h: self.checkpoints.get(h).slot for h in self.checkpoints.hashes()}
        pending = self.checkpoints.slots() - set(stored.values())
        pinned = {slot for h, slot in stored.items() if not self.budget.has_checkpoint(h)}
        if self.slot_blocks:
            self.arena.check(self.pages.held_pages(), self.pages.resident_pages(),
                             self._running_slots | pending | pinned)
        unplaced = [h for h in self.pages.cached_hashes() if not self.budget.has_place(h)]
        if unplaced:
            raise AssertionError(f"{len(unplaced)} cached pages have no place in the LRU")
        if self.budget.num_checkpoints + len(pinned) != self.checkpoints.num_stored:
            raise AssertionError(f"evictable checkpoints {self.budget.num_checkpoints} + pinned {len(pinned)} "
                                 f"!= stored {self.checkpoints.num_stored}")
        self.host.check(lambda h: self.pages.page_of(h) is not None)
        both = set(self.host.checkpoints) & set(self.checkpoints.hashes())
        if both:
            raise AssertionError(f"{len(both)} checkpoints are on the device and the host at once")
