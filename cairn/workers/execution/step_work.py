"""One step as plain host data (`StepWork`): what `cairn.workers.execution.runner.ModelRunner.run` needs, and all
a tensor-parallel rank is sent for it (`cairn.workers.execution.tp_runner`); the copies between
two steps (`SideWork`). Arrays are numpy; the runner puts every one
of them on the device in one copy. `checkpoint_tables` lays out where each checkpoint of the
step's prefill segments takes its states from (see cairn.workers.model.batch); `feed` puts the
last step's drawn ids, still on the device, into the rows that decode them (async scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cairn.kernels import VarlenPlan
from cairn.workers.model import ForwardBatch
from cairn.workers.model.batch import plan_arrays
from cairn.workers.plan import BlockCopy


@dataclass
class StepWork:
    """One step as plain host data: what `ModelRunner.run` needs, and all a tensor-parallel
    rank is sent (cairn.workers.execution.tp_runner). Arrays are numpy; `ModelRunner` puts every one of them on
    the device in one copy (`upload`)."""
    input_ids: np.ndarray
    positions: np.ndarray
    cu_seqlens: np.ndarray
    seq_lens: np.ndarray
    page_table: np.ndarray
    slot_mapping: np.ndarray
    state_slots: np.ndarray
    num_decodes: int
    logits_indices: np.ndarray
    prefill: VarlenPlan  # the prefill segments' boundaries (from 0) and checkpoint positions
    checkpoint_rows: np.ndarray  # see cairn.workers.model.batch
    checkpoint_targets: np.ndarray
    checkpoint_states: np.ndarray
    block_copies: list[BlockCopy] = field(default_factory=list)
    restores: list[tuple[int, int]] = field(default_factory=list)
    fresh_state_slots: list[int] = field(default_factory=list)
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    host_snapshots: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    promotions_for_now: bool = True  # this step's segments read what its promotions bring back
    # async scheduling (cairn.workers.engine): per row of input_ids, the row of the last step's
    # drawn ids (still on the device) that is its token, or -1 where input_ids holds it; None: none fed
    fed_from: np.ndarray | None = None
    # verify rows (cairn.workers.model.batch): decode rows per level, the states saved after each
    # level ([S, 2]: sequence's slot, keeping slot; `level_save_counts` a level), and the order of
    # the rows by segment (each segment's rows together, in plan order) for the drafter
    decode_levels: tuple[int, ...] = ()
    level_saves: np.ndarray | None = None
    level_save_counts: tuple[int, ...] = ()
    segment_rows: np.ndarray | None = None
    # images (cairn.workers.execution.image_rows): the rows that are image tokens, and the images'
    # token slices they hold, in row order; positions are then rotary ones, [3, T] with image rows
    image_rows: np.ndarray | None = None
    image_parts: tuple = ()

    @classmethod
    def decode_rows(cls, page_table: np.ndarray, positions: np.ndarray, input_ids: list[int], slots: np.ndarray,
                    page_size: int) -> "StepWork":
        """A decode-only step of one row a sequence, from plain numbers: each row's page-table
        row, position, token and state slot (the MTP head's draft rounds,
        cairn.workers.speculative.mtp_drafter, on every rank)."""
        n = len(input_ids)
        positions = np.asarray(positions, np.int64)
        width = int(positions.max() // page_size) + 1
        slot_mapping = page_table[np.arange(n), positions // page_size].astype(np.int64) * page_size + positions % page_size
        empty = np.zeros(0, np.int64)
        return cls(input_ids=np.array(input_ids, np.int64), positions=positions,
                   cu_seqlens=np.arange(n + 1, dtype=np.int32), seq_lens=(positions + 1).astype(np.int32),
                   page_table=np.ascontiguousarray(page_table[:, :width]), slot_mapping=slot_mapping,
                   state_slots=np.asarray(slots, np.int64), num_decodes=n, logits_indices=np.arange(n, dtype=np.int64),
                   prefill=VarlenPlan.build([0]), checkpoint_rows=empty.reshape(0, 1), checkpoint_targets=empty,
                   checkpoint_states=empty)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every per-step array the device reads, by name: the batch's, the prefill plan's tables
        (`prefill.<name>`), and the slot copies made around the forward."""
        restores, snapshots = np.array(self.restores, np.int64).reshape(-1, 2), np.array(self.snapshots,
                                                                                          np.int64).reshape(-1, 2)
        out = dict(input_ids=self.input_ids, positions=self.positions, cu_seqlens=self.cu_seqlens,
                   seq_lens=self.seq_lens, page_table=self.page_table, slot_mapping=self.slot_mapping,
                   state_slots=self.state_slots, logits_indices=self.logits_indices,
                   checkpoint_rows=self.checkpoint_rows, checkpoint_targets=self.checkpoint_targets,
                   checkpoint_states=self.checkpoint_states, restore_src=restores[:, 0], restore_dst=restores[:, 1],
                   snapshot_src=snapshots[:, 0], snapshot_dst=snapshots[:, 1],
                   fresh_state_slots=np.array(self.fresh_state_slots, np.int64))
        if self.fed_from is not None:
            out["fed_from"] = self.fed_from
        if self.level_saves is not None:
            out["level_saves"] = self.level_saves
        if self.image_rows is not None:
            out["image_rows"] = self.image_rows
        out.update(plan_arrays(self.prefill))
        return out

    def batch(self, tensors: dict[str, torch.Tensor], image_embeds: torch.Tensor | None = None) -> ForwardBatch:
        """The forward's view of this step, over its uploaded arrays (and its image rows' embeddings)."""
        b = ForwardBatch.over(tensors, self.num_decodes, self.prefill, self.decode_levels, self.level_save_counts)
        b.image_embeds = image_embeds
        return b


@dataclass
class SideWork:
    """Copies between two steps, in this order: block copies (the cache's, flushed early), state
    slot copies (a verify step's rollbacks, snapshots planned after a step), state slots to the
    host tier. What `ModelRunner.side` makes, and what a tensor-parallel rank is sent for it."""
    block_copies: list[BlockCopy] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    host_snapshots: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


def checkpoint_tables(prefills, plan: VarlenPlan, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each checkpoint of the step's prefill segments takes its states from (see
    cairn.workers.model.batch): its conv window's K-1 source rows, its slot, its saved delta-rule state."""
    rows, targets, states, saved = [], [], [], 0
    n = len(prefills)
    for i, seg in enumerate(prefills):
        for off in plan.positions[i]:
            window = [n * width + plan.cu[i] + p if p >= 0 else (i + 1) * width + p for p in range(off - width, off)]
            for slot in seg.ckpt_slots[off]:
                rows.append(window)
                targets.append(slot)
                states.append(saved)
            saved += 1
    return (np.array(rows, np.int64).reshape(-1, width), np.array(targets, np.int64), np.array(states, np.int64))

def feed(input_ids: torch.Tensor, fed_from: torch.Tensor, drawn: torch.Tensor) -> None:
    """Writes, on the device, the drawn ids that rows of `input_ids` take (`StepWork.fed_from`:
    the row of `drawn` each takes, -1 for none). A faulted row's -1 becomes token 0: that row's
    sequence has failed, and what its row computes is never read."""
    if drawn.numel():
        taken = drawn.index_select(0, fed_from.clamp(min=0)).clamp(min=0)
        input_ids.copy_(torch.where(fed_from >= 0, taken, input_ids))
