"""The prefix cache's wing: what a replica keeps between requests, and where.

`PrefixCache` (`prefix_cache.py`) is the one object the engine and the scheduler talk to;
every other file here is one of its parts, owned by it as a component (no base classes). The
files, each owning one thing, in the one-way order they import each other (a file imports only
those above it). Of the rest of the engine it uses only what lies below it: the model's config
and the options (to size the arena), the step plan's types (`cairn.workers.plan`, `cairn.workers.slot`) and
the sequence with what it holds in the cache (`cairn.workers.sequence`, `cairn.workers.sequence_cache`):

- `device_budget.py`: how much of the device's free memory the arena takes.
- `arena.py`: the one pool of equal blocks that pages and state slots share (`ArenaLayout`).
- `page_pool.py`: pages by hash, their parents and reference counts.
- `checkpoint_store.py`: recurrent-state checkpoints, whole-page and sub-page, and pending slots.
- `checkpoint_policy.py`: where checkpoints are wanted and which kinds earn their keep.
- `cache_budget.py`: the LRU over evictable pages and checkpoints (`PAGE`, `CHECKPOINT`).
- `host_tier.py`: pages and checkpoints kept in host memory after leaving the device.
- `tier_cost.py`: the measured price of a host copy against a token of prefill.
- `event_queue.py`: the residency events queued for the index, bounded.
- `stats.py`: the cache's counters.
- `lookup.py`: where a prompt resumes (`match`, rule 4) and what that costs (`Match`).
- `placement.py`: where things go and what leaves when room is needed: holding, taking,
  eviction, demotion, promotion, emptying a group, clearing; queues the `cairn.workers.plan.BlockCopy`s.
- `checkpoint_slots.py`: checkpoint slots taken before a step (the finish capture among them),
  stored or dropped after it.
- `integrity.py`: the check that the parts agree (idle moments, tests).
- `prefix_cache.py`: the cache itself: admission, growth, registration, ending, snapshots.
- `transfer.py`: a resume point exported to and imported from a peer, over a `PrefixCache`
  and the runner's block I/O (`BlockIO`).

Nothing here imports torch but `device_budget.py`, which asks the device what it has left;
`transfer.py` moves numpy arrays.
"""
