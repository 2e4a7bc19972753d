"""`VarlenPlan`: what the varlen ops derive from a batch's segment lengths, computed on the host
once per step, so that no launcher reads a length back from the device.

Contract:
- `VarlenPlan.build(cu, positions, group)` takes the segments' boundaries `cu` (B+1 host ints from 0,
  non-decreasing) and, per segment, the positions after which its recurrent state is wanted
  (strictly increasing in (0, len]; a shorter list means none for the rest). It checks them,
  raising ValueError, and computes each launcher's tables as int32 numpy arrays (`tables`):
  - `cu` [B+1];
  - `attention_tiles` [2, N]: (segment, first row) of each prefill attention tile, of
    `attention_rows` = ATTENTION_ROWS // group rows (`group`: query heads per K/V head, which one
    program takes together, so a program holds about ATTENTION_ROWS (row, head) pairs);
  - `conv_tiles` [2, N]: the same for the conv's `CONV_ROWS`-row tiles;
  - `chunks` [3, NC]: (first row, length, saved-state index or -1) of each delta-rule chunk, at
    most `DELTA_CHUNK` tokens, cut so that every wanted position ends one; `seq_chunks` [B+1],
    each segment's first chunk. `num_saved` states are returned, segment by segment.
- `bind(tensors)` attaches device copies of the tables (the runner uploads them with the rest
  of the step's metadata, in one copy); `on(device)` makes its own copies, for a caller outside
  an engine step (each made when first asked for). `device(name)` is a table on the device.
- `VarlenPlan.of(cu_seqlens, positions)`: the plan of a device tensor of boundaries, read back
  (a host sync): the ops' fallback when a caller passes none; `checked_plan(cu_seqlens, total,
  plan, positions)`, what every varlen op calls: the caller's plan or that one, checked against
  cu_seqlens and the op's rows.
The tile sizes live here, not in the Triton modules, so the host side never imports triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from cairn.kernels.common.checks import expect, expect_dtype, expect_shape

ATTENTION_ROWS = 64  # (query row, head) pairs of one prefill attention program
CONV_ROWS = 16  # rows of one varlen conv program
DELTA_CHUNK = 64  # the chunked delta rule's chunk


def _tiles(cu: list[int], rows: int) -> np.ndarray:
    seg = [b for b in range(len(cu) - 1) for _ in range(cu[b], cu[b + 1], rows)]
    first = [r for b in range(len(cu) - 1) for r in range(cu[b], cu[b + 1], rows)]
    return np.array([seg, first], dtype=np.int32).reshape(2, -1)


def _chunks(cu: list[int], positions: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, int]:
    starts, lens, saves, seq_chunks, saved = [], [], [], [0], 0
    for b in range(len(cu) - 1):
        begin, length = cu[b], cu[b + 1] - cu[b]
        wanted = [int(p) for p in positions[b]] if b < len(positions) else []
        expect(all(0 < p <= length for p in wanted) and all(x < y for x, y in zip(wanted, wanted[1:])),
                f"state_positions of sequence {b} strictly increasing in (0, {length}]", wanted)
        save_at = {p: saved + i for i, p in enumerate(wanted)}
        saved += len(wanted)
        pos = 0
        for end in sorted(set(wanted) | {length}) if length else []:
            while pos < end:
                starts.append(begin + pos)
                lens.append(min(DELTA_CHUNK, end - pos))
                pos += lens[-1]
                saves.append(save_at.get(pos, -1))
        seq_chunks.append(len(starts))
    return (np.array([starts, lens, saves], dtype=np.int32).reshape(3, -1), np.array(seq_chunks, dtype=np.int32),
            saved)


class VarlenPlan:
    def __init__(self, cu: list[int], positions: list[list[int]], tables: dict[str, np.ndarray], num_saved: int,
                 attention_rows: int = ATTENTION_ROWS):
        self.cu, self.positions, self.tables, self.num_saved = cu, positions, tables, num_saved
        self.attention_rows = attention_rows
        self._device: dict[str, Tensor] = {}
        self._target: torch.device | None = None  # `on`: copies made when first asked for

    @classmethod
    def build(cls, cu: Sequence[int], positions: Sequence[Sequence[int]] = (), group: int = 1) -> "VarlenPlan":
        cu = [int(c) for c in cu]
        expect(len(cu) >= 1 and cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])),
                "cu_seqlens non-decreasing from 0", cu)
        expect(len(positions) <= len(cu) - 1, f"at most B = {len(cu) - 1} lists of state_positions",
                len(positions))
        chunks, seq_chunks, saved = _chunks(cu, positions)
        rows = max(1, ATTENTION_ROWS // max(1, group))
        tables = dict(cu=np.array(cu, dtype=np.int32), attention_tiles=_tiles(cu, rows),
                      conv_tiles=_tiles(cu, CONV_ROWS), chunks=chunks, seq_chunks=seq_chunks)
        return cls(cu, [list(p) for p in positions], tables, saved, rows)

    @classmethod
    def of(cls, cu_seqlens: Tensor, positions: Sequence[Sequence[int]] = (), group: int = 1) -> "VarlenPlan":
        return cls.build(cu_seqlens.tolist(), positions, group).on(cu_seqlens.device)

    @property
    def batch(self) -> int:
        return len(self.cu) - 1

    @property
    def total(self) -> int:
        return self.cu[-1]

    def bind(self, tensors: dict[str, Tensor]) -> "VarlenPlan":
        self._device = dict(tensors)
        return self

    def on(self, device: torch.device) -> "VarlenPlan":
        self._target = device
        return self

    def device(self, name: str) -> Tensor:
        if name not in self._device:
            self._device[name] = torch.from_numpy(self.tables[name]).to(self._target)
        return self._device[name]

    def check(self, what: str, rows: int) -> None:
        """That the plan covers `rows` rows of the op's input (`what` names the op's argument)."""
        expect(self.total == rows, f"{what} from 0 to T = {rows}", self.cu)


def checked_plan(cu_seqlens: Tensor, total: int, plan: VarlenPlan | None,
                positions: Sequence[Sequence[int]] = ()) -> VarlenPlan:
    """The varlen plan of cu_seqlens [B+1] int32: the caller's, or built from cu_seqlens read
    back; checked to cover `total` rows."""
    expect_shape("cu_seqlens", cu_seqlens, "B+1", (None,))
    expect_dtype("cu_seqlens", cu_seqlens, torch.int32)
    plan = plan or VarlenPlan.of(cu_seqlens, positions)
    expect(plan.batch == cu_seqlens.shape[0] - 1, f"a plan of B = {cu_seqlens.shape[0] - 1} sequences", plan.batch)
    expect(plan.total == total, f"cu_seqlens non-decreasing from 0 to T = {total}", plan.cu)
    return plan
