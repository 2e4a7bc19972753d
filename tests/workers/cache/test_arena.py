"""The arena (`cairn.workers.cache.arena`) as the cache uses it: pages and state slots share one pool of
blocks in groups; a state slot takes a whole group, and emptying one moves its cached pages
rather than dropping their chains; a group holding a running sequence's pages is never taken."""

import random

from tests.support.cache_harness import PS, SLOT_BLOCKS, Harness, run_prompt
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.sequence import Sequence


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
