"""The prefix cache driven without a model, for the cache's tests: a fake device records what each
arena block holds (a page: the token prefix its K/V belongs to; a part of a state slot: the
prefix the state was computed over), so a page and a state placed over the same blocks clobber
each other as they would on a GPU. `Harness` runs random operations against a brute-force model
of what must hit (`tests/workers/cache/test_prefix_cache_model.py`); `run_prompt` admits,
computes and finishes one prompt."""

from __future__ import annotations

import random

from cairn.cache_service.events import EventStream
from cairn.cache_service.hashing import root_hash
from cairn.cache_service.index import CacheIndex
from cairn.workers.cache.arena import ArenaLayout
from cairn.workers.cache.checkpoint_policy import CheckpointPolicy
from cairn.workers.cache.prefix_cache import PrefixCache
from cairn.workers.plan import COPY, DEMOTE, MOVE
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.sequence import Sequence

PS = 4
BLOCK_BYTES, SLOT_BLOCKS = 10, 3  # a state slot spans three page-sized blocks


def layout(num_pages: int | None, ckpt_slots: int, blocks: int, recurrent: bool = True,
           host_blocks: int = 0) -> ArenaLayout:
    return ArenaLayout(block_bytes=BLOCK_BYTES, slot_bytes=25 if recurrent else 0,
                       slot_blocks=SLOT_BLOCKS if recurrent else 0, num_blocks=blocks, max_pages=num_pages,
                       max_checkpoints=ckpt_slots if recurrent else 0, virtual_slots=0 if recurrent else 8,
                       host_blocks=host_blocks)


def shared(a: tuple, b: list[int]) -> int:
    """Leading tokens `a` and `b` share."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


class Harness:
    def __init__(self, rng: random.Random, num_pages: int | None, ckpt_slots: int, blocks: int,
                 recurrent: bool = True, host_blocks: int = 0):
        self.rng = rng
        self.sub_pages = recurrent  # sub-page checkpoints too
        self.cache = PrefixCache(layout(num_pages, ckpt_slots, blocks, recurrent, host_blocks),
                                 CheckpointPolicy("all"), PS, recurrent=recurrent)
        self.root = root_hash("model", PS, None)
        self.device: dict[int, tuple] = {}  # block -> ("page" | "state", token prefix)
        self.host: dict[int, tuple] = {}  # host tier block -> the same
        self.stored_pages: set[tuple] = set()  # brute force: every prefix ever registered
        self.stored_ckpts: set[tuple] = set()
        self.history: list[list[int]] = []
        self.running: list[Sequence] = []  # computed, holding their pages
        self.computing: list[Sequence] = []  # admitted, not yet computed
        self.index = CacheIndex()
        self.stream = EventStream("w")
        self.index.apply(self.stream.snapshot([], []))
        self.hits = 0
        self.refused = 0
        self.copied = 0  # admissions that resumed past the page floor by copying a cached page's head
        self.sub_page = 0  # of those (recurrent), resumed from a sub-page checkpoint
        self.partial_kept = 0  # finished sequences whose last page, ended inside, was kept

    # ---- the fake device -------------------------------------------------------------------------
    def slot_blocks(self, slot: int) -> range:
        return range(slot * SLOT_BLOCKS, (slot + 1) * SLOT_BLOCKS) if self.cache.recurrent else range(0)

    def write_page(self, page: int, prefix: tuple) -> None:
        self.device[page] = ("page", prefix)

    def write_state(self, slot: int, prefix: tuple) -> None:
        for b in self.slot_blocks(slot):
            self.device[b] = ("state", prefix)

    def apply_moves(self) -> None:
        """The runner's part before a step: the cache's block copies, in order (pages moved to
        other blocks; pages and states demoted to the host or brought back)."""
        for kind, src, dst in self.cache.take_block_copies():
            if kind in (MOVE, COPY):
                assert self.device[src][0] == "page", "only a page moves or is copied"
                self.device[dst] = self.device[src]
            elif kind == DEMOTE:
                self.host[dst] = self.device[src]
            else:
                self.device[dst] = self.host[src]

    def page_content(self, page_hash: bytes) -> tuple | None:
        page = self.cache.pages.page_of(page_hash)
        if page is not None:
            return self.device.get(page)
        return self.host.get(self.cache.host.pages[page_hash].block)

    def checkpoint_holds(self, m, prefix: tuple) -> bool:
        if m.from_host:
            return all(self.host.get(b) == ("state", prefix) for b in self.cache.host.blocks_of(m.checkpoint.page_hash))
        return self.holds_state(m.checkpoint.slot, prefix)

    def holds_state(self, slot: int, prefix: tuple) -> bool:
        return all(self.device.get(b) == ("state", prefix) for b in self.slot_blocks(slot))

    # ---- operations ------------------------------------------------------------------------------
    def new_prompt(self) -> list[int]:
        rng = self.rng
        if self.history and rng.random() < 0.8:
            base = rng.choice(self.history)
            keep = rng.randint(0, len(base))
            return base[:keep] + [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        return [rng.randint(0, 3) for _ in range(rng.randint(1, 20))]

    def resident(self) -> tuple[set[tuple], set[tuple]]:
        """(the token prefixes of the pages resident on either tier, of the states checkpointed
        on either tier), read from the fake device and host."""
        cache = self.cache
        pages = {self.device[cache.pages.page_of(h)][1] for h, _ in cache.pages.registered() + cache.pages.partial_pages()} | \
            {self.host[page.block][1] for page in cache.host.pages.values()}
        states = {self.device[next(iter(self.slot_blocks(cache.checkpoints.get(h).slot)))][1]
                  for h in cache.checkpoints.hashes()} | \
            {self.host[cache.host.blocks_of(h)[0]][1] for h in cache.host.checkpoints}
        return pages, states

    @staticmethod
    def run_of(tokens: list[int], pages: set[tuple]) -> int:
        h = 0
        while h < len(tokens) // PS and tuple(tokens[:(h + 1) * PS]) in pages:
            h += 1
        return h

    def best_resume(self, tokens: list[int], pages: set[tuple], states: set[tuple]) -> int:
        """The deepest resume point `pages` and `states` serve `tokens`: whole pages, then the
        head of a page after them that shares the prompt's next page; a state under n - 1 tokens
        within that K/V (recurrent), or the K/V alone."""
        n, h = len(tokens), self.run_of(tokens, pages)
        kv = h * PS
        if h * PS < n:  # a page after page h - 1 (h = 0: a first page), whole or a sequence's last page
            kv += max((shared(p[h * PS:], tokens[h * PS:]) for p in pages  # kept partial, shares its head
                       if h * PS < len(p) <= (h + 1) * PS and p[:h * PS] == tuple(tokens[:h * PS])), default=0)
        if self.cache.recurrent:
            return max((L for L in range(1, min(kv, n - 1) + 1) if tuple(tokens[:L]) in states), default=0)
        return min(kv, n - 1) if kv > h * PS else min(h * PS, n - 1)

    def deepest_resume(self, tokens: list[int]) -> int:
        return self.best_resume(tokens, *self.resident())

    def deepest_ever(self, tokens: list[int]) -> int:
        return self.best_resume(tokens, self.stored_pages, self.stored_ckpts)

    def lru_picture(self) -> tuple:
        budget = self.cache.budget
        return tuple(budget.cold_first()), self.cache.arena.num_free_blocks, self.cache.pages.num_held

    def admit(self, unlimited: bool) -> None:
        cache = self.cache
        tokens = self.new_prompt()
        self.history.append(tokens)
        seq = Sequence(f"r{len(self.history)}", tokens, SamplingParams(max_tokens=1), hash_root=self.root)
        m = cache.match(seq)
        n = len(tokens)
        # Soundness: every hit page and the checkpoint hold exactly this prompt's prefix.
        for j in range(m.hit_pages):
            assert self.page_content(seq.cache.page_hashes[j]) == ("page", tuple(tokens[:(j + 1) * PS]))
        r = m.resume_token
        if m.checkpoint is not None:
            assert self.checkpoint_holds(m, tuple(tokens[:r]))
            assert m.state_pages <= m.hit_pages and m.state_pages * PS <= r <= n - 1
        elif cache.recurrent:
            assert r == 0
        assert m.copy_from is None or m.copy_from_host is None
        if m.copy_from is not None or m.copy_from_host is not None:  # the page copied from holds this
            kind, prefix = self.device[m.copy_from] if m.copy_from is not None else \
                self.host[cache.host.pages[m.copy_from_host].block]  # prompt's prefix up to the resume point
            assert kind == "page" and prefix[:r] == tuple(tokens[:r]) and r > m.hit_pages * PS
        else:
            assert r <= m.hit_pages * PS
        # Completeness: the deepest resume point some tier could serve now (copies cost nothing
        # before the rates are measured), found by brute force over what the fake device and host
        # hold under the names the cache gives them.
        assert r == self.deepest_resume(tokens), (r, self.deepest_resume(tokens))
        if unlimited:  # and with memory to spare (on the device, or on the host), nothing was lost
            assert r == self.deepest_ever(tokens), (r, self.deepest_ever(tokens))
            if not cache.host:
                assert m.hit_pages == self.run_of(tokens, self.stored_pages)
        before = self.lru_picture()
        if not cache.can_admit(seq, m, n - m.resume_token):
            assert self.lru_picture() == before, "asking took something"
            self.refused += 1
            return
        restore = cache.admit(seq, m, n - m.resume_token)
        self.apply_moves()
        self.hits += m.resume_token
        self.copied += m.copy_from is not None or m.copy_from_host is not None
        self.sub_page += m.checkpoint is not None and bool(m.checkpoint.tail)
        held = {p for r in self.running + self.computing for p in r.cache.page_ids}
        assert not set(seq.cache.page_ids[m.hit_pages:]) & held, "a held page was handed out again"
        slots = {r.cache.state_slot for r in self.running + self.computing}
        assert seq.cache.state_slot not in slots, "a running state slot was handed out again"
        if restore is not None:
            self.write_state(seq.cache.state_slot, tuple(tokens[:r]))
        if m.from_host:  # copied from the host by the block copies
            assert self.holds_state(seq.cache.state_slot, tuple(tokens[:r]))
        for j in range(m.hit_pages):  # the promoted pages landed
            assert self.device[seq.cache.page_ids[j]] == ("page", tuple(tokens[:(j + 1) * PS]))
        if m.copy_from is not None or m.copy_from_host is not None:  # the copy landed in the request's own page
            assert self.device[seq.cache.page_ids[m.hit_pages]][1][:r] == tuple(tokens[:r])
        seq.resume_at = r  # type: ignore[attr-defined]
        cache.end_pass()
        self.computing.append(seq)
        if self.rng.random() < 0.5:  # else it computes later: concurrent twins happen
            self.compute(len(self.computing) - 1)

    def compute(self, i: int) -> None:
        """"Computes" a prompt: pages past the shared ones get its prefixes; checkpoints on the way."""
        cache = self.cache
        seq = self.computing.pop(i)
        tokens, n = seq.token_ids, seq.num_tokens
        for j in range(seq.cache.shared_pages, len(seq.cache.page_ids)):
            self.write_page(seq.cache.page_ids[j], tuple(tokens[:(j + 1) * PS]))
        self.write_state(seq.cache.state_slot, tuple(tokens))
        seq.num_computed = n
        cache.register_pages(seq)
        for j in range(n // PS):  # every whole page computed must be findable (twins included)
            self.stored_pages.add(tuple(tokens[:(j + 1) * PS]))
        for pos in range(seq.resume_at + 1, n + 1):
            if self.rng.random() < (0.5 if pos % PS == 0 else 0.15 if self.sub_pages else 0):
                slot = cache.take_checkpoint_slot()
                self.apply_moves()
                if slot is not None:
                    self.write_state(slot, tuple(tokens[:pos]))
                    if cache.commit_checkpoint(seq, slot, pos, {"every"}):
                        self.stored_ckpts.add(tuple(tokens[:pos]))
        cache.end_pass()
        self.running.append(seq)

    def step(self, unlimited: bool) -> None:
        rng = self.rng
        if self.computing and rng.random() < 0.4:
            self.compute(rng.randrange(len(self.computing)))
        elif self.running and (len(self.running) > 3 or rng.random() < 0.5):
            self.finish_one()
        elif len(self.computing) < 3:
            self.admit(unlimited)

    def finish_one(self) -> None:
        seq = self.running.pop(self.rng.randrange(len(self.running)))
        for j, p in enumerate(seq.cache.page_ids):  # nothing it held was touched
            assert self.device[p] == ("page", tuple(seq.token_ids[:(j + 1) * PS]))
        assert self.holds_state(seq.cache.state_slot, tuple(seq.token_ids))
        kept = self.cache.stats.partial_pages_kept
        self.cache.release(seq)
        self.partial_kept += self.cache.stats.partial_pages_kept - kept
        tokens, n = seq.token_ids, seq.num_tokens
        if n % PS and (not self.cache.recurrent or  # its last page, ended inside: kept under a state there
                       any(tuple(tokens[:L]) in self.stored_ckpts for L in range(n // PS * PS + 1, n + 1))):
            self.stored_pages.add(tuple(tokens))

    def finish_everything_and_clear(self) -> None:
        while self.computing:
            self.compute(0)
        while self.running:
            self.finish_one()
        self.cache.clear()
        self.check()

    def check(self) -> None:
        cache = self.cache
        cache.check()
        assert cache.used_bytes <= cache.budget_bytes
        events = cache.drain_events()
        if events:
            assert self.index.apply(self.stream.batch(events).encode())
        pages, states = cache.snapshot()
        host_pages, host_states = cache.host_snapshot()
        assert self.index.contents("w") == (frozenset(h for h, _ in pages + host_pages),
                                            frozenset(states + host_states))
        for page_hash, _ in cache.host.registered():  # what the host holds is what was demoted
            assert self.page_content(page_hash)[0] == "page"


def run_prompt(harness: Harness, tokens: list[int], checkpoint_at: tuple[int, ...] = (),
               kinds: frozenset[str] = frozenset({"every"}), hints: tuple[int, ...] = ()) -> Sequence:
    """Admits, computes and finishes one prompt (with the ingress's `hints`); stores checkpoints
    of `kinds` at the given page depths."""
    cache = harness.cache
    seq = Sequence("s", tokens, SamplingParams(max_tokens=1), hash_root=harness.root, hints=hints)
    m = cache.match(seq)
    assert cache.can_admit(seq, m, len(tokens) - m.resume_token)
    cache.admit(seq, m, len(tokens) - m.resume_token)
    harness.apply_moves()
    seq.num_computed = len(tokens)
    for j, page in enumerate(seq.cache.page_ids[:len(tokens) // PS]):  # the fake device, for moves
        harness.write_page(page, tuple(tokens[:(j + 1) * PS]))
    cache.register_pages(seq)
    harness.write_state(seq.cache.state_slot, tuple(tokens))
    for j in checkpoint_at:
        slot = cache.take_checkpoint_slot()
        harness.apply_moves()  # what made room for the slot went first (to the host, with a host tier)
        harness.write_state(slot, tuple(tokens[:j * PS]))
        cache.commit_checkpoint(seq, slot, j * PS, set(kinds))
    cache.end_pass()
    cache.release(seq)
    harness.check()
    return seq
