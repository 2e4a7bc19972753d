"""`RayRankWorkers`: a tensor-parallel engine replica's ranks 1..N-1, as Ray actors in its
placement group.

Contract: `RayRankWorkers.start(model_dir, options, address)` is what the engine replica hands
the engine (`Engine.from_pretrained(start_ranks=...)`) in place of the local processes of
`cairn.workers.execution.tp_runner.RankWorkers`, with the same methods (`wait_ready`, `send`, `report`, `close`).
Rank r runs in bundle r of the placement group the replica itself runs in (Serve creates it from
the deployment's `placement_group_bundles`, `STRICT_PACK`: one node, so the ranks meet rank 0 on
loopback), with that bundle's CPUs and GPU; each is named `cairn-tp-rank-<engine>-<rank>`.
Each rank actor gets the `EngineOptions` rank 0 was asked for (the value, pickled as Ray passes
arguments) and builds its shard, arena and runner exactly as a local rank process does
(`cairn.workers.execution.tp_runner.build_rank_runner`), then runs what it is sent
(`RankExecutor.handle`) in order (one caller, one sequential actor: Ray keeps the order). A rank actor that dies makes
rank 0's collectives time out, which breaks the engine (`cairn.workers.execution.tp_runner.RankFailure`); the
replica then fails its health check. `close()` kills the rank actors.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cairn.workers.engine_options import EngineOptions
from cairn.workers.execution.tp_runner import RankFailure

log = logging.getLogger(__name__)
RANK_ACTOR_PREFIX = "cairn-tp-rank-"  # + engine + "-" + rank: named, so operators (and tests) find them


@ray.remote
class RankActor:
    """One rank of a tensor-parallel engine: its shard, its arena, its runner."""

    def __init__(self, model_dir: str, options: EngineOptions, rank: int, address: str):
        import torch

        from cairn.workers.execution.tp_runner import build_rank_runner
        from cairn.workers.speculative.mtp_drafter import MtpDrafter

        torch.set_num_threads(1)
        device = torch.device("cuda") if ray.get_gpu_ids() else torch.device("cpu")  # its bundle's GPU
        self.executor, self._num_blocks = build_rank_runner(model_dir, options, rank, address, device,
                                                                 drafter_type=MtpDrafter)

    def num_blocks(self) -> int:
        return self._num_blocks

    def pid(self) -> int:
        return os.getpid()

    def run(self, work) -> None:
        self.executor.handle(work)


class RayRankWorkers:
    def __init__(self, actors: list, ready: list):
        self.actors, self._ready = actors, ready
        self._last: list = []

    @classmethod
    def start(cls, model_dir: str | Path, options: EngineOptions, address: str) -> RayRankWorkers:
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("a tensor-parallel replica runs in a placement group of tensor_parallel_size "
                               "bundles (cairn.cluster.app sets placement_group_bundles)")
        bundle, engine = group.bundle_specs, uuid.uuid4().hex[:12]
        actors = []
        for rank in range(1, options.tensor_parallel_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank,
                                                        placement_group_capture_child_tasks=False)
            actors.append(RankActor.options(
                scheduling_strategy=strategy, num_cpus=bundle[rank].get("CPU", 0), num_gpus=bundle[rank].get("GPU", 0),
                name=f"{RANK_ACTOR_PREFIX}{engine}-{rank}").remote(str(model_dir), options, rank, address))
        return cls(actors, [a.num_blocks.remote() for a in actors])

    def wait_ready(self, num_blocks: int, timeout_s: float) -> None:
        for rank, ref in enumerate(self._ready, start=1):
            try:
                got = ray.get(ref, timeout=timeout_s)
            except Exception as e:  # the actor failed to build its shard, or never started
                raise RankFailure(f"tensor-parallel rank {rank} failed to start: {type(e).__name__}: {e}") from None
            if got != num_blocks:
                raise RankFailure(f"tensor-parallel rank {rank} laid out {got} arena blocks, rank 0 {num_blocks}: "
                                  f"the ranks must hold the same pages and slots")

    def send(self, work) -> None:
        self._last = [a.run.remote(work) for a in self.actors]

    def report(self) -> str:
        parts = []
        for rank, ref in enumerate(self._last, start=1):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - what the rank reported
                    parts.append(f"rank {rank}: {type(e).__name__}: {str(e).splitlines()[0]}")
        return "; ".join(parts) or "no rank reported a fault (a hang?)"

    def close(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass
