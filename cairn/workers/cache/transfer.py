"""Moving a resume point between engines: the holder exports the pages and the checkpoint a
request lacks, the receiver imports them and resumes as if it had computed them (issue: fetch
from a peer replica).

Each function takes the replica's `PrefixCache` and, where blocks move, the runner's block I/O
(`BlockIO`); the engine calls them between its steps.
- `plan_fetch(cache, page_hashes, num_tokens, depth)`: on the receiver, what to ask for: the
  pages of the chain from the end of its device run up to `depth` (the holder's resume point,
  in pages), and whether the checkpoint there is missing. None when the receiver already resumes
  as deep, from either tier (nothing to fetch).
- `export_resume(cache, io, page_hashes, first, depth)`: on the holder, between its steps: a copy
  of pages [first, depth) of the chain and of the checkpoint after page `depth` (a recurrent
  model), from whichever tier holds them, as plain host arrays (`ResumeExport`, what crosses
  Ray's object store), with the pages' rows beside the arena (a speculating engine's MTP head
  K/V: written where its head ran, which skips decode steps while its gate is closed), which a
  receiver with the same rows imports too, so that it drafts there as the holder would. None if
  any of them is no longer resident: the caller recomputes. The
  copy is one request's resume point, so the holder's loop pauses for at most that copy.
- A sub-page resume point (`FetchPlan.tail`: a state `tail` tokens into the page after `depth`,
  where the holder's prompt ended inside that page, under the request's hash root) travels the
  same way: the export adds the head of the holder's page holding those tokens' K/V (its partial
  page, `cairn.workers.cache.partial_pages`, or any page sharing them) and the sub-page state, and
  the state at `depth` only when it has one; the receiver adopts them as a partial page and a
  sub-page checkpoint.
- The holder exports the deepest resume point it has at or before the asked one, down to the page
  before it: the asked sub-page state, else a shorter one in the same page, else the state at
  `depth`, else a sub-page state inside page `depth - 1` (`FetchPlan.before`: that page's
  tokens, which the holder need not know). What the router predicts (a prompt's end) and where
  the engine put the state (its policy folds a prompt's end into a hint up to `tail_guard`
  tokens before it) may differ by those tokens; an exact ask would then find nothing and the
  receiver recompute everything.
- `import_resume(cache, io, export, page_hashes, first, root)`: on the receiver, between its steps: the pages
  become cached device pages under the very hashes the request carries (so a fetch never crosses
  a `cache_salt`: another salt's chain has other hashes, and the holder finds none of them) and
  the checkpoint a stored one; events tell the index. The chain's device run is held while
  blocks are taken, so making room never evicts what the import hangs from. What the device has
  no room for (its blocks held by running sequences) goes to the host tier instead
  (`cairn.workers.cache.host_adoption`), and the request resumes from there as from any host hit.
  Returns the pages imported and why the request cannot resume where the export ends, if it
  cannot: "refused" (room on neither tier; nothing changed but what making room evicted) or
  "no_checkpoint_slot" (the pages came, but neither a state slot nor host blocks could be had
  for the checkpoint, which is dropped).
Not under tensor parallelism: each rank holds a slice of every page and state, and a fetch
would have to move every rank's slice (not built: the engine asks for nothing and the caller
recomputes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cairn.cache_service.events import PagesStored
from cairn.cache_service.hashing import branch_root, next_page_hash, partial_page_hash
from cairn.cache_service.scoring import last_resumable_page
from cairn.workers.cache import host_adoption
from cairn.workers.cache.checkpoint_store import Checkpoint
from cairn.workers.cache.prefix_cache import PrefixCache
from cairn.workers.plan import IMPORT, BlockCopy


@dataclass(frozen=True)
class BlockIO:
    """The runner's block I/O, as a transfer uses it."""
    read: Callable[..., np.ndarray]  # (blocks, host=False) -> [len(blocks), block_bytes] uint8 rows
    copy: Callable[..., None]  # (copies, staging, row_staging=()): makes the cache's queued copies,
    # then these (IMPORT copies reading rows of the staging array, and of `row_staging`), now
    # the tensors beside the arena, one row a block (the MTP head's K/V: `ModelRunner.add_block_rows`)
    read_rows: Callable[..., tuple[np.ndarray, ...]] = lambda blocks, host=False: ()  # per tensor, [n, bytes]
    row_bytes: tuple[int, ...] = ()  # each tensor's bytes a block


@dataclass(frozen=True)
class FetchPlan:
    first: int  # the receiver's device run: pages [first, depth) are asked for
    depth: int  # pages; the checkpoint after page `depth` is asked for too (recurrent model)
    tail: tuple[int, ...] = ()  # or the sub-page one after these tokens of page `depth`, with its head
    root: bytes | None = None  # the request's hash root (a sub-page state is keyed under it)
    before: tuple[int, ...] = ()  # page `depth - 1`'s tokens: where the holder may fall back to (module doc)


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
    # the pages' rows in the holder's tensors beside the arena (`BlockIO.read_rows`): its MTP
    # head's K/V at their positions, when it speculates
    page_rows: tuple[np.ndarray, ...] = ()
    # a sub-page resume point (`FetchPlan.tail`): the tokens of the next page it lies after, the
    # head of a page holding their K/V ([1, block_bytes]) and the state there ([slot_blocks, ...])
    tail: tuple[int, ...] = ()
    head: np.ndarray | None = None
    sub_checkpoint: np.ndarray | None = None
    sub_kinds: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.pages, self.checkpoint, self.head, self.sub_checkpoint) if a is not None) + \
            sum(rows.nbytes for rows in self.page_rows)


def plan_fetch(cache: PrefixCache, page_hashes: list[bytes], num_tokens: int, depth: int,
               tail: tuple[int, ...] = (), root: bytes | None = None, before: tuple[int, ...] = ()
               ) -> FetchPlan | None:
    """What the receiver asks a holder resuming at `depth` pages (and `tail` tokens into the next
    page: a sub-page state, under hash `root`) for, `before` (page `depth - 1`'s tokens) naming
    where the holder may fall back to (module doc)."""
    if tail and (not cache.recurrent or root is None or not 1 <= depth <= len(page_hashes) or
                 depth * cache.page_size + len(tail) > num_tokens - 1 or len(tail) >= cache.page_size):
        tail = ()
    if not tail:
        depth = min(depth, len(page_hashes), last_resumable_page(num_tokens, cache.page_size))
    if depth <= 0:
        return None
    first = held = min(cache.device_run(page_hashes), depth)
    while held < depth and page_hashes[held] in cache.host.pages:  # the host tier's pages follow the device's
        held += 1
    floor = page_hashes[depth - 1]
    if tail:
        if held == depth and _sub_page(cache, floor, tail, root) is not None:
            return None  # held here, head and state, on either tier
        return FetchPlan(first, depth, tail, root, before)
    local = cache.checkpoints.get(floor) is not None or floor in cache.host.checkpoints  # on either tier
    if held == depth and (local or not cache.recurrent):
        return None
    return FetchPlan(first, depth, root=root, before=before)


def export_resume(cache: PrefixCache, io: BlockIO, page_hashes: list[bytes], first: int,
                  depth: int, tail: tuple[int, ...] = (), root: bytes | None = None,
                  before: tuple[int, ...] = ()) -> ResumeExport | None:
    """The holder's copy of what a `FetchPlan` asks for, or of the deepest resume point it has
    within a page before that (module doc)."""
    if not 0 <= first <= depth <= len(page_hashes):
        return None
    if cache.recurrent and depth:
        point = _resume_point(cache, page_hashes, first, depth, tail, root, before)
        if point is None:
            return None
        depth, tail = point
    io.copy([], None)  # a block read here must hold what the cache says it holds
    wanted = page_hashes[first:depth]
    found = _page_blocks(cache, wanted)
    if found is None:
        return None  # evicted since the router looked
    device_pages, host_blocks = found
    rows = [io.read(device_pages), io.read(host_blocks, host=True)]
    page_rows = tuple(np.concatenate(parts)
                      for parts in zip(io.read_rows(device_pages), io.read_rows(host_blocks, host=True)))
    ckpt, blocks, sub = None, None, None
    if cache.recurrent and depth:
        found_ckpt = _checkpoint_blocks(cache, page_hashes[depth - 1])
        if found_ckpt is None and not tail:
            return None
        if found_ckpt is not None:  # beside a sub-page state, the state at the floor comes if there
            ckpt, ckpt_blocks, on_host = found_ckpt
            blocks = io.read(ckpt_blocks, host=on_host)
    if tail:
        sub = _sub_page(cache, page_hashes[depth - 1], tail, root)
        if sub is None:
            return None
    out = ResumeExport(tuple(wanted), np.concatenate(rows), blocks,
                       tuple(sorted(ckpt.kinds)) if ckpt is not None else (),
                       ckpt.exact_tail if ckpt is not None else None, cache.layout.block_bytes, page_rows)
    if sub is not None:
        (head, head_on_host), (sub_ckpt, sub_blocks, sub_on_host) = sub
        out.tail, out.head, out.sub_kinds = tail, io.read([head], host=head_on_host), tuple(sorted(sub_ckpt.kinds))
        out.sub_checkpoint = io.read(sub_blocks, host=sub_on_host)
    return out


def _resume_point(cache: PrefixCache, page_hashes: list[bytes], first: int, depth: int, tail: tuple[int, ...],
                  root: bytes | None, before: tuple[int, ...]) -> tuple[int, tuple[int, ...]] | None:
    """(depth, tail) of the deepest state the holder has at or before `tail` tokens after page
    `depth`, down to page `depth - 1` (its tokens: `before`), on either tier; None if none."""
    floor = page_hashes[depth - 1]
    for k in range(len(tail), 0, -1) if root is not None else ():
        if _sub_page(cache, floor, tail[:k], root) is not None:
            return depth, tail[:k]
    if _checkpoint_blocks(cache, floor) is not None:
        return depth, ()
    if root is None or depth - 1 < max(first, 1) or len(before) != cache.page_size:
        return None
    under = page_hashes[depth - 2]
    for k in range(cache.page_size - 1, 0, -1):
        if _sub_page(cache, under, before[:k], root) is not None:
            return depth - 1, before[:k]
    return None


def _sub_page(cache: PrefixCache, floor: bytes, tail: tuple[int, ...], root: bytes
              ) -> tuple[tuple[int, bool], tuple[Checkpoint, list[int], bool]] | None:
    """The sub-page resume point `tail` tokens after page `floor`: ((the block of a page whose
    head holds their K/V, whether a host block), (the checkpoint, its blocks, whether host
    blocks)), from either tier; None unless both are there."""
    key = next_page_hash(branch_root(floor, root), tail)
    found = _checkpoint_blocks(cache, key)
    if found is None:
        return None
    page, shared = cache.pages.partial_match(floor, list(tail), root) if cache.pages.page_of(floor) is not None \
        else (None, 0)
    if shared >= len(tail):
        return (page, False), found
    on_host, shared = cache.host.partial_match(floor, list(tail), root) if cache.host else (None, 0)
    if shared >= len(tail):
        return (cache.host.pages[on_host].block, True), found
    return None


def _page_blocks(cache: PrefixCache, hashes: list[bytes]) -> tuple[list[int], list[int]] | None:
    """Where the pages of `hashes` (a run of one chain) are: (device pages of its device run,
    host blocks of the rest); None if any is on neither tier."""
    on_device = cache.device_run(hashes)
    if any(h not in cache.host.pages for h in hashes[on_device:]):
        return None
    return cache.pages.pages_of(hashes[:on_device]), [cache.host.pages[h].block for h in hashes[on_device:]]


def _checkpoint_blocks(cache: PrefixCache, page_hash: bytes) -> tuple[Checkpoint, list[int], bool] | None:
    """The whole-page checkpoint after page `page_hash`: (it, its blocks, whether they are host
    blocks); None if neither tier has one."""
    ckpt = cache.checkpoints.get(page_hash)
    if ckpt is not None:
        return ckpt, list(cache.arena.pages_of_group(ckpt.slot)), False
    if page_hash in cache.host.checkpoints:
        return cache.host.checkpoints[page_hash], cache.host.blocks_of(page_hash), True
    return None


def import_resume(cache: PrefixCache, io: BlockIO, export: ResumeExport, page_hashes: list[bytes],
                  first: int, root: bytes | None = None) -> tuple[int, str | None]:
    """Adopts a holder's export as cached pages and a stored checkpoint (module doc), on the
    device where it has room, else in the host tier (`cairn.workers.cache.host_adoption`): (pages
    imported, None or why the request cannot resume there: "refused", "no_checkpoint_slot")."""
    layout, placement = cache.layout, cache.placement
    n = len(export.page_hashes)
    depth = first + n
    run = cache.device_run(page_hashes)  # it may have grown since the plan, never shrunk below `first`
    if (export.block_bytes != layout.block_bytes
            or tuple(page_hashes[first:depth]) != export.page_hashes or export.pages.shape != (n, layout.block_bytes)
            or run < first
            or (export.checkpoint is not None and export.checkpoint.shape != (layout.slot_blocks, layout.block_bytes))):
        return 0, "refused"
    staging, copies, blocks = [], [], []
    held = placement.hold_chain(page_hashes[:min(run, depth)])  # what the import hangs from stays while room is made
    try:
        fresh = list(range(min(run, depth) - first, n))  # a chain's device pages are a prefix of it
        parent = page_hashes[first + fresh[0] - 1] if fresh and first + fresh[0] else None
        if placement.room_for_pages(len(fresh)):
            blocks = placement.take_free_pages(len(fresh))
            for j, block in zip(fresh, blocks):
                placement.adopt_page(block, export.page_hashes[j], page_hashes[first + j - 1] if first + j else None)
                staging.append(export.pages[j])
                copies.append(BlockCopy(IMPORT, len(staging) - 1, block))
            if fresh:
                cache.events.put(PagesStored(tuple(export.page_hashes[j] for j in fresh), parent))
        elif not host_adoption.adopt_pages(cache, list(export.page_hashes[fresh[0]:]), parent,
                                           [export.pages[j] for j in fresh], staging, copies):
            return 0, "refused"
        tail, chain = page_hashes[depth - 1], list(page_hashes[:depth])
        if export.checkpoint is not None and not _has_checkpoint(cache, tail):
            slot = cache.take_checkpoint_slot() if len(blocks) == len(fresh) else None  # pages on the device
            if slot is not None:
                for row, block in zip(export.checkpoint, cache.arena.pages_of_group(slot)):
                    staging.append(row)
                    copies.append(BlockCopy(IMPORT, len(staging) - 1, block))
                cache.slots.store(slot, tail, depth, set(export.checkpoint_kinds), export.exact_tail)
            else:
                host_adoption.adopt_checkpoint(
                    cache, Checkpoint(tail, -1, depth, set(export.checkpoint_kinds), export.exact_tail,
                                      admitted_at=cache.policy.clock), export.checkpoint, staging, copies, chain)
        sub_key = _import_sub_page(cache, export, tail, depth, root, staging, copies, blocks, chain) \
            if export.tail else None
        # the pages' rows beside the arena, where the holder's are this engine's and the pages
        # came to the device (else those blocks keep what they held: the MTP head drafts worse
        # there, nothing else changes)
        same_rows = io.row_bytes and tuple(rows.shape for rows in export.page_rows) == \
            tuple((n, size) for size in io.row_bytes) and len(blocks) == len(fresh)
        io.copy(copies, np.stack(staging) if staging else None,
                tuple(rows[fresh] for rows in export.page_rows) if same_rows and fresh else ())
        for block in blocks:
            placement.release_page(block)
        stored = (export.checkpoint is None or _has_checkpoint(cache, tail)) and \
            (not export.tail or (sub_key is not None and _has_checkpoint(cache, sub_key)))
        return len(fresh), None if stored else "no_checkpoint_slot"
    finally:
        placement.release_chain(held)


def _has_checkpoint(cache: PrefixCache, key: bytes) -> bool:
    """A checkpoint keyed `key` on either tier."""
    return cache.checkpoints.get(key) is not None or key in cache.host.checkpoints


def _import_sub_page(cache: PrefixCache, export: ResumeExport, floor: bytes, depth: int, root: bytes | None,
                     staging: list, copies: list, blocks: list[int], chain: list[bytes]) -> bytes | None:
    """Adopts an export's sub-page resume point after page `floor` (held on the device, or on the
    host): its head as a partial page (`cairn.workers.cache.partial_pages`) and its state as a
    sub-page checkpoint, each unless already here; on the device where the floor is and there is
    room, else on the host. A device block joins `blocks` (released with the pages). Returns the
    checkpoint's key (None: the export is malformed or `root` unknown)."""
    layout, tail = cache.layout, export.tail
    if root is None or export.head is None or export.sub_checkpoint is None or \
            export.head.shape != (1, layout.block_bytes) or \
            export.sub_checkpoint.shape != (layout.slot_blocks, layout.block_bytes):
        return None
    base = branch_root(floor, root)
    page_key = partial_page_hash(base, tail)
    on_device = cache.pages.page_of(floor) is not None
    if cache.pages.page_of(page_key) is None:
        if on_device and cache.placement.room_for_pages(1):
            [block] = cache.placement.take_free_pages(1)
            blocks.append(block)
            cache.pages.register(block, page_key, floor, tuple(tail), root, partial=True)
            staging.append(export.head[0])
            copies.append(BlockCopy(IMPORT, len(staging) - 1, block))
        else:
            host_adoption.adopt_partial_page(cache, page_key, floor, tuple(tail), root, export.head[0], staging,
                                             copies)
    key = next_page_hash(base, tail)
    if not _has_checkpoint(cache, key):
        slot = cache.take_checkpoint_slot() if on_device else None
        if slot is not None:
            for row, block in zip(export.sub_checkpoint, cache.arena.pages_of_group(slot)):
                staging.append(row)
                copies.append(BlockCopy(IMPORT, len(staging) - 1, block))
            cache.slots.store(slot, key, depth, set(export.sub_kinds), None, tail, floor, root)
        else:
            host_adoption.adopt_checkpoint(
                cache, Checkpoint(key, -1, depth, set(export.sub_kinds), None, tuple(tail), floor,
                                  cache.policy.clock, root), export.sub_checkpoint, staging, copies, chain)
    return key
