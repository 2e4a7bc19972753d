"""The cache's residency events (design rule 8), queued for whoever drains them (the engine,
which numbers them into batches for the index).

Bounded: undrained past `MAX_QUEUED` (no index, or a stuck one), the queue is dropped and
`dropped` set, so the next drain sends a snapshot instead. Until `forget` first introduces
the cache with a snapshot, a queue made with `record=False` queues nothing.
"""

from __future__ import annotations


class EventQueue:
    MAX_QUEUED = 65536

    def __init__(self, record: bool = True):
        self.record = record
        self.dropped = False
        self._events: list = []

    def put(self, event) -> None:
        if not self.record:
            return
        if len(self._events) >= self.MAX_QUEUED:
            self._events.clear()
            self.dropped = True
        self._events.append(event)

    def drain(self) -> list:
        """The events queued since the last drain. If some were dropped meanwhile (`dropped`),
        they no longer describe the cache: the caller sends a snapshot."""
        events, self._events = self._events, []
        return events

    def forget(self) -> None:
        """Drops the queued events: a snapshot sent now supersedes them. Events are queued from
        now on, if they were not already."""
        self._events.clear()
        self.dropped = False
        self.record = True

    def restart(self, events: list) -> None:
        """Replaces what is queued by `events` (a fresh picture: `PrefixCache.clear`), if recording."""
        self._events.clear()
        if self.record:
            self._events.extend(events)

    def __len__(self) -> int:
        return len(self._events)
