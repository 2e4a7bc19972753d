"""What leaves first (`cairn.workers.cache.cache_budget`, design rule 7): eviction follows the least
recently used order of what running sequences released, checked against an LRU model over
random prompts; a conversation's old resume point goes cold once it moves on, unless later
prompts part there; asking whether an admission fits changes nothing."""

import random
from collections import OrderedDict

import pytest

from cairn.cache_service.events import PagesRemoved
from cairn.cache_service.hashing import root_hash
from cairn.workers.cache.checkpoint_policy import CheckpointPolicy
from cairn.workers.cache.prefix_cache import PrefixCache
from tests.support.cache_harness import PS, Harness, layout, run_prompt
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.sequence import Sequence


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


def test_a_prompts_end_where_later_prompts_part_stays_warm_on_the_host_tier_too():
    # The same query, its end state demoted to the host tier by other conversations before its
    # tool rounds run. The rounds resume deeper and pass it at their hint: it goes to the host's
    # hot end, so the host evicts the other conversations' ends, demoted after it, before it.
    harness = Harness(random.Random(0), num_pages=None, ckpt_slots=2, blocks=60, host_blocks=12)
    end = frozenset({"tail", "prompt_end"})
    query = [1] * (2 * PS) + [2]
    others = [[n] * (2 * PS) + [2] for n in (30, 31, 32)]
    for tokens in [query] + others:
        run_prompt(harness, tokens, checkpoint_at=(2,), kinds=end)
    round1 = query[:2 * PS] + [4] * (2 * PS) + [2]
    run_prompt(harness, round1, checkpoint_at=(4,), kinds=end, hints=(2 * PS,))
    run_prompt(harness, round1[:4 * PS] + [5] * (2 * PS) + [2], checkpoint_at=(6,), kinds=end, hints=(2 * PS,))
    cache = harness.cache

    def resume(tokens):
        m = cache.match(Sequence("q", tokens[:2 * PS] + [9], SamplingParams(max_tokens=1), hash_root=harness.root))
        return m.state_pages, m.from_host

    assert resume(query) == (2, True) and resume(others[0]) == (2, True)  # both wait on the host
    run_prompt(harness, [6] * (2 * PS) + [1], checkpoint_at=(2,), kinds=end)  # the host evicts one
    assert resume(query) == (2, True) and resume(others[0])[0] == 0


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


@pytest.mark.parametrize("seed", range(4))
def test_eviction_follows_an_lru_model_of_what_sequences_released(seed):
    """Random prompts, many sharing prefixes, one at a time through an attention-only cache capped
    at 12 pages. The model: a page becomes evictable when the sequence holding it ends (a chain is
    released tail first, so its head is the newest), stops being so when a prompt hits it, and is
    just used when a prompt copies the head of it (a partly shared page). A sequence's last page,
    when it ended inside it, is kept too (a partial page), released first.
    Every eviction takes the model's least recently released page, with every cached page under
    it, and nothing else."""
    rng = random.Random(seed)
    cache = PrefixCache(layout(num_pages=12, ckpt_slots=0, blocks=200, recurrent=False), CheckpointPolicy("all"), PS,
                        recurrent=False)
    root = root_hash("model", PS, None)
    lru: OrderedDict[bytes, None] = OrderedDict()  # evictable pages, least recently released first
    parent: dict[bytes, bytes | None] = {}
    whole: set[bytes] = set()  # whole pages ever registered (a partial page is never announced)
    history: list[list[int]] = []
    evictions = 0
    for i in range(400):
        if history and rng.random() < 0.7:
            base = rng.choice(history)
            tokens = base[:rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        else:
            tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 24))]
        history.append(tokens)
        seq = Sequence(f"s{i}", tokens, SamplingParams(max_tokens=1), hash_root=root)
        m = cache.match(seq)
        hits = seq.cache.page_hashes[:m.hit_pages]
        if not cache.can_admit(seq, m, len(tokens) - m.resume_token):
            continue
        copied = cache.pages.hash_of(m.copy_from) if m.copy_from is not None else None  # a partly shared page
        for h in hits + [copied] * (copied is not None):  # held again (the copied one while it is read)
            lru.pop(h, None)
        before = resident(cache)
        cache.admit(seq, m, len(tokens) - m.resume_token)
        gone = before - resident(cache)  # partial pages too: the events never name them
        announced = {h for e in cache.drain_events() if isinstance(e, PagesRemoved) for h in e.hashes}
        assert announced == gone & whole, "every whole page evicted is announced, no partial page"
        while gone:  # one eviction at a time, in LRU order
            top = next(iter(lru))
            assert top in gone, "the least recently released page goes first"
            under = {h for h in lru if any(a == top for a in ancestors(h, parent))}
            assert under <= gone, "with every cached page under it"
            for h in {top} | under:
                del lru[h]
            gone -= {top} | under
            evictions += 1
        if copied is not None:  # read for its head, then released: just used
            lru[copied] = None
        seq.num_computed = len(tokens)
        superseded = cache.stats.partial_pages_superseded
        cache.register_pages(seq)
        chain = seq.cache.page_hashes[:len(tokens) // PS]
        for j, h in enumerate(chain):
            parent[h] = chain[j - 1] if j else None
        whole.update(chain)
        cache.end_pass()
        partials = set(cache.pages.partial_pages())
        cache.release(seq)  # tail first: the chain's head is the most recently released
        for key, floor in set(cache.pages.partial_pages()) - partials:  # its last page, ended inside
            assert len(tokens) % PS and floor == (chain[-1] if chain else None)
            parent[key] = floor
            lru[key] = None
        for h in reversed(chain):
            lru[h] = None
            lru.move_to_end(h)
        if cache.stats.partial_pages_superseded > superseded:  # it stored a page where it copied a
            assert copied is not None and cache.pages.is_partial(copied)  # partial one's head: that one
            lru.move_to_end(copied, last=False)  # goes to the cold end
        cache.drain_events()
        cache.check()
    assert evictions > 20


def resident(cache: PrefixCache) -> set[bytes]:
    return {h for h, _ in cache.pages.registered() + cache.pages.partial_pages()}


def ancestors(page_hash: bytes, parent: dict[bytes, bytes | None]):
    while parent.get(page_hash) is not None:
        page_hash = parent[page_hash]
        yield page_hash
