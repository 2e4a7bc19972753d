"""The prefix cache against a brute-force model of what must hit, over thousands of random
operations (admit, compute, checkpoint, hold, finish, evict under tiny budgets).

No model runs: a fake "device" records, for each page and checkpoint slot, the token prefix it
would hold. Every hit must be sound (the page or state really holds the prompt's prefix). With
memory to spare, hits must also be complete: exactly the longest prefix and deepest checkpoint a
brute-force search over everything stored finds. Under tiny budgets: the budget holds, nothing
a running sequence holds is touched, accounting adds up, and the event stream replayed into an
index equals the cache's contents after every operation.
"""

import random

import pytest

from cache_service.hashing import root_hash
from cache_service.index import CacheIndex
from cache_service.events import EventStream
from workers.checkpoint_policy import CheckpointPolicy
from workers.checkpoint_store import CheckpointStore
from workers.page_pool import PagePool
from workers.prefix_cache import PrefixCache
from workers.sampling_params import SamplingParams
from workers.sequence import Sequence

PS = 4
PAGE_BYTES, CKPT_BYTES = 10, 25


class Harness:
    def __init__(self, rng: random.Random, num_pages: int, ckpt_slots: int, budget: int, recurrent: bool = True):
        self.rng = rng
        self.cache = PrefixCache(PagePool(num_pages, PS), CheckpointStore(0, ckpt_slots), CheckpointPolicy("all"),
                                 PAGE_BYTES, CKPT_BYTES, budget, recurrent=recurrent)
        self.root = root_hash("model", PS, None)
        self.page_data: dict[int, tuple] = {}  # page -> the token prefix its K/V belongs to
        self.slot_data: dict[int, tuple] = {}  # checkpoint slot -> the token prefix of its state
        self.stored_pages: set[tuple] = set()  # brute force: every prefix ever registered
        self.stored_ckpts: set[tuple] = set()
        self.history: list[list[int]] = []
        self.running: list[Sequence] = []  # computed, holding their pages
        self.computing: list[Sequence] = []  # admitted, not yet computed
        self.index = CacheIndex()
        self.stream = EventStream("w")
        self.index.apply(self.stream.snapshot([], []))
        self.hits = 0

    def new_prompt(self) -> list[int]:
        rng = self.rng
        if self.history and rng.random() < 0.8:
            base = rng.choice(self.history)
            keep = rng.randint(0, len(base))
            return base[:keep] + [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        return [rng.randint(0, 3) for _ in range(rng.randint(1, 20))]

    def admit(self, unlimited: bool) -> None:
        tokens = self.new_prompt()
        self.history.append(tokens)
        seq = Sequence(f"r{len(self.history)}", tokens, SamplingParams(max_tokens=1), hash_root=self.root)
        m = self.cache.match(seq)
        n = len(tokens)
        # Soundness: every hit page and the checkpoint hold exactly this prompt's prefix.
        for j in range(m.hit_pages):
            assert self.page_data[self.cache.pages.page_of(seq.page_hashes[j])] == tuple(tokens[:(j + 1) * PS])
        if m.checkpoint is not None:
            assert self.slot_data[m.checkpoint.slot] == tuple(tokens[:m.state_pages * PS])
            assert m.state_pages <= m.hit_pages and m.state_pages * PS <= n - 1
        assert m.resume_token == m.state_pages * PS
        if unlimited:  # completeness
            h = 0
            while h < n // PS and tuple(tokens[:(h + 1) * PS]) in self.stored_pages:
                h += 1
            d = max((j for j in range(1, min(h, (n - 1) // PS) + 1) if tuple(tokens[:j * PS]) in self.stored_ckpts),
                    default=0)
            assert (m.hit_pages, m.state_pages) == (h, d)
        self.cache.begin(seq, m)
        need = self.cache.pages.pages_for_tokens(n) - len(seq.page_ids)
        if not self.cache.can_allocate_pages(need):
            self.cache.release(seq)
            self.cache.unpin()
            return
        self.cache.credit(m)
        self.hits += m.resume_token
        n_held = len(seq.page_ids)
        seq.page_ids += self.cache.allocate_pages(need)
        for p in seq.page_ids[n_held:]:
            assert all(p not in r.page_ids for r in self.running + self.computing), "a held page was handed out again"
        seq.resume_pages = m.state_pages  # type: ignore[attr-defined]
        self.cache.unpin()
        self.computing.append(seq)
        if self.rng.random() < 0.5:  # else it computes later: concurrent twins happen
            self.compute(len(self.computing) - 1)

    def compute(self, i: int) -> None:
        """"Computes" a prompt: pages past the shared ones get its prefixes; checkpoints on the way."""
        seq = self.computing.pop(i)
        tokens, n = seq.token_ids, seq.num_tokens
        for j in range(seq.shared_pages, len(seq.page_ids)):
            self.page_data[seq.page_ids[j]] = tuple(tokens[:(j + 1) * PS])
        seq.num_computed = n
        self.cache.register_pages(seq)
        for j in range(n // PS):  # every whole page computed must be findable (twins included)
            self.stored_pages.add(tuple(tokens[:(j + 1) * PS]))
        for j in range(seq.resume_pages + 1, n // PS + 1):
            if self.rng.random() < 0.5:
                slot = self.cache.allocate_checkpoint()
                if slot is not None:
                    self.slot_data[slot] = tuple(tokens[:j * PS])
                    if self.cache.commit_checkpoint(seq, slot, j, {"every"}):
                        self.stored_ckpts.add(tuple(tokens[:j * PS]))
        self.cache.unpin()
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
        for j, p in enumerate(seq.page_ids):  # nothing it held was touched
            assert self.page_data[p] == tuple(seq.token_ids[:(j + 1) * PS])[:len(self.page_data[p])]
        self.cache.release(seq)

    def check(self) -> None:
        cache = self.cache
        cache.check()
        assert cache.used_bytes <= cache.budget_bytes
        events = cache.drain_events()
        if events:
            assert self.index.apply(self.stream.batch(events).encode())
        pages, states = cache.snapshot()
        assert self.index.contents("w") == (frozenset(h for h, _ in pages), frozenset(states))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_memory_to_spare_hits_are_exactly_the_brute_force_ones(seed):
    rng = random.Random(seed)
    harness = Harness(rng, num_pages=5000, ckpt_slots=5000, budget=10**9)
    for _ in range(2000):
        harness.step(unlimited=True)
        harness.check()
    assert harness.hits > 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("pages, slots, budget", [(12, 3, 150), (30, 10, 200), (8, 50, 10**6)])
def test_under_tiny_budgets_every_hit_is_sound_and_the_budget_holds(seed, pages, slots, budget):
    rng = random.Random(seed)
    harness = Harness(rng, num_pages=pages, ckpt_slots=slots, budget=budget)
    for _ in range(2000):
        harness.step(unlimited=False)
        harness.check()
    assert harness.cache.stats.pages_evicted > 0
    while harness.computing:
        harness.compute(0)
    while harness.running:
        harness.finish_one()
    harness.cache.clear()
    harness.check()
    assert harness.cache.pages.num_held == 0 and harness.cache.used_bytes == 0


def test_an_attention_only_cache_resumes_at_the_page_hit_and_always_computes_the_last_token():
    rng = random.Random(7)
    harness = Harness(rng, num_pages=500, ckpt_slots=0, budget=10**6, recurrent=False)
    tokens = [1, 2, 3, 0] * 3  # 12 tokens: 3 whole pages
    for prompt in (tokens, tokens, tokens + [2]):
        seq = Sequence("x", prompt, SamplingParams(max_tokens=1), hash_root=harness.root)
        m = harness.cache.match(seq)
        harness.cache.begin(seq, m)
        seq.page_ids += harness.cache.allocate_pages(harness.cache.pages.pages_for_tokens(len(prompt)) - len(seq.page_ids))
        seq.num_computed = len(prompt)
        harness.cache.register_pages(seq)
        harness.cache.release(seq)
        harness.check()
    assert (m.hit_pages, m.resume_token) == (3, 12)
    seq = Sequence("y", tokens, SamplingParams(max_tokens=1), hash_root=harness.root)
    assert harness.cache.match(seq).resume_token == 11  # the last prompt token is always computed


def run_prompt(harness: Harness, tokens: list[int], checkpoint_at: tuple[int, ...] = ()) -> Sequence:
    """Admits, computes and finishes one prompt; stores checkpoints at the given page depths."""
    cache = harness.cache
    seq = Sequence("s", tokens, SamplingParams(max_tokens=1), hash_root=harness.root)
    m = cache.match(seq)
    cache.begin(seq, m)
    cache.credit(m)
    seq.page_ids += cache.allocate_pages(cache.pages.pages_for_tokens(len(tokens)) - len(seq.page_ids))
    seq.num_computed = len(tokens)
    cache.register_pages(seq)
    for j in checkpoint_at:
        cache.commit_checkpoint(seq, cache.allocate_checkpoint(), j, {"every"})
    cache.unpin()
    cache.release(seq)
    harness.check()
    return seq


def test_a_finished_chain_is_evicted_tail_first():
    harness = Harness(random.Random(0), num_pages=4, ckpt_slots=0, budget=10**6, recurrent=False)
    chain = [1] * (3 * PS)
    run_prompt(harness, chain)  # 3 cached pages, 1 free
    run_prompt(harness, [2] * (2 * PS))  # needs 2: the free one and the chain's tail
    seq = Sequence("t", chain + [3], SamplingParams(max_tokens=1), hash_root=harness.root)
    assert harness.cache.match(seq).hit_pages == 2  # the head of the chain survived


def test_a_resume_point_goes_cold_once_its_conversation_stores_a_deeper_checkpoint():
    harness = Harness(random.Random(0), num_pages=100, ckpt_slots=3, budget=10**6)
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
