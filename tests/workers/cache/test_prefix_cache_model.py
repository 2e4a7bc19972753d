"""The prefix cache against a brute-force model of what must hit, over thousands of random
operations (admit, compute, checkpoint, hold, finish, evict under tiny arenas). A sequence that
ends inside its last page leaves that page, partial, under a state checkpoint inside it.

No model runs (`tests.support.cache_harness`): a fake device records, for each arena block, what it holds: a page (the token
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

from tests.support.cache_harness import Harness, run_prompt
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.sequence import Sequence


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_memory_to_spare_hits_are_exactly_the_brute_force_ones(seed):
    rng = random.Random(seed)
    harness = Harness(rng, num_pages=5000, ckpt_slots=5000, blocks=25000)
    for _ in range(2000):
        harness.step(unlimited=True)
        harness.check()
    assert harness.hits > 0 and harness.refused == 0
    assert harness.copied > 20 and harness.sub_page > 50, (harness.copied, harness.sub_page)
    assert harness.partial_kept > 20, harness.partial_kept  # finished inside their last page


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_only_with_memory_to_spare_resumes_exactly_at_the_divergence(seed):
    """Without recurrent state, the K/V hit is the resume point: whole pages, then the head of
    the cached page that shares the most of the prompt's next page, copied into its own."""
    harness = Harness(random.Random(seed), num_pages=5000, ckpt_slots=0, blocks=25000, recurrent=False)
    for _ in range(1500):
        harness.step(unlimited=True)
        harness.check()
    assert harness.refused == 0 and harness.copied > 100 and harness.partial_kept > 50, \
        (harness.copied, harness.partial_kept)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("pages, slots, blocks", [(12, 3, 15), (30, 10, 20), (8, 50, 1000)])
def test_under_tiny_arenas_every_hit_is_sound_and_nothing_held_is_touched(seed, pages, slots, blocks):
    rng = random.Random(seed)
    harness = Harness(rng, num_pages=pages, ckpt_slots=slots, blocks=blocks)
    for _ in range(2000):
        harness.step(unlimited=False)
        harness.check()
    assert harness.cache.stats.pages_evicted > 0 and harness.partial_kept > 10
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
    assert harness.partial_kept > 10, harness.partial_kept


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pages, slots, blocks, host", [(12, 3, 15, 10), (30, 10, 20, 40), (8, 50, 1000, 7)])
def test_under_tiny_arenas_and_a_tiny_host_tier_every_hit_is_sound(seed, pages, slots, blocks, host):
    harness = Harness(random.Random(seed), num_pages=pages, ckpt_slots=slots, blocks=blocks, host_blocks=host)
    for _ in range(1200):
        harness.step(unlimited=False)
        harness.check()
    assert harness.cache.host.pages_evicted > 0 and harness.partial_kept > 10
    harness.finish_everything_and_clear()
    assert harness.cache.used_bytes == 0 and harness.cache.host.used_blocks == 0


def test_an_attention_only_cache_resumes_at_the_page_hit_and_always_computes_the_last_token():
    harness = Harness(random.Random(7), num_pages=None, ckpt_slots=0, blocks=500, recurrent=False)
    tokens = [1, 2, 3, 0] * 3  # 12 tokens: 3 whole pages
    for prompt in (tokens, tokens + [2]):
        run_prompt(harness, prompt)
    m = harness.cache.match(Sequence("x", tokens + [2], SamplingParams(max_tokens=1), hash_root=harness.root))
    assert (m.hit_pages, m.resume_token) == (3, 12)
    seq = Sequence("y", tokens, SamplingParams(max_tokens=1), hash_root=harness.root)
    assert harness.cache.match(seq).resume_token == 11  # the last prompt token is always computed


