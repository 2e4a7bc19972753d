"""Decode steps at fixed batch sizes, over the same input buffers every step: what a CUDA graph
needs, and on CUDA the graphs themselves.

Contract:
- `buckets(max_num_seqs)`: 1, 2, 4, 8, then every multiple of 8 up to `max_num_seqs` (which is
  one too). A decode-only step of n sequences runs at the smallest bucket >= n, its n rows
  first, then padding rows: token 0 at position 0, a KV slot of -1 (store_kv writes nothing),
  state slot -1 (the decode state ops read zeros and write nothing, cairn/kernels/conv and delta_rule's reference.py),
  sequence length 1 over an all-zero page-table row. Padding rows write no page and no state,
  and only the first n rows of the logits are returned.
- Each bucket owns one device buffer holding its step's arrays packed at fixed offsets
  (`ModelRunner.upload`), and the `ForwardBatch` over it is built once: every decode step of that
  bucket writes its arrays into the same buffer and runs the same batch. The page table has a
  fixed width (`width` pages: the longest sequence the engine runs).
- On CUDA (`capture=True`), `capture()` records the decode forward of every bucket, largest
  first into one shared memory pool, after two warm-up runs on a side stream (Triton compiles
  and autotunes there, not in the graph); `run` then copies the step's arrays in and replays.
  `capture_s` and `memory_bytes` (what the device's free memory, the allocator emptied, lost over
  the capture: the graphs' pool and the workspaces they made) are kept and logged. Every graph
  copies its logits into rows [0, size) of one buffer made before the first capture, outside the
  pool, so what a graph leaves alive between replays is that one buffer, not an output per bucket;
  the rest of each graph's memory is freed at its capture's end and reused by the next (graphs
  replay one at a time). Elsewhere `run` runs
  the model eagerly on the bucket's batch: the same buffers, the same padding, no graph.
- Verify steps (speculative decoding's exact mode, `depth` k > 0; cairn.workers.model.batch's
  decode levels): a step whose sequences carry drafted tokens runs at (its bucket, k): k + 1
  levels of bucket-many rows, level j's real rows first (the sequences with j drafts or more),
  then padding rows as above; every level saves bucket-many states, the real saves first, then
  (`padding_slot`, `padding_slot`) pairs. A step of fewer drafts pads up to k levels. The sampled
  rows' logits (and the hidden states a drafter reads, in the step's segment order) are picked
  from their padded rows. Plain decode steps run at (bucket, 0), as above.
- With the runner's `keep_hidden` (a speculating engine), every graph also copies the final
  hidden states into one buffer, as the logits.
- Whoever calls `run` makes every block copy, restore and promotion of the step before it (the
  runner does), so a graph never reads a buffer that is still moving.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from cairn.kernels import VarlenPlan
from cairn.workers.execution.pinned_upload import packed_bytes
from cairn.workers.execution.step_work import feed
from cairn.workers.model.batch import ForwardBatch, plan_arrays

log = logging.getLogger(__name__)


def buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))[1:]
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, width: int, capture: bool, depth: int = 0,
                 padding_slot: int = -1):
        """runner: the cairn.workers.execution.runner.ModelRunner whose model and caches the steps run on;
        width: page-table columns (pages of the longest sequence); depth: the drafted tokens a
        verify step's sequence may carry (speculative decoding's exact mode; 0: no verify
        steps); padding_slot: the state slot padding rows' state saves copy to and from."""
        self.runner = runner
        self.sizes = buckets(max_num_seqs)
        self.width = width
        self.depth, self.padding_slot = depth, padding_slot
        self.capturing = capture
        self._empty_plan = VarlenPlan.build([0])
        self._width_k = runner.cfg.linear_conv_kernel_dim - 1
        # by (bucket, depth): the buffer, its tensors, the batch
        self._static: dict[tuple[int, int], tuple[torch.Tensor, dict[str, torch.Tensor], ForwardBatch]] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # every graph's logits (and final hidden states, for a drafter), rows [0, rows): one buffer
        # each, so the shared pool keeps no bucket's output alive between replays (each bucket's
        # own, at a 248k vocabulary, summed to GBs)
        self._logits: torch.Tensor | None = None
        self._hidden: torch.Tensor | None = None
        self.capture_s = 0.0
        self.memory_bytes = 0

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    def key(self, work) -> tuple[int, int] | None:
        """(bucket, depth) a decode-only step runs at: its sequences' bucket; depth 0 for plain
        decodes, `depth` for a verify step (fewer drafts pad up to it); None: it does not fit."""
        levels = work.decode_levels or (work.num_decodes,)
        size = self.bucket(levels[0])
        if size is None or len(levels) - 1 > self.depth:
            return None
        return size, (self.depth if len(levels) > 1 else 0)

    def arrays(self, work, size: int, depth: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The step's arrays padded to `size` rows a level (`depth` + 1 levels), in the key's
        fixed shapes; with each of the step's rows' row there."""
        levels = work.decode_levels or (work.num_decodes,)
        total = size * (depth + 1)
        index = np.concatenate([j * size + np.arange(n) for j, n in enumerate(levels)]).astype(np.int64)

        def padded(a: np.ndarray, fill, dtype) -> np.ndarray:
            out = np.full(total, fill, dtype)
            out[index] = a
            return out

        table = np.zeros((total, self.width), dtype=np.int32)
        table[index, :work.page_table.shape[1]] = work.page_table
        cu = np.arange(total + 1, dtype=np.int32)
        n = work.num_decodes
        out = dict(input_ids=padded(work.input_ids, 0, np.int64), positions=padded(work.positions, 0, np.int64),
                   cu_seqlens=cu, seq_lens=padded(work.seq_lens, 1, np.int32), page_table=table,
                   slot_mapping=padded(work.slot_mapping, -1, np.int64),
                   state_slots=padded(work.state_slots, -1, np.int64),
                   logits_indices=np.arange(total, dtype=np.int64),
                   checkpoint_rows=np.zeros((0, self._width_k), np.int64),
                   checkpoint_targets=np.zeros(0, np.int64), checkpoint_states=np.zeros(0, np.int64),
                   fed_from=padded(np.full(n, -1, np.int64) if work.fed_from is None else work.fed_from, -1, np.int64))
        if depth and self.padding_slot >= 0:  # each level's state saves, padded to `size` pairs
            saves = np.full((total, 2), self.padding_slot, np.int64)
            at = 0
            for j, count in enumerate(work.level_save_counts):
                saves[j * size:j * size + count] = work.level_saves[at:at + count]
                at += count
            out["level_saves"] = saves
        out.update(plan_arrays(self._empty_plan))
        return out, index

    def _load(self, key: tuple[int, int], arrays: dict[str, np.ndarray]) -> ForwardBatch:
        """Writes `arrays` into the key's buffer (made on first use) and returns its batch."""
        if key not in self._static:
            size, depth = key
            buffer = torch.empty(packed_bytes(arrays), dtype=torch.uint8, device=self.runner.device)
            tensors = self.runner.upload(arrays, into=buffer)
            plan = VarlenPlan(self._empty_plan.cu, [], self._empty_plan.tables, 0)  # bound to this bucket's copies
            levels = (size,) * (depth + 1) if depth else ()
            saves = levels if "level_saves" in arrays else ()
            self._static[key] = (buffer, tensors, ForwardBatch.over(tensors, size * (depth + 1), plan, levels, saves))
            return self._static[key][2]
        buffer, _, batch = self._static[key]
        self.runner.upload(arrays, into=buffer)
        return batch

    def run(self, work, fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(The logits of the step's sampled rows [n, vocab], in `work.logits_indices`' order;
        with the runner's `keep_hidden`, the final hidden states of its rows in
        `work.segment_rows`' order) of a decode-only step whose `key` is not None; the rows
        `work.fed_from` names take their ids from `fed` (async scheduling), before the replay."""
        key = self.key(work)
        arrays, index = self.arrays(work, *key)
        batch = self._load(key, arrays)
        if fed is not None and work.fed_from is not None:
            tensors = self._static[key][1]
            feed(tensors["input_ids"], tensors["fed_from"], fed)
        hidden = None
        if key in self._graphs:
            self._graphs[key].replay()
            rows = batch.input_ids.shape[0]
            logits = self._logits[:rows]
            hidden = self._hidden[:rows] if self._hidden is not None else None
        elif self.runner.keep_hidden:
            logits, hidden = self.runner.model(batch, self.runner.caches, hidden=True)
        else:
            logits = self.runner.model(batch, self.runner.caches)
        n = work.num_decodes
        if key[1] == 0:  # plain decodes: the first n rows, in order
            return logits[:n], None if hidden is None else hidden[:n]
        picked = torch.from_numpy(index[work.logits_indices]).to(logits.device)
        if hidden is not None:
            order = index if work.segment_rows is None else index[work.segment_rows]
            hidden = hidden.index_select(0, torch.from_numpy(order).to(hidden.device))
        return logits.index_select(0, picked), hidden

    def capture(self) -> None:
        """Records the decode forward of every (bucket, depth) (CUDA only; see the module doc)."""
        if not self.capturing:
            return
        device = self.runner.device
        began, before = time.perf_counter(), _free_bytes(device)
        pool = None
        keep_hidden = self.runner.keep_hidden
        keys = [(size, depth) for depth in sorted({0, self.depth}, reverse=True)
                for size in sorted(self.sizes, reverse=True)]  # the largest first
        for key in keys:
            size, depth = key
            arrays, _ = self.arrays(_Padding(self.depth if depth else 0), size, depth)
            batch = self._load(key, arrays)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    out = self.runner.model(batch, self.runner.caches, hidden=keep_hidden)
            torch.cuda.current_stream(device).wait_stream(side)
            logits, hidden = out if keep_hidden else (out, None)
            if self._logits is None:  # the largest key's shape, made outside every graph's pool
                self._logits = torch.empty_like(logits)
                self._hidden = torch.empty_like(hidden) if keep_hidden else None
            del out, logits, hidden
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.runner.model(batch, self.runner.caches, hidden=keep_hidden)
                rows = size * (depth + 1)
                if keep_hidden:
                    self._logits[:rows].copy_(out[0])
                    self._hidden[:rows].copy_(out[1])
                else:
                    self._logits[:rows].copy_(out)
                del out
            pool = graph.pool()
            self._graphs[key] = graph
        self.capture_s = time.perf_counter() - began
        self.memory_bytes = max(0, before - _free_bytes(device))
        log.info("captured decode graphs at %d batch sizes (%s)%s in %.1f s; they hold %.1f MiB",
                 len(self.sizes), ",".join(map(str, self.sizes)),
                 f", plain and verifying {self.depth} drafted tokens a row" if self.depth else "",
                 self.capture_s, self.memory_bytes / 2**20)


def _free_bytes(device: torch.device) -> int:
    """The device's free memory with the caching allocator emptied: what is left for others. Its
    drop over the capture is what the graphs hold (their pool, and the workspaces the capture
    made); `memory_reserved` is not, since the allocator reuses blocks freed during the capture."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class _Padding:
    """A decode step of no sequence (`depth` empty levels after the first): what capture records
    (every row is padding)."""

    def __init__(self, depth: int = 0):
        self.num_decodes = 0
        self.fed_from = None
        self.input_ids = self.positions = self.slot_mapping = self.state_slots = np.zeros(0, np.int64)
        self.seq_lens = np.zeros(0, np.int32)
        self.page_table = np.zeros((0, 0), np.int32)
        self.decode_levels = (0,) * (depth + 1) if depth else ()
        self.level_save_counts = (0,) * (depth + 1) if depth else ()
        self.level_saves = np.zeros((0, 2), np.int64)
