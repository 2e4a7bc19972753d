"""The prefix cache's counters, as the engine's metrics report them (`Engine.metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheStats:
    pages_evicted: int = 0
    checkpoints_stored: int = 0
    checkpoints_used: int = 0
    checkpoints_evicted: int = 0
    checkpoints_dropped: int = 0  # refused at commit (duplicate or page gone)
    checkpoints_without_slot: int = 0  # wanted, but every arena group was held by running sequences
    checkpoints_to_host: int = 0  # of those, written straight to the host tier instead
    pages_demoted: int = 0  # of the pages evicted from the device, those kept on the host
    checkpoints_demoted: int = 0
    pages_promoted: int = 0  # host pages brought back to the device for a request
    checkpoints_from_host: int = 0  # resumes that copied their checkpoint from the host
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    partial_pages_kept: int = 0  # sequences' last pages kept for partial matches (`partial_pages`)
    partial_pages_superseded: int = 0  # of those, sent to the cold end by a page stored after them
    state_bytes_peak: int = 0  # the most arena bytes checkpoints (pending and stored) held at once
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)  # kind -> {"stored": n, "used": n}

    def count(self, what: str, kinds: set[str]) -> None:
        """One checkpoint of `kinds` was `what` ("stored" or "used")."""
        for k in kinds:
            counts = self.by_kind.setdefault(k, {"stored": 0})
            counts[what] = counts.get(what, 0) + 1
