"""What the prefix cache keeps for one sequence: the pages and state slot it holds, its page-hash
chain, where it resumed, and the checkpoints it is to leave behind.

Written only by `cairn.workers.cache.prefix_cache.PrefixCache`; the scheduler and the runner read it. Units:
pages (page j covers tokens [j * page_size, (j + 1) * page_size)).
- `page_ids`: one per started page, in order; `state_slot`: the slot its recurrent state lives in
  and `row`: its row of the runner's page table (both None while it holds nothing).
- `page_hashes`: the chain over its whole pages (prompt and output), extended as pages fill.
- `shared_pages`: the first pages came from the cache and are never written again (their K/V
  is already there); `registered_pages` are named in the cache.
- `resumed_from`: (hash, depth) of the checkpoint it resumed from, until it stores a deeper one.
- `copied_partial`: (key, page index) of the partial page (a finished sequence's last page) whose
  head it copied at admission, until it stores a page there of its own (the partial goes cold).
- `checkpoint_targets`: page boundaries of the prompt to checkpoint, with the kinds asking.
- `finish_slot` / `finish_page`: the state at the last boundary crossed during decode, stored as
  a finish checkpoint when the sequence ends; `finish_admitted`: the policy's verdict, asked once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cairn.workers.slot import Slot


@dataclass
class SequenceCache:
    page_hashes: list[bytes] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    row: int | None = None
    shared_pages: int = 0
    registered_pages: int = 0
    register_stopped: bool = False
    resumed_from: tuple[bytes, int] | None = None
    copied_partial: tuple[bytes, int] | None = None
    checkpoint_targets: dict[int, set[str]] = field(default_factory=dict)
    finish_slot: Slot | None = None
    finish_page: int | None = None
    finish_admitted: bool | None = None
