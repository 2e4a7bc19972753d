"""The page pool (`cairn.workers.cache.page_pool`): pages by hash with parents and reference counts; a
page is evicted with its cached descendants, so a finished chain goes tail first."""

import random

from tests.support.cache_harness import PS, Harness, run_prompt
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.sequence import Sequence


def test_a_finished_chain_is_evicted_tail_first():
    harness = Harness(random.Random(0), num_pages=4, ckpt_slots=0, blocks=100, recurrent=False)
    chain = [1] * (3 * PS)
    run_prompt(harness, chain)  # 3 cached pages, 1 free
    run_prompt(harness, [2] * (2 * PS))  # needs 2: the free one and the chain's tail
    seq = Sequence("t", chain + [3], SamplingParams(max_tokens=1), hash_root=harness.root)
    assert harness.cache.match(seq).hit_pages == 2  # the head of the chain survived
