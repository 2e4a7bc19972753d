"""A peer's export adopted into the host tier, when the device has no room for it: a replica whose
device is full of running sequences still takes the resume point it fetched, and its request
resumes from host memory as from any host hit (copied back as it is admitted).

`cairn.workers.cache.transfer.import_resume` calls it for what the device cannot take: the pages
it has no free blocks for (`adopt_pages`), the checkpoint it has no state slot for
(`adopt_checkpoint`), a sub-page resume point (`adopt_partial_page`: the head of the page holding
the tail's K/V, beside its sub-page state, `adopt_checkpoint` again). Rules it keeps, the host tier's own
(`cairn.workers.cache.host_tier`):
- the chain's device pages stay a prefix of it: pages go to the host only after the receiver's
  device run, in chain order, each under its parent (on the device, or here already);
- a page or checkpoint already here is not copied again, and what the chain hangs from here is
  pinned while blocks are taken, so making room never evicts it;
- what arrives is told to the index as host-resident (`PagesStored`/`StateStored` with `HOST`).
Each returns whether it adopted everything asked; on False nothing of that call was added
(what making room evicted stays evicted). Copies are `IMPORT_HOST` block copies of staging rows.
"""

from __future__ import annotations

from cairn.cache_service.events import HOST, PagesStored
from cairn.workers.cache.checkpoint_store import Checkpoint
from cairn.workers.cache.prefix_cache import PrefixCache
from cairn.workers.plan import IMPORT_HOST, BlockCopy


def _blocks(cache: PrefixCache, n: int, keep: list[bytes]) -> list[int] | None:
    """`n` host blocks, the host pages in `keep` kept; None without a host tier or room."""
    return None if not cache.host or cache.placement.dropping else cache.host.take_blocks(n, keep)


def adopt_pages(cache: PrefixCache, hashes: list[bytes], parent: bytes | None, rows: list,
                staging: list, copies: list) -> bool:
    """Pages `hashes` of a chain (in order, the first under `parent`, which is on the device),
    their K/V in `rows`, as host pages; those the host has already are kept as they are."""
    host = cache.host
    todo = [j for j, h in enumerate(hashes) if h not in host.pages]
    blocks = _blocks(cache, len(todo), hashes)
    if blocks is None:
        return False
    run: list[bytes] = []
    for j, block in zip(todo, blocks):
        up = hashes[j - 1] if j else parent
        host.add_page(hashes[j], up, block)
        staging.append(rows[j])
        copies.append(BlockCopy(IMPORT_HOST, len(staging) - 1, block))
        if run and up != run[-1]:
            cache.events.put(PagesStored(tuple(run), host.pages[run[0]].parent, HOST))
            run = []
        run.append(hashes[j])
    if run:
        cache.events.put(PagesStored(tuple(run), host.pages[run[0]].parent, HOST))
    return True


def adopt_checkpoint(cache: PrefixCache, ckpt: Checkpoint, rows, staging: list, copies: list,
                     keep: list[bytes]) -> bool:
    """A state (`rows`: its slot's blocks) as a host checkpoint, `ckpt` naming it (slot -1)."""
    blocks = _blocks(cache, len(rows), keep)
    if blocks is None:
        return False
    for row, block in zip(rows, blocks):
        staging.append(row)
        copies.append(BlockCopy(IMPORT_HOST, len(staging) - 1, block))
    cache.host.add_checkpoint(ckpt, blocks)
    if ckpt.floor is None:
        cache.placement.state_event(ckpt.page_hash)
    else:
        cache.placement.state_event(ckpt.floor)
        cache.placement.sub_event(ckpt, HOST)
    return True


def adopt_partial_page(cache: PrefixCache, page_key: bytes, floor: bytes, tail: tuple[int, ...],
                       root: bytes, row, staging: list, copies: list) -> bool:
    """The head of the page after `floor` (its first `tail` tokens' K/V), as a host partial page."""
    if page_key in cache.host.pages:
        return True
    blocks = _blocks(cache, 1, [floor])
    if blocks is None:
        return False
    cache.host.add_page(page_key, floor, blocks[0], tail, root, partial=True)
    staging.append(row)
    copies.append(BlockCopy(IMPORT_HOST, len(staging) - 1, blocks[0]))
    return True
