"""The decode rows of a verify step in speculative decoding's exact mode (cairn.workers.speculative,
cairn.workers.model.batch): a plan whose decodes include verify segments with drafted tokens
runs them as levels of decode rows, the j-th drafted token of each segment at level j, so a
decode graph can replay them at fixed sizes (cairn.workers.execution.decode_graphs). `VerifyRows`
orders the rows and gives `StepWork` its verify fields (the runner's `prepare`).
"""

from __future__ import annotations

import numpy as np


class VerifyRows:
    """The decode rows of a plan whose decodes include verify segments with drafted tokens
    (speculative decoding's exact mode; cairn.workers.model.batch): level 0, every decode's first
    row; level j, the j-th drafted row of those with j drafts or more. `rows`: (segment, j) in
    that order; `of`: by segment id, its rows (positions in order)."""

    def __init__(self, decodes):
        depth = max(seg.drafts for seg in decodes)
        levels = [[seg for seg in decodes if seg.drafts >= j] for j in range(depth + 1)]
        self.levels = levels
        self.rows = [(seg, j) for j, level in enumerate(levels) for seg in level]
        self.of: dict[int, list[int]] = {}
        for i, (seg, _) in enumerate(self.rows):
            self.of.setdefault(id(seg), []).append(i)

    def arrays(self, prefills, cu: np.ndarray) -> dict:
        """`StepWork`'s verify-row fields: the rows per level, the states kept after each
        (sequence's slot, `Segment.states[j]`: its state after j + 1 tokens), the rows by
        segment."""
        saves, counts = [], []
        for j, level in enumerate(self.levels):
            kept = [(seg.seq.cache.state_slot, seg.states[j]) for seg in level if len(seg.states) > j]
            saves += kept
            counts.append(len(kept))
        nd = len(self.rows)
        by_segment = [self.of[id(seg)] for seg in self.levels[0]] + \
            [list(range(cu[nd + i], cu[nd + i + 1])) for i in range(len(prefills))]
        return dict(decode_levels=tuple(len(level) for level in self.levels),
                    level_saves=np.array(saves, np.int64).reshape(-1, 2), level_save_counts=tuple(counts),
                    segment_rows=np.array([r for rows in by_segment for r in rows], np.int64))

