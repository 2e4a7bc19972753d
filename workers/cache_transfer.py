"""Moving a resume point between engines: the holder exports the pages and the checkpoint a
request lacks, the receiver imports them and resumes as if it had computed them (issue: fetch
from a peer replica).

- `plan_fetch(engine, page_hashes, num_tokens, depth)`: on the receiver, what to ask for: the
  pages of the chain from the end of its device run up to `depth` (the holder's resume point,
  in pages), and whether the checkpoint there is missing. None when the receiver already resumes
  as deep (nothing to fetch).
- `export_resume(engine, page_hashes, first, depth)`: on the holder, between its steps: a copy
  of pages [first, depth) of the chain and of the checkpoint after page `depth` (a recurrent
  model), from whichever tier holds them, as plain host arrays (`ResumeExport`, what crosses
  Ray's object store). None if any of them is no longer resident: the caller recomputes. The
  copy is one request's resume point, so the holder's loop pauses for at most that copy.
- `import_resume(engine, export, page_hashes)`: on the receiver, between its steps: the pages
  become cached device pages under the very hashes the request carries (so a fetch never crosses
  a `cache_salt`: another salt's chain has other hashes, and the holder finds none of them) and
  the checkpoint a stored one; events tell the index. The chain's device run is held while
  blocks are taken, so making room never evicts what the import hangs from. Returns the
  pages imported and why the request cannot resume where the export ends, if it cannot:
  "refused" (nothing changed but what making room evicted) or "no_checkpoint_slot" (the pages
  came, but no state slot could be had for the checkpoint, which is dropped).
Nothing here runs under tensor parallelism: each rank holds a slice of every page and state, and
a fetch would have to move every rank's slice (not built; the caller recomputes).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cache_service.events import PagesStored
from workers.cache_placement import IMPORT


@dataclass(frozen=True)
class FetchPlan:
    first: int  # the receiver's device run: pages [first, depth) are asked for
    depth: int  # pages; the checkpoint after page `depth` is asked for too (recurrent model)


@dataclass
class ResumeExport:
    """Pages [first, first + len(page_hashes)) of a chain and, for a recurrent model, the state
    after the last of them: raw arena blocks, as the holder's layout lays them out."""
    page_hashes: tuple[bytes, ...]
    pages: np.ndarray  # [len(page_hashes), block_bytes] uint8
    checkpoint: np.ndarray | None  # [slot_blocks, block_bytes] uint8
    checkpoint_kinds: tuple[str, ...] = ()
    exact_tail: tuple[int, ...] | None = None
    block_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes + (self.checkpoint.nbytes if self.checkpoint is not None else 0)


def plan_fetch(engine, page_hashes: list[bytes], num_tokens: int, depth: int) -> FetchPlan | None:
    """What the receiver asks a holder resuming at `depth` pages for (module doc)."""
    cache, ps = engine.cache, engine.spec.page_size
    depth = min(depth, len(page_hashes), (num_tokens - 1) // ps)
    if depth <= 0 or engine.options.tensor_parallel_size > 1:
        return None
    first = min(cache.device_run(page_hashes), depth)
    local = cache.checkpoints.get(page_hashes[depth - 1]) is not None or page_hashes[depth - 1] in cache.host.checkpoints
    if first == depth and (local or not cache.recurrent):
        return None
    return FetchPlan(first, depth)


def export_resume(engine, page_hashes: list[bytes], first: int, depth: int) -> ResumeExport | None:
    """The holder's copy of what a `FetchPlan` asks for (module doc)."""
    cache, runner = engine.cache, engine.runner
    if engine.options.tensor_parallel_size > 1 or not 0 <= first <= depth <= len(page_hashes):
        return None
    engine.flush_block_copies()  # a block read here must hold what the cache says it holds
    wanted = page_hashes[first:depth]
    on_device = cache.device_run(wanted)  # then the chain's host pages follow
    if any(h not in cache.host.pages for h in wanted[on_device:]):
        return None  # evicted since the router looked
    rows = [runner.read_blocks(cache.pages.pages_of(wanted[:on_device])),
            runner.read_blocks([cache.host.pages[h].block for h in wanted[on_device:]], host=True)]
    ckpt, blocks = None, None
    if cache.recurrent and depth:
        tail = page_hashes[depth - 1]
        ckpt = cache.checkpoints.get(tail)
        if ckpt is not None:
            blocks = runner.read_blocks(list(cache.arena.pages_of_group(ckpt.slot)))
        elif tail in cache.host.checkpoints:
            ckpt = cache.host.checkpoints[tail]
            blocks = runner.read_blocks(cache.host.blocks_of(tail), host=True)
        else:
            return None
    width = engine.layout.block_bytes
    return ResumeExport(tuple(wanted), np.concatenate(rows), blocks,
                        tuple(sorted(ckpt.kinds)) if ckpt is not None else (),
                        ckpt.exact_tail if ckpt is not None else None, width)


def import_resume(engine, export: ResumeExport, page_hashes: list[bytes], first: int) -> tuple[int, str | None]:
    """Adopts a holder's export as cached pages and a stored checkpoint (module doc): (pages
    imported, None or why the request cannot resume there: "refused", "no_checkpoint_slot")."""
    cache, layout = engine.cache, engine.layout
    n = len(export.page_hashes)
    depth = first + n
    run = cache.device_run(page_hashes)  # it may have grown since the plan, never shrunk below `first`
    if (engine.options.tensor_parallel_size > 1 or export.block_bytes != layout.block_bytes
            or tuple(page_hashes[first:depth]) != export.page_hashes or export.pages.shape != (n, layout.block_bytes)
            or run < first
            or (export.checkpoint is not None and export.checkpoint.shape != (layout.slot_blocks, layout.block_bytes))):
        return 0, "refused"
    staging, copies = [], []
    held = cache.hold_chain(page_hashes[:min(run, depth)])  # what the import hangs from stays while room is made
    try:
        fresh = list(range(min(run, depth) - first, n))  # a chain's device pages are a prefix of it
        if not cache.room_for_pages(len(fresh)):
            return 0, "refused"
        blocks = cache.take_free_pages(len(fresh))
        for j, block in zip(fresh, blocks):
            parent = page_hashes[first + j - 1] if first + j else None
            cache.adopt_page(block, export.page_hashes[j], parent)
            staging.append(export.pages[j])
            copies.append((IMPORT, len(staging) - 1, block))
        if fresh:
            cache.emit(PagesStored(tuple(export.page_hashes[j] for j in fresh),
                                   page_hashes[first + fresh[0] - 1] if first + fresh[0] else None))
        if export.checkpoint is not None and cache.checkpoints.get(page_hashes[depth - 1]) is None:
            slot = cache.take_checkpoint_slot()
            if slot is not None:
                for row, block in zip(export.checkpoint, cache.arena.pages_of_group(slot)):
                    staging.append(row)
                    copies.append((IMPORT, len(staging) - 1, block))
                cache.store_checkpoint(slot, page_hashes[depth - 1], depth, set(export.checkpoint_kinds),
                                       export.exact_tail)
        engine.flush_block_copies(copies, np.stack(staging) if staging else None)
        for block in blocks:
            cache.release_page(block)
        stored = export.checkpoint is None or cache.checkpoints.get(page_hashes[depth - 1]) is not None
        return len(fresh), None if stored else "no_checkpoint_slot"
    finally:
        cache.release_chain(held)
