"""The page table the runner keeps across steps: one row of page ids per sequence holding pages
(rows assigned by the prefix cache, cairn.workers.cache.prefix_cache), updated by the plan's
`page_table_writes` alone, so a step's cost does not grow with its sequences' lengths. A row
is widened (for every row at once, doubling) the first time a sequence is longer than any
before. `rows(rows, width)` copies rows out for a pass of its own (the MTP head's drafts).
"""

from __future__ import annotations

import numpy as np


class PageTable:
    def __init__(self, max_rows: int, width: int = 64):
        self.table = np.zeros((max_rows, width), dtype=np.int32)  # row -> page ids, widened on demand

    def write(self, writes: list) -> None:
        """Applies the cache's page-table writes (`PageTableWrite`: row, start, page ids)."""
        for w in writes:
            end = w.start + len(w.page_ids)
            if end > self.table.shape[1]:  # a longer sequence than any before: widen
                wider = np.zeros((self.table.shape[0], max(end, 2 * self.table.shape[1])), dtype=np.int32)
                wider[:, :self.table.shape[1]] = self.table
                self.table = wider
            self.table[w.row, w.start:end] = w.page_ids

    def rows(self, rows: list[int], width: int) -> np.ndarray:
        """A copy of rows `rows`, their first `width` pages (zeros past what is written)."""
        out = np.zeros((len(rows), width), np.int32)
        have = min(width, self.table.shape[1])
        out[:, :have] = self.table[rows, :have]
        return out
