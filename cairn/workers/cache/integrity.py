"""The prefix cache's integrity check, for idle moments and tests (mini-sglang's idle check):
its parts agree with one another. `check(cache)` raises `AssertionError` saying what is off:
- the page pool and the checkpoint store are each consistent;
- the arena's blocks are exactly the held and resident pages, the running state slots, the
  pending checkpoint slots and the pinned ones;
- every cached page has a place in the LRU, and every stored checkpoint is listed there or
  pinned by the pass;
- the host tier is consistent with the device (a host page's parent chain), and no checkpoint
  is on both tiers at once.
"""

from __future__ import annotations

from typing import Any


def check(cache: Any) -> None:
    """`cache`: a `cairn.workers.cache.prefix_cache.PrefixCache`."""
    pages, checkpoints, budget = cache.pages, cache.checkpoints, cache.budget
    pages.check()
    checkpoints.check()
    stored = {h: checkpoints.get(h).slot for h in checkpoints.hashes()}
    pending = checkpoints.slots() - set(stored.values())
    pinned = {slot for h, slot in stored.items() if not budget.has_checkpoint(h)}
    if cache.slot_blocks:
        cache.arena.check(pages.held_pages(), pages.resident_pages(), cache.running_slots | pending | pinned)
    unplaced = [h for h in pages.cached_hashes() if not budget.has_place(h)]
    if unplaced:
        raise AssertionError(f"{len(unplaced)} cached pages have no place in the LRU")
    if budget.num_checkpoints + len(pinned) != checkpoints.num_stored:
        raise AssertionError(f"evictable checkpoints {budget.num_checkpoints} + pinned {len(pinned)} "
                             f"!= stored {checkpoints.num_stored}")
    cache.host.check(lambda h: pages.page_of(h) is not None)
    both = set(cache.host.checkpoints) & set(checkpoints.hashes())
    if both:
        raise AssertionError(f"{len(both)} checkpoints are on the device and the host at once")
