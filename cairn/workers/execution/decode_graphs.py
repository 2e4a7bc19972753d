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
- Whoever calls `run` makes every block copy, restore and promotion of the step before it (the
  runner does), so a graph never reads a buffer that is still moving.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from cairn.kernels import VarlenPlan
from cairn.workers.execution.step_work import feed
from cairn.workers.model.batch import ForwardBatch, plan_arrays

log = logging.getLogger(__name__)


def buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))[1:]
    return sorted(set(sizes) | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, width: int, capture: bool):
        """runner: the cairn.workers.execution.runner.ModelRunner whose model and caches the steps run on;
        width: page-table columns (pages of the longest sequence)."""
        self.runner = runner
        self.sizes = buckets(max_num_seqs)
        self.width = width
        self.capturing = capture
        self._empty_plan = VarlenPlan.build([0])
        self._width_k = runner.cfg.linear_conv_kernel_dim - 1
        self._static: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor], ForwardBatch]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # every graph's logits, rows [0, size): one buffer, so the shared pool keeps no bucket's
        # output alive between replays (each bucket's own, at a 248k vocabulary, summed to GBs)
        self._logits: torch.Tensor | None = None
        self.capture_s = 0.0
        self.memory_bytes = 0

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    def arrays(self, work, size: int) -> dict[str, np.ndarray]:
        """The step's arrays padded to `size` rows, in the bucket's fixed shapes."""
        n = work.num_decodes
        pad = size - n

        def padded(a: np.ndarray, fill, dtype) -> np.ndarray:
            return np.concatenate((a.astype(dtype, copy=False), np.full(pad, fill, dtype)))

        table = np.zeros((size, self.width), dtype=np.int32)
        table[:n, :work.page_table.shape[1]] = work.page_table
        cu = np.arange(size + 1, dtype=np.int32)
        out = dict(input_ids=padded(work.input_ids, 0, np.int64), positions=padded(work.positions, 0, np.int64),
                   cu_seqlens=cu, seq_lens=padded(work.seq_lens, 1, np.int32), page_table=table,
                   slot_mapping=padded(work.slot_mapping, -1, np.int64),
                   state_slots=padded(work.state_slots, -1, np.int64),
                   logits_indices=np.arange(size, dtype=np.int64),
                   checkpoint_rows=np.zeros((0, self._width_k), np.int64),
                   checkpoint_targets=np.zeros(0, np.int64), checkpoint_states=np.zeros(0, np.int64),
                   fed_from=padded(np.full(n, -1, np.int64) if work.fed_from is None else work.fed_from, -1, np.int64))
        out.update(plan_arrays(self._empty_plan))
        return out

    def _load(self, size: int, arrays: dict[str, np.ndarray]) -> ForwardBatch:
        """Writes `arrays` into the bucket's buffer (made on first use) and returns its batch."""
        if size not in self._static:
            buffer = torch.empty(self.runner.packed_bytes(arrays), dtype=torch.uint8, device=self.runner.device)
            tensors = self.runner.upload(arrays, into=buffer)
            plan = VarlenPlan(self._empty_plan.cu, [], self._empty_plan.tables, 0)  # bound to this bucket's copies
            self._static[size] = (buffer, tensors, ForwardBatch.over(tensors, size, plan))
            return self._static[size][2]
        buffer, _, batch = self._static[size]
        self.runner.upload(arrays, into=buffer)
        return batch

    def run(self, work, fed: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [n, vocab] of a decode-only step of n <= max_num_seqs sequences; the rows
        `work.fed_from` names take their ids from `fed` (async scheduling), before the replay."""
        n = work.num_decodes
        size = self.bucket(n)
        batch = self._load(size, self.arrays(work, size))
        if fed is not None and work.fed_from is not None:
            tensors = self._static[size][1]
            feed(tensors["input_ids"], tensors["fed_from"], fed)
        if size in self._graphs:
            self._graphs[size].replay()
            return self._logits[:n]
        return self.runner.model(batch, self.runner.caches)[:n]

    def capture(self) -> None:
        """Records every bucket's decode forward (CUDA only; see the module doc)."""
        if not self.capturing:
            return
        device = self.runner.device
        began, before = time.perf_counter(), _free_bytes(device)
        pool = None
        for size in sorted(self.sizes, reverse=True):
            batch = self._load(size, self.arrays(_Padding(size), size))
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    logits = self.runner.model(batch, self.runner.caches)
            torch.cuda.current_stream(device).wait_stream(side)
            if self._logits is None:  # the largest bucket's shape, made outside every graph's pool
                self._logits = torch.empty_like(logits)
            del logits
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[:size].copy_(self.runner.model(batch, self.runner.caches))
            pool = graph.pool()
            self._graphs[size] = graph
        self.capture_s = time.perf_counter() - began
        self.memory_bytes = max(0, before - _free_bytes(device))
        log.info("captured decode graphs at %d batch sizes (%s) in %.1f s; they hold %.1f MiB",
                 len(self.sizes), ",".join(map(str, self.sizes)), self.capture_s, self.memory_bytes / 2**20)


def _free_bytes(device: torch.device) -> int:
    """The device's free memory with the caching allocator emptied: what is left for others. Its
    drop over the capture is what the graphs hold (their pool, and the workspaces the capture
    made); `memory_reserved` is not, since the allocator reuses blocks freed during the capture."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


class _Padding:
    """A decode step of no sequence: what capture records (every row is padding)."""

    def __init__(self, size: int):
        self.num_decodes = 0
        self.fed_from = None
        self.input_ids = self.positions = self.slot_mapping = self.state_slots = np.zeros(0, np.int64)
        self.seq_lens = np.zeros(0, np.int32)
        self.page_table = np.zeros((0, 0), np.int32)
