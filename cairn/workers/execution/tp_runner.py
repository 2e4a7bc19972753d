"""One engine across N devices: rank 0 schedules, every rank runs the same step on its shard.

Contract:
- `RankWorkers.start(model_dir, options, address)` starts ranks 1..N-1 (N =
  `options.tensor_parallel_size`), each a process that joins the `TPGroup` at `address`, loads its
  shard of the checkpoint (cairn.workers.model.sharding: only its part is read from disk) and,
  when speculating, its share of the MTP head, lays out its own arena from the same options, sized as rank 0 sizes its
  own (cairn.workers.sizing; per device: a rank's pages and state slots are its K/V heads and its
  recurrent heads of the same page and slot ids), and then runs whatever rank 0 sends
  (`RankExecutor`: steps, the copies between them, the MTP head's drafting), in order, until told
  to stop.
- `TensorParallelRunner(runner, workers)` is rank 0's runner: `execute(plan)` turns the plan into
  a `StepWork` once (cairn.workers.execution.runner), sends it to every rank, and runs it on its own shard. The
  model's collectives keep the ranks in step; rank 0 gets the full vocabulary's logits and
  samples. The scheduler, the prefix cache and the cache events exist on rank 0 only.
- Start: rank 0 waits until every rank's process has started (said so over its pipe) before it
  joins the group; a rank that exits first fails the engine at once, saying why this usually is
  (a script without an `if __name__ == "__main__":` guard, which every spawned rank imports
  again), instead of waiting for the group's rendezvous to time out.
- Failure: a rank that dies or hangs makes the step's collectives time out
  (`options.collective_timeout_s`) on the others; rank 0 then raises `RankFailure` (naming the
  rank and what it reported, if anything) from `execute`, and from every later call: the engine
  is broken and must be replaced. `close()` stops the ranks; it is also run when the runner is
  garbage collected or the process exits.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from cairn.workers.engine_errors import EngineBroken
from cairn.workers.engine_options import EngineOptions
from cairn.workers.execution.runner import ModelRunner
from cairn.workers.execution.step_work import SideWork, StepWork
from cairn.workers.plan import BlockCopy, StepPlan
from cairn.workers.sizing import arena_sized, head_for

T = TypeVar("T")

log = logging.getLogger(__name__)


class RankFailure(EngineBroken):
    """A tensor-parallel rank failed or stopped answering; the engine cannot go on."""


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(options: EngineOptions, rank: int) -> torch.device:
    """Rank r's device: cuda:r (of the devices this process sees) on CUDA, else the CPU."""
    want = options.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", rank) if want.startswith("cuda") else torch.device("cpu")


def load_rank_model(model_dir: str | Path, options: EngineOptions, rank: int, address: str,
                    device: torch.device | None = None):
    """Rank `rank`'s shard of the model on `device` (default: `rank_device`), joined to the
    others' group at `address`."""
    from cairn.workers.model import load_model
    from cairn.workers.model.sharding import Shard
    from cairn.workers.execution.tp_group import TPGroup

    world, device = options.tensor_parallel_size, device or rank_device(options, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL works on the current device
    group = TPGroup.connect(rank, world, address, backend_for(device), options.collective_timeout_s)
    return load_model(model_dir, dtype=options.dtype, device=device, shard=Shard(rank, world), group=group)


def build_rank_runner(model_dir: str | Path, asked: EngineOptions, rank: int, address: str,
                      device: torch.device | None = None, drafter_type=None) -> tuple[RankExecutor, int]:
    """A rank above 0: its shard (and its share of the MTP head when speculating, run by
    `drafter_type(runner, head)`: the engine's drafter class, cairn.workers.speculative.mtp_drafter,
    handed down by whoever starts the ranks), its arena laid out as rank 0's engine lays out its
    own (the options rank 0 was asked for, sized the same way, as many page-table rows), and the
    runner over it; with the arena's block count, which must equal rank 0's."""
    from cairn.workers.cache.arena import ArenaLayout
    from cairn.workers.vision.image_encoder import ImageEncoder

    model = load_rank_model(model_dir, asked, rank, address, device)
    head = head_for(Path(model_dir), asked, model)
    sized = arena_sized(asked, model, head is not None)  # the arena every rank agrees on
    layout = ArenaLayout.plan(model.config, sized, next(model.parameters()).dtype.itemsize)
    runner = ModelRunner(model, layout, sized.page_size, sized.max_num_seqs + 1)
    runner.encoder = ImageEncoder.load(model_dir, model)  # every rank encodes a step's images itself
    drafter = None
    if head is not None:
        if drafter_type is None:
            raise ValueError("a speculating rank needs the drafter that runs its share of the MTP head")
        drafter = drafter_type(runner, head)
    return RankExecutor(runner, drafter), layout.num_blocks


class RankExecutor:
    """What a rank above 0 runs: each `StepWork` (a step), `SideWork` (copies between steps) and
    `DraftWork` (the MTP head's pass and draft rounds) rank 0 sends, in order."""

    def __init__(self, runner: ModelRunner, drafter=None):
        self.runner, self.drafter = runner, drafter

    def handle(self, work) -> None:
        if isinstance(work, StepWork):
            self.runner.run(work)
        elif isinstance(work, SideWork):
            self.runner.side(work)
        else:
            self.drafter.run(work)


MAIN_GUARD = ("a script that builds a tensor-parallel engine must do so under `if __name__ == \"__main__\":`: "
              "its ranks are spawned processes, which import the script again")


def _rank_main(model_dir: str, options: EngineOptions, rank: int, address: str, conn, drafter_type=None) -> None:
    """A rank's process: say it started, build, report its layout, then run everything it is sent."""
    torch.set_num_threads(1)
    conn.send(("started", None))
    try:
        executor, num_blocks = build_rank_runner(model_dir, options, rank, address, drafter_type=drafter_type)
        conn.send(("ready", num_blocks))
        while (work := conn.recv()) is not None:
            executor.handle(work)
    except EOFError:  # rank 0 went away
        return
    except BaseException as e:  # reported to rank 0, whose collectives time out meanwhile
        try:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
        except (OSError, EOFError):
            pass


class RankWorkers:
    """Rank 0's handle on ranks 1..N-1: one process and one pipe each."""

    def __init__(self, processes: list, conns: list):
        self.processes, self.conns = processes, conns
        self._finalizer = weakref.finalize(self, RankWorkers._stop, processes, conns)

    START_TIMEOUT_S = 120.0  # a rank's process imports torch and cairn before it says it started

    @classmethod
    def start(cls, model_dir: str | Path, options: EngineOptions, address: str, drafter_type=None) -> RankWorkers:
        """Spawns ranks 1..N-1 and waits until each has started (before any loads its shard);
        `drafter_type`: see `build_rank_runner` (pickled by reference into each rank)."""
        if getattr(mp.current_process(), "_inheriting", False):  # a spawned process importing its parent's script
            raise RuntimeError(MAIN_GUARD)
        ctx = mp.get_context("spawn")
        processes, conns = [], []
        for rank in range(1, options.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(str(model_dir), options, rank, address, theirs, drafter_type),
                            name=f"cairn-tp-rank-{rank}", daemon=True)
            p.start()
            theirs.close()
            processes.append(p)
            conns.append(ours)
        workers = cls(processes, conns)
        try:
            workers._wait_started(cls.START_TIMEOUT_S)
        except BaseException:
            workers.close()
            raise
        return workers

    def _wait_started(self, timeout_s: float) -> None:
        """Each rank's first word; a rank that exits first never got past importing the script
        that started it (no `__main__` guard, most likely), and waiting for it would only end in
        the collectives' timeout."""
        deadline = time.monotonic() + timeout_s
        for rank, (p, conn) in enumerate(zip(self.processes, self.conns), start=1):
            while not conn.poll(0.1):
                if p.exitcode is not None:
                    raise RankFailure(f"tensor-parallel rank {rank} exited (status {p.exitcode}) before it started; "
                                      f"{MAIN_GUARD}")
                if time.monotonic() > deadline:
                    raise RankFailure(f"tensor-parallel rank {rank} did not start within {timeout_s:.0f} s")
            try:
                conn.recv()
            except EOFError:
                raise RankFailure(f"tensor-parallel rank {rank} exited before it started; {MAIN_GUARD}") from None

    def wait_ready(self, num_blocks: int, timeout_s: float) -> None:
        """Every rank built its shard with an arena of `num_blocks` blocks (rank 0's)."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout_s):
                raise RankFailure(f"tensor-parallel rank {rank} did not start within {timeout_s:.0f} s")
            kind, value = conn.recv()
            if kind == "error":
                raise RankFailure(f"tensor-parallel rank {rank} failed to start: {value}")
            if value != num_blocks:
                raise RankFailure(f"tensor-parallel rank {rank} laid out {value} arena blocks, rank 0 "
                                  f"{num_blocks}: the ranks must hold the same pages and slots")

    def send(self, work: StepWork) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(work)
            except (OSError, EOFError):
                raise RankFailure(f"tensor-parallel rank {rank} is gone") from None

    def report(self) -> str:
        """What the ranks said or how they ended, for an error message."""
        parts = []
        for rank, (p, conn) in enumerate(zip(self.processes, self.conns), start=1):
            p.join(timeout=1.0)  # a rank that just died: let it be reaped, so it is named
            said = ""
            try:
                while conn.poll(0):
                    kind, value = conn.recv()
                    said = value if kind == "error" else said
            except (OSError, EOFError):
                pass
            if said or not p.is_alive():
                parts.append(f"rank {rank}: " + (said.splitlines()[0] if said else f"exited ({p.exitcode})"))
        return "; ".join(parts) or "no rank reported a fault (a hang?)"

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _stop(processes: list, conns: list) -> None:
        for conn in conns:
            try:
                conn.send(None)
            except (OSError, EOFError):
                pass
        for p in processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for conn in conns:
            conn.close()


class TensorParallelRunner:
    """Rank 0's runner: the same interface as `ModelRunner` for the engine. What changes the
    ranks' devices (a step, copies between steps, the MTP head's drafting) is sent to every rank
    and made on rank 0's own (`dispatch`); everything else is rank 0's runner's."""

    def __init__(self, runner: ModelRunner, workers: RankWorkers):
        self.local, self.workers = runner, workers
        self.caches, self.device = runner.caches, runner.device
        self.failure: str | None = None

    def execute(self, plan: StepPlan, all_logits: bool = False) -> torch.Tensor:
        if self.failure is not None:
            raise RankFailure(self.failure)
        work = self.local.prepare(plan, all_logits)
        return self.dispatch(work, lambda: self.local.run(work))

    def dispatch(self, work, local: Callable[[], T]) -> T:
        """Sends `work` (a `StepWork`, `SideWork` or `DraftWork`) to every rank, then runs
        `local()` (rank 0's part of it); a fault of either breaks the engine (`RankFailure`,
        from this call and every later one)."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        try:
            self.workers.send(work)
            return local()
        except Exception as e:
            cause = str(e).splitlines()[0][:200] if str(e) else ""
            self.failure = f"tensor-parallel step failed ({type(e).__name__}: {cause}); {self.workers.report()}"
            raise RankFailure(self.failure) from e

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.dispatch(SideWork(state_copies=list(pairs)), lambda: self.local.copy_states(pairs))

    def snapshot(self, plan: StepPlan) -> None:
        if plan.snapshots or plan.host_snapshots:
            self.dispatch(SideWork(state_copies=list(plan.snapshots), host_snapshots=list(plan.host_snapshots)),
                          lambda: self.local.snapshot(plan))

    def apply_copies(self, copies: list[BlockCopy], staging=None, row_staging=()) -> None:
        # (peer fetch is refused with tensor parallelism: cairn.workers.engine_peer_fetch)
        if staging is not None or row_staging:
            raise ValueError("imported blocks are one rank's bytes: no import under tensor parallelism")
        if copies:
            self.dispatch(SideWork(block_copies=list(copies)), lambda: self.local.apply_copies(copies))

    def __getattr__(self, name: str):  # everything else (arena views, page table) is rank 0's runner's
        return getattr(self.local, name)

    def close(self) -> None:
        self.workers.close()
