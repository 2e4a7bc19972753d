"""`TPGroup`: the ranks of one tensor-parallel engine and the two collectives its model needs.

Contract:
- `TPGroup.connect(rank, world, address, backend, timeout_s)` joins rank `rank` of `world` at
  `address` ("host:port"; rank 0 hosts the rendezvous store there). The backend is "gloo" (CPU)
  or "nccl" (CUDA). The process group is built directly over its store, not as torch's global
  default group, so one process can hold several engines (tests compare TP 1 with TP 2 side by
  side) and nothing else in the process is affected.
- `all_reduce(t)` sums `t` over the ranks in place and returns it (`op="min"`: the minimum); `all_gather(t, dim)` returns
  the ranks' tensors concatenated along `dim`, rank order. Every collective waits at most
  `timeout_s`, then raises (`RuntimeError`): a rank that died or hangs fails the step on every
  other rank instead of hanging it.
- `counters` counts collectives and the bytes each rank sent into them (what
  benchmarks/tensor_parallel.py reports).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Counters:
    all_reduces: int = 0
    all_reduce_bytes: int = 0
    all_gathers: int = 0
    all_gather_bytes: int = 0


class TPGroup:
    def __init__(self, rank: int, world: int, group, store, device: torch.device = torch.device("cpu")):
        self.rank, self.world, self._group, self._store = rank, world, group, store
        self.device = device  # where this group's tensors live: the CPU for gloo, the rank's GPU for NCCL
        self.counters = Counters()

    @classmethod
    def connect(cls, rank: int, world: int, address: str, backend: str = "gloo",
                timeout_s: float = 60.0) -> TPGroup:
        host, port = address.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), world, rank == 0, timeout=timeout)
        if backend == "gloo":
            return cls(rank, world, dist.ProcessGroupGloo(store, rank, world, timeout), store)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            device = torch.device("cuda", torch.cuda.current_device())
            return cls(rank, world, dist.ProcessGroupNCCL(store, rank, world, options), store, device)
        raise ValueError(f"backend must be gloo or nccl, got {backend!r}")

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`op`: "sum" (the model's partial sums) or "min" (agreeing on a size at startup)."""
        self.counters.all_reduces += 1
        self.counters.all_reduce_bytes += t.numel() * t.element_size()
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.SUM
        self._group.allreduce([t], options).wait()
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t = t.contiguous()
        self.counters.all_gathers += 1
        self.counters.all_gather_bytes += t.numel() * t.element_size()
        out = [torch.empty_like(t) for _ in range(self.world)]
        self._group.allgather([out], [t]).wait()
        return torch.cat(out, dim=dim)
