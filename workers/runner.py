"""Turns a `StepPlan` into tensors, runs the model, returns the logits of sampling rows.

The runner owns the cache's memory: one arena tensor of `ArenaLayout.arena_bytes` bytes
(workers.arena), over which it lays every cache tensor as a view, so the engine never holds more
than the budget it was given:
- block p (a KV page) holds [L_attn, 2, page_size, H_kv, D] in the model's dtype; attention layer
  l reads K as `kv[l][0]` = [num_blocks, page_size, H_kv, D], its pages strided by a block;
- state slot g spans blocks [g * slot_blocks, (g + 1) * slot_blocks) and holds `conv_states`
  [L_lin, conv_dim, K-1] in the model's dtype, then, from `ssm_offset`, `ssm_states`
  [L_lin, H_v, D_k, D_v] in fp32; the pools are [num_groups, ...] views strided by a slot.
A page and a slot over the same blocks never live at once: the arena's placement sees to that.
Page and slot ids come from the prefix cache; the runner never decides who holds what. Fresh
state slots are zeroed before a step, so every segment starts from its slot.
"""

from __future__ import annotations

import torch

import kernels
from workers.arena import ArenaLayout
from workers.model import ForwardBatch, ModelCaches, Qwen3NextForCausalLM
from workers.scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: Qwen3NextForCausalLM, layout: ArenaLayout, page_size: int):
        self.model = model
        self.cfg = model.config
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.page_size = page_size
        self.arena = torch.zeros(layout.arena_bytes, dtype=torch.uint8, device=self.device)
        self.caches = ModelCaches(*self._views(layout))

    def _views(self, layout: ArenaLayout):
        cfg, item = self.cfg, self.dtype.itemsize
        elems = self.arena.view(self.dtype)
        kv_all = elems.view(layout.num_blocks, len(cfg.attention_layers), 2, self.page_size,
                            cfg.num_key_value_heads, cfg.head_dim)
        kv = [(kv_all[:, i, 0], kv_all[:, i, 1]) for i in range(len(cfg.attention_layers))]
        n_lin, width = len(cfg.linear_layers), cfg.linear_conv_kernel_dim - 1
        h_v, d_k, d_v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if not layout.slot_blocks:  # no recurrent layers: slot ids index nothing
            conv = torch.zeros(layout.virtual_slots, 0, cfg.conv_dim, width, dtype=self.dtype, device=self.device)
            ssm = torch.zeros(layout.virtual_slots, 0, h_v, d_k, d_v, dtype=torch.float32, device=self.device)
            return kv, conv, ssm
        stride = layout.slot_blocks * layout.block_bytes  # bytes from one slot to the next
        if stride % 4 or layout.ssm_offset % 4:
            raise ValueError(f"state slots of {stride} bytes (delta-rule state at {layout.ssm_offset}) are not "
                             f"fp32-aligned")
        groups = layout.num_blocks // layout.slot_blocks
        conv = torch.as_strided(elems, (groups, n_lin, cfg.conv_dim, width),
                                (stride // item, cfg.conv_dim * width, width, 1))
        ssm = torch.as_strided(self.arena.view(torch.float32), (groups, n_lin, h_v, d_k, d_v),
                               (stride // 4, h_v * d_k * d_v, d_k * d_v, d_v, 1), layout.ssm_offset // 4)
        return kv, conv, ssm

    def execute(self, plan: StepPlan, all_logits: bool = False) -> torch.Tensor:
        """Runs one step; returns fp32 logits [num sampling segments, vocab] in plan order
        (or, with `all_logits`, one row per computed token). Before the model: restore
        checkpoints into resuming sequences' slots, zero fresh slots. After: snapshot slots
        into checkpoint slots."""
        states = (self.caches.conv_states, self.caches.ssm_states)
        if plan.restores:
            self._copy_slots(states, plan.restores)
        if plan.fresh_state_slots:
            slots = self._index(plan.fresh_state_slots)
            for t in states:
                t[slots] = 0
        logits = self.model(self.build_batch(plan, all_logits), self.caches)
        if plan.snapshots:
            self._copy_slots(states, plan.snapshots)
        return logits

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _copy_slots(self, tensors, pairs: list[tuple[int, int]]) -> None:
        kernels.copy_state_slots(tensors, self._index([s for s, _ in pairs]), self._index([d for _, d in pairs]))

    def build_batch(self, plan: StepPlan, all_logits: bool = False) -> ForwardBatch:
        segments = plan.segments
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu = [0]
        logits_rows: list[int] = []
        offsets: dict[int, list[int]] = {}
        offset_slots: dict[int, list[list[int]]] = {}
        for b, seg in enumerate(segments):
            seq = seg.seq
            page_ids = seq.cache.page_ids
            input_ids += seq.token_ids[seg.start:seg.end]
            positions += range(seg.start, seg.end)
            shared = seq.cache.shared_pages * ps  # K/V below this is in cached pages: never rewritten
            slot_mapping += [-1 if pos < shared else page_ids[pos // ps] * ps + pos % ps
                             for pos in range(seg.start, seg.end)]
            if seg.ckpt_slots:
                offsets[b] = sorted(seg.ckpt_slots)
                offset_slots[b] = [seg.ckpt_slots[o] for o in offsets[b]]
            cu.append(cu[-1] + seg.num_tokens)
            if all_logits:
                logits_rows += range(cu[-2], cu[-1])
            elif seg.samples:
                logits_rows.append(cu[-1] - 1)
        max_pages = max(len(seg.seq.cache.page_ids) for seg in segments)
        table = [seg.seq.cache.page_ids + [0] * (max_pages - len(seg.seq.cache.page_ids)) for seg in segments]

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return ForwardBatch(
            input_ids=t(input_ids, torch.long),
            positions=t(positions, torch.long),
            cu_seqlens=t(cu, torch.int32),
            query_lens=[seg.num_tokens for seg in segments],
            seq_lens=t([seg.end for seg in segments], torch.int32),
            page_table=t(table, torch.int32),
            slot_mapping=t(slot_mapping, torch.long),
            state_slots=t([seg.seq.cache.state_slot for seg in segments], torch.long),
            num_decodes=len(plan.decodes),
            logits_indices=t(logits_rows, torch.long),
            checkpoint_offsets=offsets,
            checkpoint_slots=offset_slots,
        )
