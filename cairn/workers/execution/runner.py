"""Turns a `StepPlan` into tensors, runs the model, returns the logits of sampling rows.

The runner owns the cache's memory: one arena tensor of `ArenaLayout.arena_bytes` bytes
(cairn.workers.cache.arena), over which it lays every cache tensor as a view, so the engine never holds more
than the budget it was given:
- block p (a KV page) holds [L_attn, 2, page_size, H_kv, D] in the model's dtype; attention layer
  l reads K as `kv[l][0]` = [num_blocks, page_size, H_kv, D], its pages strided by a block;
- state slot g spans blocks [g * slot_blocks, (g + 1) * slot_blocks) and holds `conv_states`
  [L_lin, conv_dim, K-1] in the model's dtype, then, from `ssm_offset`, `ssm_states`
  [L_lin, H_v, D_k, D_v] in fp32; the pools are [num_groups, ...] views strided by a slot.
A page and a slot over the same blocks never live at once: the arena's placement sees to that.
With a host tier (`ArenaLayout.host_blocks`), the runner also owns its memory: `host_blocks` blocks
of the same size, in pinned memory on CUDA (so copies are asynchronous to the host), a separate
buffer on CPU; the cache's block copies (demotions to it, promotions from it, page moves) are made
before anything else in the step, in the order queued. On CUDA the promotions go on a copy stream
of their own after the rest: a step waits for them only when one of its segments reads them
(`promotions_for_now`), else the next step does, so a request the scheduler starts a step later
has its copies overlap the other sequences' step. Their measured rate feeds the cache's cost rule
(`cairn.workers.cache.tier_cost`).
Page and slot ids come from the prefix cache; the runner never decides who holds what. It keeps
the page table (cairn.workers.execution.page_table: a row of page ids per sequence) across
steps and applies the plan's `page_table_writes` to it, so a step's cost does not grow with its
sequences' lengths. Fresh state slots are zeroed before a step, so every segment starts from its
slot; image tokens take the `encoder`'s embeddings (cairn.workers.execution.image_rows).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from cairn import kernels
from cairn.kernels import VarlenPlan
from cairn.workers import heap
from cairn.workers.cache.arena import ArenaLayout
from cairn.workers.execution.decode_graphs import DecodeGraphs
from cairn.workers.execution.image_rows import step_images
from cairn.workers.execution.page_table import PageTable
from cairn.workers.execution.pinned_upload import PinnedUpload
from cairn.workers.model import HybridForCausalLM, ModelCaches, packed_linear
from cairn.workers.model.packed_linear import pack_linears
from cairn.workers.plan import COPY, DEMOTE, IMPORT, IMPORT_HOST, MOVE, PROMOTE, BlockCopy, StepPlan
from cairn.workers.execution.step_work import SideWork, StepWork, checkpoint_tables, feed
from cairn.workers.execution.verify_rows import VerifyRows


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, layout: ArenaLayout, page_size: int, max_rows: int):
        """max_rows: page-table rows, one per sequence holding pages (the prefix cache's rows)."""
        self.model, self.cfg = model, model.config
        self.packed_linears = pack_linears(model)  # CPU: weights laid out once for oneDNN (none on CUDA)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if self.device.type == "cpu":
            kernels.load_native(self.device)  # the C++ kernels, built or loaded now, not in a step
            heap.retain_freed_memory()  # a step reuses the last one's activation pages (cairn.workers.heap)
        self.page_size = page_size
        self.encoder = None  # a vision-language model's (cairn.workers.vision.image_encoder), set by the engine
        self.arena = torch.zeros(layout.arena_bytes, dtype=torch.uint8, device=self.device)
        self._blocks = self.arena[:layout.cache_bytes].view(layout.num_blocks, layout.block_bytes)  # one row per block
        self.slot_blocks = layout.slot_blocks
        self.host = torch.zeros(layout.host_blocks, layout.block_bytes, dtype=torch.uint8,
                                pin_memory=self.device.type == "cuda")  # the host tier, one row per block
        self._timed = [0, 0.0]  # host copies timed since `take_copy_timing`: bytes, seconds (CPU only)
        # CUDA: promotions run on a stream of their own (module doc); the event says when they are in
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._promoted = None
        self.caches = ModelCaches(*self._views(layout))
        self.page_table = PageTable(max_rows)  # across steps, from the plans' page-table writes
        self._uploads = PinnedUpload(self.device)  # a step's arrays, in one aligned copy
        self.graphs: DecodeGraphs | None = None  # decode steps at fixed batch sizes (`use_decode_graphs`)
        # speculative decoding: each eager step keeps its rows' final normed hidden states, which
        # the MTP head reads (cairn.workers.speculative.mtp_drafter)
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        # tensors of one row per arena block beside it (the MTP head's K/V, `add_block_rows`):
        # device block copies (MOVE, COPY) move their rows too, the host tier keeps a row of
        # each per host block (`host_rows`), which DEMOTE and PROMOTE copy, and a peer fetch
        # carries them where both ends have the same (`read_block_rows`, `apply_copies`)
        self.block_rows: list[torch.Tensor] = []
        self.host_rows: list[torch.Tensor] = []

    def add_block_rows(self, *tensors: torch.Tensor) -> int:
        """Tensors of one row per arena block ([num_blocks, ...]) that follow the blocks: moved
        and copied with them on the device, demoted and promoted with them through host rows of
        their own (beside the host tier's `host_cache_bytes`). Returns those host rows' bytes."""
        host = 0
        for t in tensors:
            self.block_rows.append(t)
            rows = torch.zeros((self.host.shape[0], *t.shape[1:]), dtype=t.dtype, pin_memory=self.device.type == "cuda")
            self.host_rows.append(rows)
            host += rows.numel() * rows.element_size()
        return host

    def warm_up(self, max_rows: int, sampled_rows: int) -> int:
        """Runs each packed linear at every row count a step of at most `max_rows` tokens, and of
        `sampled_rows` sampled rows for the LM head, gives it (CPU; nothing elsewhere). Returns
        the products run."""
        return packed_linear.warm_up(self.model, max_rows, sampled_rows) if self.packed_linears else 0

    def _views(self, layout: ArenaLayout):
        cfg, item = self.cfg, self.dtype.itemsize
        elems = self.arena.view(self.dtype)
        kv_all = elems[:layout.cache_bytes // item].view(layout.num_blocks, len(cfg.attention_layers), 2, self.page_size,
                            cfg.num_key_value_heads, cfg.head_dim)
        kv = [(kv_all[:, i, 0], kv_all[:, i, 1]) for i in range(len(cfg.attention_layers))]
        n_lin = len(cfg.linear_layers)
        (channels, width), (h_v, d_k, d_v) = cfg.conv_state_shape, cfg.ssm_state_shape
        if not layout.slot_blocks:  # no recurrent layers: slot ids index nothing
            conv = torch.zeros(layout.virtual_slots, 0, channels, width, dtype=self.dtype, device=self.device)
            ssm = torch.zeros(layout.virtual_slots, 0, h_v, d_k, d_v, dtype=torch.float32, device=self.device)
            return kv, conv, ssm
        stride = layout.slot_blocks * layout.block_bytes  # bytes from one slot to the next
        if stride % 4 or layout.ssm_offset % 4:
            raise ValueError(f"state slots of {stride} bytes (delta-rule state at {layout.ssm_offset}) are not "
                             f"fp32-aligned")
        groups = layout.spare_start + layout.spare_slots if layout.spare_slots else layout.num_blocks // layout.slot_blocks
        conv = torch.as_strided(elems, (groups, n_lin, channels, width),
                                (stride // item, channels * width, width, 1))
        ssm = torch.as_strided(self.arena.view(torch.float32), (groups, n_lin, h_v, d_k, d_v),
                               (stride // 4, h_v * d_k * d_v, d_k * d_v, d_v, 1), layout.ssm_offset // 4)
        return kv, conv, ssm

    def execute(self, plan: StepPlan, all_logits: bool = False, fed: tuple[torch.Tensor, dict[int, int]] | None = None
                ) -> torch.Tensor:
        """Runs one step; returns fp32 logits [num sampling segments, vocab] in plan order
        (or, with `all_logits`, one row per computed token). `fed` (async scheduling): the last
        step's drawn ids on the device, and, by `id(seq)`, the row there of each sequence whose
        last token (the one this step decodes) is still only there."""
        if fed is None:
            return self.run(self.prepare(plan, all_logits))
        ids, rows = fed
        return self.run(self.prepare(plan, all_logits, rows), ids)

    def run(self, work: StepWork, fed: torch.Tensor | None = None) -> torch.Tensor:
        """The device's part of a step. Before the model: copy moved pages, restore checkpoints
        into resuming sequences' slots, zero fresh slots, and take the fed input ids from `fed`
        (`StepWork.fed_from`) on the device. After: snapshot slots into checkpoint slots. Every rank
        of a tensor-parallel engine runs the same `work` on its own shard."""
        states = (self.caches.conv_states, self.caches.ssm_states)
        self._wait_for_promotions()  # the last step's, if it left them running
        if work.block_copies:  # moved, demoted and promoted blocks: before anything writes there
            self._copy_blocks(work.block_copies)
            if work.promotions_for_now:
                self._wait_for_promotions()
        if self._graphed(work):
            logits, hidden = self.graphs.run(work, fed)
            if self.keep_hidden:
                self.hidden = hidden
            return logits
        tensors = self.upload(work.arrays())
        if fed is not None and work.fed_from is not None:
            feed(tensors["input_ids"], tensors["fed_from"], fed)
        if work.restores:
            kernels.copy_state_slots(states, tensors["restore_src"], tensors["restore_dst"])
        if work.fresh_state_slots:
            for t in states:
                t.index_fill_(0, tensors["fresh_state_slots"], 0)
        batch = work.batch(tensors, self.encoder.embeddings(work.image_parts) if work.image_parts else None)
        if self.keep_hidden:
            logits, self.hidden = self.model(batch, self.caches, hidden=True)
            if work.segment_rows is not None:  # each segment's rows together, as the drafter reads them
                self.hidden = self.hidden.index_select(0, torch.from_numpy(work.segment_rows).to(self.device))
        else:
            logits = self.model(batch, self.caches)
        if work.snapshots:
            kernels.copy_state_slots(states, tensors["snapshot_src"], tensors["snapshot_dst"])
        self._host_snapshots(work.host_snapshots)
        return logits

    def _host_snapshots(self, host_snapshots: list[tuple[int, tuple[int, ...]]]) -> None:
        """Checkpoints that found no device slot: state slots straight to the host tier."""
        if host_snapshots:
            k = self.slot_blocks
            self._copy_blocks([BlockCopy(DEMOTE, b, h) for slot, blocks in host_snapshots
                               for b, h in zip(range(slot * k, (slot + 1) * k), blocks)])

    def snapshot(self, plan: StepPlan) -> None:
        """The plan's snapshots (state slots into checkpoint slots, or to the host tier), made
        after the last step launched: for a plan whose checkpoints were planned after it ran
        (async scheduling, cairn.workers.async_scheduling.plan_deferred)."""
        self.copy_states(plan.snapshots)
        self._host_snapshots(plan.host_snapshots)

    def side(self, work: SideWork) -> None:
        """The copies between two steps (`SideWork`), in its order."""
        if work.block_copies:
            self.apply_copies(work.block_copies)
        self.copy_states(work.state_copies)
        self._host_snapshots(work.host_snapshots)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copies recurrent states between slots, (source, target) pairs with no slot both (a
        verify step's rollbacks; snapshots), queued after the last step launched."""
        if pairs:
            both = torch.tensor(pairs, dtype=torch.long).T.to(self.device)
            kernels.copy_state_slots((self.caches.conv_states, self.caches.ssm_states), both[0], both[1])

    def _wait_for_promotions(self) -> None:
        if self._promoted is not None:
            torch.cuda.current_stream(self.device).wait_event(self._promoted)
            self._promoted = None

    def _copy_blocks(self, copies: list[BlockCopy], staging: torch.Tensor | None = None) -> None:
        """Makes the cache's block copies in order: each run of one kind at once when no copy in
        it reads a block an earlier one wrote, else one by one. IMPORT (IMPORT_HOST) copies read
        rows of `staging` (blocks fetched from a peer) into the device (the host tier). On CUDA,
        the promotions go last, on the copy stream, after everything else queued (the cache
        frees the host blocks they read only at
        the pass's end, and the blocks they write are held by their requests: nothing else in
        the list touches them); `_promoted` marks when they are in."""
        if self._copy_stream is not None and any(c.kind == PROMOTE for c in copies):
            self._copy_blocks([c for c in copies if c.kind != PROMOTE], staging)
            promotions = [c for c in copies if c.kind == PROMOTE]
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                self._copy_run(PROMOTE, [c.src for c in promotions], [c.dst for c in promotions])
            self._promoted = torch.cuda.Event()
            self._promoted.record(self._copy_stream)
            return
        start = 0
        while start < len(copies):
            kind, end = copies[start].kind, start + 1
            while end < len(copies) and copies[end].kind == kind:
                end += 1
            self._copy_run(kind, [c.src for c in copies[start:end]], [c.dst for c in copies[start:end]], staging)
            start = end

    def apply_copies(self, copies: list[BlockCopy], staging=None, row_staging: tuple[np.ndarray, ...] = ()) -> None:
        """Block copies outside a step (an import, or an export's flush), `staging` a numpy
        array of rows for IMPORT copies; `row_staging`, per tensor beside the arena, the rows of
        IMPORT copies whose source row it has (`read_block_rows`' layout: a peer's pages)."""
        self._wait_for_promotions()
        self._copy_blocks(copies, None if staging is None else torch.from_numpy(staging))
        imports = [c for c in copies if c.kind == IMPORT and row_staging and c.src < len(row_staging[0])]
        for rows, staged in zip(self.block_rows if imports else (), row_staging):
            source = torch.from_numpy(staged).view(rows.dtype).view(len(staged), *rows.shape[1:])
            rows[self._index([c.dst for c in imports])] = \
                source[self._index([c.src for c in imports], source.device)].to(rows.device)
        self._wait_for_promotions()

    def read_blocks(self, blocks: list[int], host: bool = False):
        """A copy of device (or host tier) blocks as a numpy array [len(blocks), block_bytes]."""
        self._wait_for_flight(host)
        source = self.host if host else self._blocks
        return source[self._index(blocks, source.device)].cpu().numpy()

    @property
    def block_row_bytes(self) -> tuple[int, ...]:
        """Bytes a block has in each tensor beside the arena (`add_block_rows`)."""
        return tuple(rows[0].numel() * rows.element_size() for rows in self.block_rows)

    def read_block_rows(self, blocks: list[int], host: bool = False) -> tuple[np.ndarray, ...]:
        """A copy of device (or host tier) blocks' rows in the tensors beside the arena: per
        tensor, [len(blocks), its bytes a block] uint8."""
        self._wait_for_flight(host)
        return tuple(rows[self._index(blocks, rows.device)].reshape(len(blocks), size // rows.element_size())
                     .view(torch.uint8).cpu().numpy()
                     for rows, size in zip(self.host_rows if host else self.block_rows, self.block_row_bytes))

    def _wait_for_flight(self, host: bool) -> None:
        """Before a read of blocks: promotions into device blocks are in; on the host tier, the
        demotions queued into it too."""
        self._wait_for_promotions()
        if host and self._copy_stream is not None:
            torch.cuda.current_stream(self.device).synchronize()

    def _copy_run(self, kind: str, sources: list[int], targets: list[int], staging: torch.Tensor | None = None) -> None:
        src, dst = {MOVE: (self._blocks, self._blocks), COPY: (self._blocks, self._blocks),
                    DEMOTE: (self._blocks, self.host), PROMOTE: (self.host, self._blocks),
                    IMPORT: (staging, self._blocks), IMPORT_HOST: (staging, self.host)}[kind]
        if kind in (IMPORT, IMPORT_HOST):
            dst[self._index(targets)] = src[self._index(sources, src.device)].to(dst.device)
            return
        on_device = kind in (MOVE, COPY)
        pairs = [(src, dst)] + [(rows, host) if kind == DEMOTE else (host, rows)
                                for rows, host in zip(self.block_rows, self.host_rows)] if not on_device else []
        if not on_device and self.device.type != "cpu":
            # Across the bus, block by block, each queued on the step's stream from or to pinned
            # memory: asynchronous to the host, ordered with every other copy and the step.
            for a, b in pairs:
                for s, d in zip(sources, targets):
                    b[d].copy_(a[s], non_blocking=True)
            return
        if on_device:
            in_order = not set(sources).isdisjoint(targets)  # a block written, then read: one by one
            for rows in (self._blocks, *self.block_rows):
                if in_order:
                    for s, d in zip(sources, targets):
                        rows[d] = rows[s]
                else:
                    rows[self._index(targets)] = rows[self._index(sources)]
            return
        began = time.perf_counter()
        for a, b in pairs:
            b[self._index(targets, b.device)] = a[self._index(sources, a.device)]
            self._timed[0] += len(sources) * (a[0].numel() * a.element_size() if len(a) else 0)
        self._timed[1] += time.perf_counter() - began

    def take_copy_timing(self) -> tuple[int, float]:
        """(bytes, seconds) of the host copies timed since the last call: on CPU, every one; on
        CUDA none (they are queued, not waited for; `measure_host_bandwidth` stands in)."""
        timed, self._timed = self._timed, [0, 0.0]
        return timed[0], timed[1]

    def measure_host_bandwidth(self, blocks: int = 64) -> float | None:
        """Bytes/s of a round trip of up to `blocks` blocks to the host tier and back (waited
        for); None without a host tier. The engine seeds its cost rule with it."""
        n = min(blocks, self.host.shape[0], self._blocks.shape[0])
        if n == 0:
            return None
        began = time.perf_counter()
        self._copy_run(DEMOTE, list(range(n)), list(range(n)))  # the arena is empty at start: nothing is lost
        self._copy_run(PROMOTE, list(range(n)), list(range(n)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return 2 * n * self._blocks.shape[1] / max(time.perf_counter() - began, 1e-9)

    def _index(self, values: list[int], device: torch.device | None = None) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device or self.device)

    def upload(self, arrays: dict[str, np.ndarray], into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """A step's arrays on the device in one aligned copy, by name (`PinnedUpload.upload`)."""
        return self._uploads.upload(arrays, into)

    def use_decode_graphs(self, max_num_seqs: int, width: int, capture: bool, depth: int = 0,
                          padding_slot: int = -1) -> None:
        """Decode-only steps run at fixed batch sizes over fixed buffers (cairn.workers.execution.decode_graphs),
        replaying CUDA graphs when `capture` (made here, now: after the arena, before any step);
        with `depth`, verify steps too (speculative decoding's exact mode: up to `depth` drafted
        tokens a sequence, padding rows' state saves at `padding_slot`)."""
        self.graphs = DecodeGraphs(self, max_num_seqs, width, capture, depth, padding_slot)
        self.graphs.capture()

    def _graphed(self, work: StepWork) -> bool:
        """Whether this step runs as a decode graph: decodes only, nothing copied around them."""
        return (self.graphs is not None and work.num_decodes == len(work.cu_seqlens) - 1
                and len(work.logits_indices) == work.num_decodes and self.graphs.key(work) is not None
                and not (work.restores or work.fresh_state_slots or work.snapshots or work.host_snapshots))

    def prepare(self, plan: StepPlan, all_logits: bool = False, fed: dict[int, int] | None = None,
                shift: int = 0) -> StepWork:
        """The host's part of a step: the plan as plain arrays (`StepWork`). Per-segment numbers
        are gathered in one pass, the per-token ones computed with numpy; page-table rows come
        from the persistent table. `fed`: by `id(seq)`, the row of the last step's drawn ids that
        holds a decoding sequence's token (`execute`). A verify segment's drafted tokens follow
        its first (`Sequence.draft`), and each of its rows samples. `shift`: each position takes
        the token `shift` places after its own (the MTP head reads the next token's embedding:
        cairn.workers.speculative.mtp_drafter)."""
        self.page_table.write(plan.page_table_writes)
        ps, table = self.page_size, self.page_table.table
        decodes, prefills = plan.decodes, plan.prefills
        verify = VerifyRows(decodes) if any(seg.drafts for seg in decodes) else None
        rows, starts, counts, lengths, shared, slots, ids = [], [], [], [], [], [], []
        for seg, j in (verify.rows if verify else ((seg, 0) for seg in decodes)):
            seq = seg.seq
            c = seq.cache
            rows.append(c.row)
            starts.append(seg.start + j)
            lengths.append(len(seq.token_ids) + j)
            shared.append(c.shared_pages)
            slots.append(c.state_slot)
            ids.append(seq.token_ids[seg.start + shift] if j == 0 else seq.draft[j - 1])
        nd = len(starts)
        counts = [1] * nd
        fed_from = None if fed is None else np.array([fed.get(id(seg.seq), -1) for seg in decodes] +
                                                     [-1] * sum(seg.num_tokens for seg in prefills), np.int64)
        positions = [np.array(starts, dtype=np.int64)]
        for seg in prefills:
            seq = seg.seq
            c = seq.cache
            rows.append(c.row)
            starts.append(seg.start)
            counts.append(seg.num_tokens)
            lengths.append(len(seq.token_ids))
            shared.append(c.shared_pages)
            slots.append(c.state_slot)
            if seg.drafts:
                ids.append(seq.token_ids[seg.start])
                ids += seq.draft[:seg.drafts]
            else:
                ids += seq.token_ids[seg.start + shift:seg.start + seg.num_tokens + shift]
            positions.append(np.arange(seg.start, seg.start + seg.num_tokens))
        rows, counts = np.array(rows), np.array(counts)
        ends = np.array(starts) + counts
        pos = np.concatenate(positions) if prefills else positions[0]
        rope, image_rows, image_parts = step_images(verify.rows if verify else decodes, prefills, pos, self.encoder)
        if prefills:
            token_rows, token_shared = np.repeat(rows, counts), np.repeat(shared, counts)
        else:
            token_rows, token_shared = rows, np.array(shared)
        slot_mapping = table[token_rows, pos // ps].astype(np.int64) * ps + pos % ps
        slot_mapping[pos < token_shared * ps] = -1  # K/V already in shared cached pages: never rewritten
        cu = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=cu[1:])
        if all_logits:
            logits_rows = np.arange(cu[-1])
        elif verify or any(seg.drafts for seg in prefills):  # a verify segment samples at each of its rows
            logits_rows = np.concatenate(
                [np.array(verify.of[id(seg)] if verify else [i]) for i, seg in enumerate(decodes) if seg.samples] +
                [np.arange(cu[nd + i + 1] - 1 - seg.drafts, cu[nd + i + 1]) for i, seg in enumerate(prefills)
                 if seg.samples] + [np.zeros(0, np.int64)]).astype(np.int64)
        else:
            logits_rows = (cu[1:] - 1)[ends == np.array(lengths)]  # segments reaching their end sample
        max_pages = int((ends.max() + ps - 1) // ps)
        prefill = VarlenPlan.build((cu[nd:] - cu[nd]).tolist(), [sorted(seg.ckpt_slots) for seg in prefills],
                                   self.cfg.num_attention_heads // self.cfg.num_key_value_heads)
        ck_rows, ck_targets, ck_states = checkpoint_tables(prefills, prefill, self.cfg.linear_conv_kernel_dim - 1)
        return StepWork(
            input_ids=np.array(ids, dtype=np.int64), positions=rope.astype(np.int64, copy=False), cu_seqlens=cu,
            seq_lens=ends.astype(np.int32), page_table=table[rows, :max_pages], slot_mapping=slot_mapping,
            state_slots=np.array(slots, dtype=np.int64), num_decodes=nd, logits_indices=logits_rows.astype(np.int64),
            prefill=prefill, checkpoint_rows=ck_rows, checkpoint_targets=ck_targets, checkpoint_states=ck_states,
            block_copies=plan.block_copies,
            restores=plan.restores, fresh_state_slots=plan.fresh_state_slots, snapshots=plan.snapshots,
            host_snapshots=plan.host_snapshots, promotions_for_now=plan.promotions_for_now, fed_from=fed_from,
            image_rows=image_rows, image_parts=image_parts,
            **(verify.arrays(prefills, cu) if verify else {}))
