"""What the engine tells of its cache and does to it between steps (a mixin of `Engine`, over its
`cache`, `runner` and `events`): the numbered batches of cache events the cluster's index is fed
(the first a snapshot, and a snapshot again whenever queued events were lost), what each tier holds
now (what the index should hold once the events are in), the block copies queued made now instead
of before the next step, and clearing what no request holds.
"""

from __future__ import annotations

from cairn.cache_service.events import EventBatch
from cairn.workers.plan import BlockCopy


class EngineCache:
    def drain_events(self) -> EventBatch | None:
        """What changed in the cache since the last drain, as the next numbered batch. The first
        batch is a snapshot: a (re)started worker introduces itself with its full contents."""
        if self.events.next_seq == 0 or self.cache.events_dropped:  # first, or what was queued is lost
            return self.snapshot_events()
        events = self.cache.drain_events()
        return self.events.batch(events) if events else None

    def snapshot_events(self) -> EventBatch:
        """Everything resident now, as a self-contained batch (the answer to a resync request)."""
        self.cache.forget_events()  # superseded by the snapshot
        pages, states = self.cache.snapshot()
        host_pages, host_states = self.cache.host_snapshot()
        return self.events.snapshot(pages, states, host_pages, host_states)

    def cache_contents(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(page hashes, checkpoint page hashes) resident now on either tier: what the cache
        index should hold for this engine once its events are in."""
        pages, states = self.cache.snapshot()
        host_pages, host_states = self.cache.host_snapshot()
        held = frozenset(h for h, _ in pages + host_pages)
        return held, frozenset(states + host_states) & held

    def host_contents(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(page hashes, checkpoint page hashes) the host tier holds now."""
        host_pages, host_states = self.cache.host_snapshot()
        return frozenset(h for h, _ in host_pages), frozenset(host_states)

    def flush_block_copies(self, extra: list[BlockCopy] = (), staging=None, row_staging=()) -> None:
        """Makes the block copies the cache queued (then `extra`, reading `staging`, and
        `row_staging` for the rows beside the arena: `ModelRunner.apply_copies`) now, between
        steps, instead of before the next step."""
        copies = self.cache.take_block_copies() + list(extra)
        if copies:
            self.runner.apply_copies(copies, staging, row_staging)

    def clear_cache(self) -> None:
        """Drops every cached page and checkpoint no running request holds."""
        self.cache.clear()
