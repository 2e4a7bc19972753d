"""The hybrid prefix cache: attention pages at every whole page, recurrent-state checkpoints at
chosen page boundaries, one memory budget, and the events that tell the index (rules 2-8).

Lookup (rule 4), for a prompt of n tokens: h = the longest run of resident pages; d = the
deepest checkpoint at or under h pages (and under n - 1 tokens) that the prompt may use; resume
at d pages (a model without recurrent layers resumes at min(h pages, n - 1)). The request then
holds all h hit pages: tokens from its resume point up to h pages are recomputed only to rebuild
the state, and their K/V, already in the shared pages, is not written again.

Budget (rule 7): held and cached pages, pending and stored checkpoints all count against one
byte budget. Eviction takes the least recently used evictable item (a cached page or a stored
checkpoint); a page goes with its cached descendants and every checkpoint on them. A request
that resumed from a checkpoint demotes it to the cold end once it stores a deeper one. Nothing
a running sequence holds is ever evicted; a refused allocation is a result, not an error.

Events (rule 8): every change of what is resident is queued here and drained by the engine.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from cache_service.events import AllCleared, PagesRemoved, PagesStored, StateRemoved, StateStored
from cache_service.hashing import next_page_hash
from workers.checkpoint_policy import CheckpointPolicy
from workers.checkpoint_store import Checkpoint, CheckpointStore
from workers.page_pool import PagePool
from workers.sequence import Sequence


@dataclass
class Match:
    hit_pages: int  # resident page run
    state_pages: int  # depth of the checkpoint resumed from (0: none)
    resume_token: int  # tokens skipped = cached_tokens
    checkpoint: Checkpoint | None


@dataclass
class CacheStats:
    pages_evicted: int = 0
    checkpoints_stored: int = 0
    checkpoints_used: int = 0
    checkpoints_evicted: int = 0
    checkpoints_dropped: int = 0  # refused at commit (duplicate or page gone)
    state_bytes_peak: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)


class PrefixCache:
    def __init__(self, pages: PagePool, checkpoints: CheckpointStore, policy: CheckpointPolicy,
                 page_bytes: int, checkpoint_bytes: int, budget_bytes: int, recurrent: bool):
        self.pages, self.checkpoints, self.policy = pages, checkpoints, policy
        self.page_size = pages.page_size
        self.page_bytes, self.checkpoint_bytes, self.budget_bytes = page_bytes, checkpoint_bytes, budget_bytes
        self.recurrent = recurrent
        self.used_bytes = 0
        # Evictable items, cold end first, each with the tick of its last use: one LRU order
        # across both kinds, kept as two queues so either kind's coldest is found at once.
        self._cold_pages: OrderedDict[int, int] = OrderedDict()
        self._cold_ckpts: OrderedDict[bytes, int] = OrderedDict()
        self._tick = 0
        self._evictable_bytes = 0
        self._pinned: list[bytes] = []
        self._demoted: set[bytes] = set()
        self._events: list = []
        self.stats = CacheStats()

    # ---- hashes ---------------------------------------------------------------------------
    def extend_hashes(self, seq: Sequence, upto_pages: int) -> None:
        hashes, ps = seq.page_hashes, self.page_size
        while len(hashes) < upto_pages:
            j = len(hashes)
            hashes.append(next_page_hash(hashes[-1] if hashes else seq.hash_root, seq.token_ids[j * ps:(j + 1) * ps]))

    # ---- lookup -----------------------------------------------------------------------------
    def match(self, seq: Sequence) -> Match:
        n, ps = seq.num_tokens, self.page_size
        self.extend_hashes(seq, n // ps)
        h = 0
        while h < n // ps and self.pages.page_of(seq.page_hashes[h]) is not None:
            h += 1
        if not self.recurrent:
            return Match(h, h, min(h * ps, n - 1), None)
        for j in range(min(h, (n - 1) // ps), 0, -1):
            ckpt = self.checkpoints.get(seq.page_hashes[j - 1])
            if ckpt is not None and ckpt.usable_by(seq.token_ids, ps):
                return Match(h, j, j * ps, ckpt)
        return Match(h, 0, 0, None)

    def begin(self, seq: Sequence, m: Match) -> None:
        """Holds the hit pages for `seq`, positions it at the resume point and pins the
        checkpoint it restores from until `unpin()`."""
        held = []
        for j in range(m.hit_pages):
            page = self.pages.page_of(seq.page_hashes[j])
            self._unlist_page(page)
            self.pages.acquire(page)
            held.append(page)
        seq.page_ids = held
        seq.shared_pages = seq.registered_pages = m.hit_pages
        seq.register_stopped = False
        seq.num_computed = m.resume_token
        seq.resumed_from = None
        if m.checkpoint is not None:
            self._unlist_ckpt(m.checkpoint.page_hash)
            self._pinned.append(m.checkpoint.page_hash)
            seq.resumed_from = (m.checkpoint.page_hash, m.checkpoint.depth)

    def credit(self, m: Match) -> None:
        """A request was admitted at this match: the checkpoint's kinds earned a hit."""
        if m.checkpoint is not None:
            self.policy.record_hit(m.checkpoint.kinds)
            self.stats.checkpoints_used += 1
            for k in m.checkpoint.kinds:
                self.stats.by_kind.setdefault(k, {"stored": 0}).setdefault("used", 0)
                self.stats.by_kind[k]["used"] += 1

    def unpin(self) -> None:
        """Ends the scheduling pass: pinned checkpoints become evictable again (just used)."""
        for page_hash in self._pinned:
            if self.checkpoints.get(page_hash) is not None and page_hash not in self._cold_ckpts:
                self._list_ckpt(page_hash)
                if page_hash in self._demoted:
                    self._demote(page_hash)
        self._pinned.clear()
        self._demoted.clear()

    # ---- allocation -------------------------------------------------------------------------
    def can_allocate_pages(self, n: int) -> bool:
        if n <= 0:
            return True
        return (self.pages.num_free + len(self._cold_pages) >= n
                and self.budget_bytes - self.used_bytes + self._evictable_bytes >= n * self.page_bytes)

    def allocate_pages(self, n: int) -> list[int]:
        if not self.can_allocate_pages(n):
            raise RuntimeError(f"allocate_pages({n}) refused; call can_allocate_pages first")
        while self.pages.num_free < n:  # short of page ids: only a page eviction helps
            self._evict_page(next(iter(self._cold_pages)))
        while self.used_bytes + n * self.page_bytes > self.budget_bytes:
            self._evict_coldest()
        self.used_bytes += n * self.page_bytes
        return [self.pages.take_free() for _ in range(n)]

    def allocate_checkpoint(self) -> int | None:
        """A pending checkpoint slot, evicting to make room; None when none can be had."""
        if self.checkpoints.num_slots == 0:
            return None
        while self.checkpoints.num_free == 0:  # short of slots: only a checkpoint eviction helps
            if not self._cold_ckpts:
                return None
            self._evict_ckpt(next(iter(self._cold_ckpts)))
        while self.used_bytes + self.checkpoint_bytes > self.budget_bytes:
            if not (self._cold_pages or self._cold_ckpts):
                return None
            self._evict_coldest()
        self.used_bytes += self.checkpoint_bytes
        self._note_state_bytes()
        return self.checkpoints.take()

    def drop_pending(self, slot: int) -> None:
        self.checkpoints.give_back(slot)
        self.used_bytes -= self.checkpoint_bytes

    # ---- registration -----------------------------------------------------------------------
    def register_pages(self, seq: Sequence) -> None:
        """Registers every whole page `seq` has computed (prompt and output), under its hash.

        A page whose hash a concurrent twin registered first (two prompts with one prefix,
        prefilled in the same steps) is swapped for the twin's page, which holds the same K/V;
        ours goes back to the free pool. So a sequence always holds its whole chain."""
        full = seq.num_computed // self.page_size
        if seq.register_stopped or seq.registered_pages >= full:
            return
        self.extend_hashes(seq, full)
        run_start, run = seq.registered_pages, []  # one PagesStored per consecutive run
        for j in range(seq.registered_pages, full):
            page_hash, parent = seq.page_hashes[j], seq.page_hashes[j - 1] if j else None
            twin = self.pages.page_of(page_hash)
            if twin is not None:
                self._flush_run(seq, run_start, run)
                run_start, run = j + 1, []
                self._unlist_page(twin)
                self.pages.acquire(twin)
                if self.pages.release(seq.page_ids[j]) == "free":
                    self.used_bytes -= self.page_bytes
                seq.page_ids[j] = twin
            elif self.pages.register(seq.page_ids[j], page_hash, parent):
                run.append(page_hash)
            else:
                seq.register_stopped = True  # cannot happen while every chain is held whole
                break
            seq.registered_pages = j + 1
        self._flush_run(seq, run_start, run)

    def _flush_run(self, seq: Sequence, start: int, run: list[bytes]) -> None:
        if run:
            self._events.append(PagesStored(tuple(run), seq.page_hashes[start - 1] if start else None))

    def commit_checkpoint(self, seq: Sequence, slot: int, depth: int, kinds: set[str],
                          exact_tail: tuple[int, ...] | None = None) -> bool:
        """Stores the state in pending `slot` as the checkpoint after page `depth` of `seq`."""
        self.extend_hashes(seq, depth)
        page_hash = seq.page_hashes[depth - 1]
        existing = self.checkpoints.get(page_hash)
        if self.pages.page_of(page_hash) is None or existing is not None:
            self.drop_pending(slot)
            self.stats.checkpoints_dropped += 1
            if existing is not None:
                existing.kinds |= kinds
                if page_hash in self._cold_ckpts:
                    self._unlist_ckpt(page_hash)
                    self._list_ckpt(page_hash)
            return False
        self.checkpoints.store(slot, page_hash, depth, kinds, exact_tail)
        self._list_ckpt(page_hash)
        self._events.append(StateStored(page_hash))
        self.stats.checkpoints_stored += 1
        for k in kinds:
            self.stats.by_kind.setdefault(k, {"stored": 0})["stored"] += 1
        if seq.resumed_from is not None and depth > seq.resumed_from[1]:
            old = seq.resumed_from[0]  # the conversation moved on: its old resume point goes cold
            if old in self._cold_ckpts:
                self._demote(old)
            else:
                self._demoted.add(old)  # still pinned by this scheduling pass: demote on unpin
            seq.resumed_from = None
        return True

    def release(self, seq: Sequence) -> None:
        """Returns what `seq` holds: pages tail first (so chains are evicted tail first), its
        pending finish slot."""
        for page in reversed(seq.page_ids):
            state = self.pages.release(page)
            if state == "cached":
                self._list_page(page)
            elif state == "free":
                self.used_bytes -= self.page_bytes
        seq.page_ids = []
        if seq.pending_slot is not None:
            self.drop_pending(seq.pending_slot)
            seq.pending_slot = seq.pending_page = None

    # ---- eviction ---------------------------------------------------------------------------
    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _list_page(self, page: int) -> None:
        self._cold_pages[page] = self._next_tick()
        self._evictable_bytes += self.page_bytes

    def _list_ckpt(self, page_hash: bytes) -> None:
        self._cold_ckpts[page_hash] = self._next_tick()
        self._evictable_bytes += self.checkpoint_bytes

    def _demote(self, page_hash: bytes) -> None:
        self._cold_ckpts[page_hash] = -1  # colder than anything used
        self._cold_ckpts.move_to_end(page_hash, last=False)

    def _unlist_page(self, page: int) -> bool:
        if self._cold_pages.pop(page, None) is None:
            return False
        self._evictable_bytes -= self.page_bytes
        return True

    def _unlist_ckpt(self, page_hash: bytes) -> bool:
        if self._cold_ckpts.pop(page_hash, None) is None:
            return False
        self._evictable_bytes -= self.checkpoint_bytes
        return True

    def _evict_coldest(self) -> None:
        page = next(iter(self._cold_pages.items()), None)
        ckpt = next(iter(self._cold_ckpts.items()), None)
        if ckpt is not None and (page is None or ckpt[1] < page[1]):
            self._evict_ckpt(ckpt[0])
        else:
            self._evict_page(page[0])

    def _evict_ckpt(self, page_hash: bytes) -> None:
        self._unlist_ckpt(page_hash)
        self._remove_checkpoint(page_hash)

    def _evict_page(self, first: int) -> None:
        removed = []
        for page, page_hash in self.pages.evict(first):
            self._unlist_page(page)
            self.used_bytes -= self.page_bytes
            self.stats.pages_evicted += 1
            removed.append(page_hash)
            if self.checkpoints.get(page_hash) is not None:
                self._unlist_ckpt(page_hash)  # a pinned one is not listed; it goes all the same
                self._remove_checkpoint(page_hash)
        self._events.append(PagesRemoved(tuple(removed)))

    def _remove_checkpoint(self, page_hash: bytes) -> None:
        self.checkpoints.remove(page_hash)
        self.used_bytes -= self.checkpoint_bytes
        self.stats.checkpoints_evicted += 1
        self._events.append(StateRemoved(page_hash))

    def remove_checkpoint(self, page_hash: bytes) -> bool:
        """Drops one stored checkpoint (operators and tests); False if absent or pinned."""
        if not self._unlist_ckpt(page_hash):
            return False
        self._remove_checkpoint(page_hash)
        return True

    def clear(self) -> None:
        """Drops everything not held by a running sequence; announces the result as a fresh
        picture (AllCleared, then what remains)."""
        while self._cold_pages or self._cold_ckpts:
            self._evict_coldest()
        self._events.clear()
        self._events.append(AllCleared())
        for page_hash, parent in self.pages.registered():
            self._events.append(PagesStored((page_hash,), parent))
        self._events.extend(StateStored(h) for h in self.checkpoints.hashes())

    # ---- reporting --------------------------------------------------------------------------
    def drain_events(self) -> list:
        events, self._events = self._events, []
        return events

    def snapshot(self) -> tuple[list[tuple[bytes, bytes | None]], list[bytes]]:
        """What is resident now: (page hash, parent) pairs parents first, and checkpoint hashes."""
        return self.pages.registered(), self.checkpoints.hashes()

    @property
    def state_bytes(self) -> int:
        return (self.checkpoints.num_stored + self.checkpoints.num_pending) * self.checkpoint_bytes

    def _note_state_bytes(self) -> None:
        self.stats.state_bytes_peak = max(self.stats.state_bytes_peak, self.state_bytes)

    def check(self) -> None:
        self.pages.check()
        self.checkpoints.check()
        pages_used = self.pages.num_held + self.pages.num_cached
        expect = pages_used * self.page_bytes + self.state_bytes
        if expect != self.used_bytes or self.used_bytes > self.budget_bytes:
            raise AssertionError(f"prefix cache accounting off: used={self.used_bytes} expected={expect} "
                                 f"budget={self.budget_bytes}")
        if len(self._cold_pages) != self.pages.num_cached:
            raise AssertionError(f"evictable pages {len(self._cold_pages)} != cached {self.pages.num_cached}")
        listed = len(self._cold_pages) * self.page_bytes + len(self._cold_ckpts) * self.checkpoint_bytes
        if listed != self._evictable_bytes:
            raise AssertionError(f"evictable bytes {self._evictable_bytes} != listed {listed}")
