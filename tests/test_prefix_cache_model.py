"""The prefix cache against a brute-force model of what must hit, over thousands of random
operations (admit, compute, checkpoint, hold, finish, evict under tiny arenas).

No model runs: a fake device records, for each arena block, what it holds: a page (the token
prefix its K/V belongs to) or a part of a state slot (the prefix the state was computed over),
so a page and a state placed over the same blocks clobber each other as they would on a GPU.
Every hit must be sound (the page or state really holds the prompt's prefix). With memory to
spare, hits must also be complete: exactly the longest prefix and deepest checkpoint a
brute-force search over everything stored finds. Under tiny arenas: nothing a running sequence
holds is touched, a refused admission changes nothing, accounting adds up, and the event stream
replayed into an index equals the cache's contents after every operation.
"""

import random

import pytest

from cache_service.events import EventStream
from cache_service.hashing import root_hash
from cache_service.index import CacheIndex
from workers.cache.arena import ArenaLayout
from workers.cache.checkpoint_policy import CheckpointPolicy
from workers.plan import COPY, DEMOTE, MOVE
from workers.cache.prefix_cache import PrefixCache
from workers.sampling_params import SamplingParams
from workers.sequence import Sequence

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
        self.sub_pages = recurrent and not host_blocks  # sub-page checkpoints too (device-only ones)
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
        if m.copy_from is not None:  # the page copied from holds this prompt's prefix up to the resume point
            kind, prefix = self.device[m.copy_from]
            assert kind == "page" and prefix[:r] == tuple(tokens[:r]) and r > m.hit_pages * PS
        else:
            assert r <= m.hit_pages * PS
        if unlimited:  # completeness
            h = 0
            while h < n // PS and tuple(tokens[:(h + 1) * PS]) in self.stored_pages:
                h += 1
            kv = h * PS
            if h and not cache.host:  # a page after page h - 1 shares the head of this prompt's page h
                kv += max((shared(p[h * PS:], tokens[h * PS:]) for p in self.stored_pages
                           if len(p) == (h + 1) * PS and p[:h * PS] == tuple(tokens[:h * PS])), default=0)
            if cache.recurrent:
                d = max((L for L in range(1, min(kv, n - 1) + 1) if tuple(tokens[:L]) in self.stored_ckpts), default=0)
            else:
                d = min(kv, n - 1) if kv > h * PS else min(h * PS, n - 1)
            assert r == d, (r, d, h, kv)
            hashes, cache_h = seq.cache.page_hashes, 0  # resident on either tier
            while cache_h < n // PS and (cache.pages.page_of(hashes[cache_h]) is not None
                                         or hashes[cache_h] in cache.host.pages):
                cache_h += 1
            assert cache_h == h
            if not cache.host:
                assert m.hit_pages == h
        before = self.lru_picture()
        if not cache.can_admit(seq, m, n - m.resume_token):
            assert self.lru_picture() == before, "asking took something"
            self.refused += 1
            return
        restore = cache.admit(seq, m, n - m.resume_token)
        self.apply_moves()
        self.hits += m.resume_token
        self.copied += m.copy_from is not None
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
        if m.copy_from is not None:  # the copy landed in the request's own page
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
        self.cache.release(seq)

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
        for page_hash, _ in host_pages:  # what the host holds is what was demoted
            assert self.page_content(page_hash)[0] == "page"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_memory_to_spare_hits_are_exactly_the_brute_force_ones(seed):
    rng = random.Random(seed)
    harness = Harness(rng, num_pages=5000, ckpt_slots=5000, blocks=25000)
    for _ in range(2000):
        harness.step(unlimited=True)
        harness.check()
    assert harness.hits > 0 and harness.refused == 0
    assert harness.copied > 20 and harness.sub_page > 50, (harness.copied, harness.sub_page)


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_only_with_memory_to_spare_resumes_exactly_at_the_divergence(seed):
    """Without recurrent state, the K/V hit is the resume point: whole pages, then the head of
    the cached page that shares the most of the prompt's next page, copied into its own."""
    harness = Harness(random.Random(seed), num_pages=5000, ckpt_slots=0, blocks=25000, recurrent=False)
    for _ in range(1500):
        harness.step(unlimited=True)
        harness.check()
    assert harness.refused == 0 and harness.copied > 100, harness.copied


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("pages, slots, blocks", [(12, 3, 15), (30, 10, 20), (8, 50, 1000)])
def test_under_tiny_arenas_every_hit_is_sound_and_nothing_held_is_touched(seed, pages, slots, blocks):
    rng = random.Random(seed)
    harness = Harness(rng, num_pages=pages, ckpt_slots=slots, blocks=blocks)
    for _ in range(2000):
        harness.step(unlimited=False)
        harness.check()
    assert harness.cache.stats.pages_evicted > 0
    harness.finish_everything_and_clear()
    assert harness.cache.pages.num_held == 0 and harness.cache.used_bytes == 0


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("pages, slots, blocks", [(12, 3, 15), (30, 10, 20), (8, 50, 1000)])
def test_with_a_host_tier_to_spare_tiny_arenas_lose_nothing_and_every_hit_is_sound(seed, pages, slots, blocks):
    """What the device evicts goes to the host, so hits are complete across the two tiers."""
    harness = Harness(random.Random(seed), num_pages=pages, ckpt_slots=slots, blocks=blocks, host_blocks=100000)
    for _ in range(700):
        harness.step(unlimited=True)
        harness.check()
    stats = harness.cache.stats
    assert stats.pages_demoted > 0 and stats.pages_promoted > 0 and stats.checkpoints_demoted > 0
    assert stats.checkpoints_from_host > 0 and stats.pages_demoted == stats.pages_evicted


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pages, slots, blocks, host", [(12, 3, 15, 10), (30, 10, 20, 40), (8, 50, 1000, 7)])
def test_under_tiny_arenas_and_a_tiny_host_tier_every_hit_is_sound(seed, pages, slots, blocks, host):
    harness = Harness(random.Random(seed), num_pages=pages, ckpt_slots=slots, blocks=blocks, host_blocks=host)
    for _ in range(1200):
        harness.step(unlimited=False)
        harness.check()
    assert harness.cache.host.pages_evicted > 0
    harness.finish_everything_and_clear()
    assert harness.cache.used_bytes == 0 and harness.cache.host.used_blocks == 0


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
    for j in checkpoint_at:
        cache.commit_checkpoint(seq, cache.take_checkpoint_slot(), j * PS, set(kinds))
        harness.apply_moves()
    cache.end_pass()
    cache.release(seq)
    harness.check()
    return seq


def test_an_attention_only_cache_resumes_at_the_page_hit_and_always_computes_the_last_token():
    harness = Harness(random.Random(7), num_pages=None, ckpt_slots=0, blocks=500, recurrent=False)
    tokens = [1, 2, 3, 0] * 3  # 12 tokens: 3 whole pages
    for prompt in (tokens, tokens + [2]):
        run_prompt(harness, prompt)
    m = harness.cache.match(Sequence("x", tokens + [2], SamplingParams(max_tokens=1), hash_root=harness.root))
    assert (m.hit_pages, m.resume_token) == (3, 12)
    seq = Sequence("y", tokens, SamplingParams(max_tokens=1), hash_root=harness.root)
    assert harness.cache.match(seq).resume_token == 11  # the last prompt token is always computed


def test_a_finished_chain_is_evicted_tail_first():
    harness = Harness(random.Random(0), num_pages=4, ckpt_slots=0, blocks=100, recurrent=False)
    chain = [1] * (3 * PS)
    run_prompt(harness, chain)  # 3 cached pages, 1 free
    run_prompt(harness, [2] * (2 * PS))  # needs 2: the free one and the chain's tail
    seq = Sequence("t", chain + [3], SamplingParams(max_tokens=1), hash_root=harness.root)
    assert harness.cache.match(seq).hit_pages == 2  # the head of the chain survived


def test_a_resume_point_goes_cold_once_its_conversation_stores_a_deeper_checkpoint():
    harness = Harness(random.Random(0), num_pages=100, ckpt_slots=3, blocks=1000)
    turn1 = [1] * (2 * PS) + [2]
    other = [3] * (2 * PS) + [2]
    run_prompt(harness, turn1, checkpoint_at=(2,))
    run_prompt(harness, other, checkpoint_at=(2,))  # older than turn1's? no: newer
    turn2 = turn1 + [4] * (2 * PS)
    run_prompt(harness, turn2, checkpoint_at=(4,))  # resumes from depth 2, stores depth 4
    # Slots are full (3); the next checkpoint evicts the coldest: turn1's old resume point,
    # even though `other`'s was used less recently.
    run_prompt(harness, [5] * (2 * PS) + [1], checkpoint_at=(2,))
    cache = harness.cache
    h1 = Sequence("a", turn1, SamplingParams(max_tokens=1), hash_root=harness.root)
    h2 = Sequence("b", other, SamplingParams(max_tokens=1), hash_root=harness.root)
    assert cache.match(h1).state_pages == 0
    assert cache.match(h2).state_pages == 2


def test_a_prompts_end_where_later_prompts_part_stays_warm_while_its_conversation_goes_on():
    # An agent's query: its first request ends at depth 2; every tool round after it resumes
    # deeper, and the template's hints name depth 2 (the next query parts there, where the
    # rounds' thinking is dropped). The rounds' own ends go cold as the conversation moves on;
    # depth 2 does not, though the rounds pass it, while another conversation's end, unused
    # since, is evicted before it.
    harness = Harness(random.Random(0), num_pages=100, ckpt_slots=4, blocks=1000)
    end = frozenset({"tail", "prompt_end"})
    query = [1] * (2 * PS) + [2]
    run_prompt(harness, query, checkpoint_at=(2,), kinds=end)
    run_prompt(harness, [3] * (2 * PS) + [2], checkpoint_at=(2,), kinds=end)  # another conversation
    round1 = query[:2 * PS] + [4] * (2 * PS) + [2]
    run_prompt(harness, round1, checkpoint_at=(4,), kinds=end, hints=(2 * PS,))  # resumes at depth 2
    round2 = round1[:4 * PS] + [5] * (2 * PS) + [2]
    run_prompt(harness, round2, checkpoint_at=(6,), kinds=end, hints=(2 * PS,))  # at 4, passing 2
    for k in range(2):  # two more checkpoints evict two: round 1's end, then the other conversation's
        run_prompt(harness, [6 + k] * (2 * PS) + [1], checkpoint_at=(2,), kinds=end)
    cache = harness.cache
    next_query = Sequence("q", query[:2 * PS] + [9] * PS, SamplingParams(max_tokens=1), hash_root=harness.root)
    other = Sequence("o", [3] * (2 * PS) + [9], SamplingParams(max_tokens=1), hash_root=harness.root)
    assert cache.match(next_query).state_pages == 2
    assert cache.match(other).state_pages == 0
    assert cache.match(Sequence("r", round1[:4 * PS] + [9], SamplingParams(max_tokens=1),
                                hash_root=harness.root)).state_pages == 2  # round 1's end is gone


def test_a_group_emptied_for_a_state_slot_moves_its_hot_pages_rather_than_dropping_their_chains():
    # One conversation comes back every turn, one page longer, resuming from the checkpoint at
    # its previous end, between one-off prompts that fill a tiny arena. When a group must be
    # emptied for a state slot and no block is free, the coldest item elsewhere goes to make room
    # for that group's pages: a hot page of the conversation is moved, never evicted with the
    # rest of its chain and its checkpoint, so every turn resumes where the last one ended.
    harness = Harness(random.Random(0), num_pages=None, ckpt_slots=None, blocks=8 * SLOT_BLOCKS)
    rng = random.Random(3)
    chat = [1] * PS
    for turn in range(7):  # up to 8 pages, its checkpoint and a one-off's pages and two slots: 19 of 24 blocks
        depth = len(chat) // PS
        chat = chat + [2 + turn % 7] * PS
        if turn:
            m = harness.cache.match(Sequence("m", chat, SamplingParams(max_tokens=1), hash_root=harness.root))
            assert m.state_pages == depth, f"turn {turn}"
        run_prompt(harness, chat, checkpoint_at=(len(chat) // PS,))
        for _ in range(2):
            run_prompt(harness, [rng.randrange(50, 99) for _ in range(2 * PS)], checkpoint_at=(2,))


def test_a_state_slot_never_comes_from_a_group_holding_a_running_sequences_pages():
    harness = Harness(random.Random(0), num_pages=None, ckpt_slots=4, blocks=9)  # groups 0, 1, 2
    cache = harness.cache
    run_prompt(harness, [2] * (2 * PS) + [7])  # leaves two cached pages on blocks 0 and 1 (group 0)
    a = Sequence("a", [1] * PS + [5], SamplingParams(max_tokens=1), hash_root=harness.root)
    m = cache.match(a)
    assert cache.can_admit(a, m, PS + 1)
    cache.admit(a, m, PS + 1)
    cache.end_pass()
    groups = {cache.arena.group_of_page(p) for p in a.cache.page_ids}
    assert a.cache.state_slot == 2 and groups == {0, 1}, "pages from the lowest free blocks, the slot from the top"
    b = Sequence("b", [3] * (PS - 1), SamplingParams(max_tokens=1), hash_root=harness.root)
    mb = cache.match(b)
    assert cache.arena.num_free_blocks + cache.budget.evictable_blocks >= 1 + SLOT_BLOCKS, "bytes would fit..."
    assert not cache.can_admit(b, mb, PS - 1), "...but every group holds a's pages or a's state"
    cache.release(a)
    assert cache.can_admit(b, mb, PS - 1)
    cache.admit(b, mb, PS - 1)
    cache.end_pass()
    harness.check()


def test_an_admission_that_does_not_fit_holds_nothing_and_keeps_the_lru_order():
    harness = Harness(random.Random(0), num_pages=None, ckpt_slots=2, blocks=12)
    for tokens in ([1] * (2 * PS), [2] * (2 * PS)):
        run_prompt(harness, tokens + [5])
    cache = harness.cache
    big = [1] * (2 * PS) + [9] * (8 * PS)  # its two cached hit pages become held: 10 blocks left for 8 + a slot
    seq = Sequence("big", big, SamplingParams(max_tokens=1), hash_root=harness.root)
    m = cache.match(seq)
    before = harness.lru_picture()
    assert m.hit_pages == 2 and not cache.can_admit(seq, m, len(big) - m.resume_token)
    assert harness.lru_picture() == before and seq.cache.page_ids == [] and seq.cache.state_slot is None
