"""An engine's side of peer fetch (`cairn.workers.cache.transfer` over its cache and its runner's block
I/O), with the counters its metrics report. Runs on the engine's thread, but for `deliver`.

Receiving: `plan` says what to ask a holder resuming a prompt deeper than this engine does
(None: nothing); the engine holds the request meanwhile (`hold`), `deliver` (from any thread)
queues what the fetch brought, and `adopt` imports it at the start of the next step, before the
request is scheduled (or counts why there is nothing: the request recomputes). Holding:
`export` copies what a peer's plan asks for. Not under tensor parallelism (each rank would need
its own slice): nothing is planned or exported, and an import is refused.

Counters: `counts` (fetches, fetched pages and bytes, exported bytes) and `fallbacks` (fetches
that did not happen, by reason: timeout, holder_failed, evicted from the receiving replica's
fetcher; refused, no_checkpoint_slot from the import).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from cairn.workers.cache import transfer
from cairn.workers.cache.prefix_cache import PrefixCache
from cairn.workers.cache.transfer import BlockIO, FetchPlan, ResumeExport
from cairn.workers.sequence import Sequence

log = logging.getLogger(__name__)


class EnginePeerFetch:
    def __init__(self, cache: PrefixCache, block_io: Callable[[], BlockIO], tensor_parallel: bool):
        self.cache, self._block_io, self.tensor_parallel = cache, block_io, tensor_parallel
        self.counts = dict(fetches=0, fetched_pages=0, fetched_bytes=0, exported_bytes=0)
        self.fallbacks: dict[str, int] = {}
        self._plans: dict[str, FetchPlan] = {}  # held requests' fetches under way, by request id
        self._deliveries: deque[tuple[str, ResumeExport | str | None]] = deque()  # arrived, any thread
        # runs before an export: the engine's pending MTP head pass, so the pages' head K/V is written
        self.before_export: Callable[[], None] = lambda: None

    # ---- receiving ---------------------------------------------------------------------------
    def plan(self, page_hashes: list[bytes], num_tokens: int, depth: int, tail: tuple[int, ...] = (),
             root: bytes | None = None, before: tuple[int, ...] = ()) -> FetchPlan | None:
        """What to ask a peer resuming this prompt at `depth` pages (and `tail` tokens into the
        next page, under hash `root`; `before`: page `depth - 1`'s tokens) for (None: nothing)."""
        if self.tensor_parallel:
            return None
        return transfer.plan_fetch(self.cache, page_hashes, num_tokens, depth, tail, root, before)

    def hold(self, request_id: str, plan: FetchPlan) -> None:
        self._plans[request_id] = plan

    def drop(self, request_id: str) -> None:
        """The request ended while its fetch was under way: what arrives for it is ignored."""
        self._plans.pop(request_id, None)

    def deliver(self, request_id: str, export: ResumeExport | str | None) -> None:
        """The holder's export, or why there is none (a fallback reason; None: nothing asked)."""
        self._deliveries.append((request_id, export))

    @property
    def has_deliveries(self) -> bool:
        return bool(self._deliveries)

    def adopt(self, requests: dict[str, Sequence]) -> None:
        """Imports what arrived for requests still held (`requests`: the engine's, by id) and lets
        them be scheduled; a broken export fails no request: it recomputes."""
        while self._deliveries:
            request_id, export = self._deliveries.popleft()
            seq, plan = requests.get(request_id), self._plans.pop(request_id, None)
            if seq is None or plan is None:
                continue  # aborted meanwhile
            seq.fetch_pending = False
            try:
                if isinstance(export, str):
                    self.count_fallback(export)
                elif export is not None:
                    self.import_(export, seq.cache.page_hashes, plan.first, seq.hash_root)
            except Exception:
                log.exception("adopting a fetched resume point for %s failed", request_id)
                self.count_fallback("refused")

    def import_(self, export: ResumeExport, page_hashes: list[bytes], first: int, root: bytes | None = None) -> int:
        """Adopts a peer's export (pages imported). An import the request cannot resume from is
        counted as a fallback, by reason (`refused`: nothing imported; `no_checkpoint_slot`: the
        pages came, the checkpoint found no state slot), and not as a fetch: the request
        recomputes from the deepest resume point it has here."""
        pages, missing = (0, "refused") if self.tensor_parallel else \
            transfer.import_resume(self.cache, self._block_io(), export, page_hashes, first, root)
        if missing is not None:
            self.count_fallback(missing)
        elif pages or export.checkpoint is not None:
            self.counts["fetches"] += 1
            self.counts["fetched_pages"] += pages
            self.counts["fetched_bytes"] += export.nbytes
        return pages

    def count_fallback(self, reason: str) -> None:
        """A fetch that did not happen (the holder evicted it, died, timed out, refused): the
        request recomputes; `reason` labels the counter."""
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    # ---- holding -------------------------------------------------------------------------------
    def export(self, page_hashes: list[bytes], first: int, depth: int, tail: tuple[int, ...] = (),
               root: bytes | None = None, before: tuple[int, ...] = ()) -> ResumeExport | None:
        """A copy of pages [first, depth) of the chain and the checkpoint at `depth` (with `tail`:
        the sub-page resume point there), or of the deepest resume point here within a page
        before it (`before`: page `depth - 1`'s tokens), for a peer; None if there is none."""
        if self.tensor_parallel:
            return None
        self.before_export()
        out = transfer.export_resume(self.cache, self._block_io(), page_hashes, first, depth, tail, root, before)
        if out is not None:
            self.counts["exported_bytes"] += out.nbytes
        return out
