"""Building an engine from a checkpoint directory (`Engine.from_pretrained`): the model on one
device, or rank 0's shard with ranks 1..N-1 started beside it (`cairn.workers.execution.tp_runner`);
the MTP head and the arena sized to what the weights (and decode graphs) left on the device, as
every rank sizes its own (`cairn.workers.sizing`, over `cairn.workers.cache.device_budget`); the
EOS ids generation_config.json adds; the tokenizer for structured outputs; a warm-up when asked.

`load_engine` takes the `EngineOptions` asked for, whole, and hands the same value to ranks
1..N-1 and to the sizing; the engine gets the sized value, a new one (the asked one is not
changed). With `num_speculative_tokens`, the checkpoint's MTP head is loaded too (refused where
there is none; each rank's share of it under tensor parallelism), and an arena sized from the
device's free memory leaves the verify steps' spare state slots (cairn.workers.cache.arena) and
the head's K/V (a page per block beside the arena: cairn.workers.speculative.mtp_drafter) their
shares (`device_budget.sized_for_speculation`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from cairn.cache_service.hashing import model_fingerprint
from cairn.workers.cache import device_budget
from cairn.workers.model import load_model, read_model_config
from cairn.workers.model.sharding import shard_config
from cairn.workers.engine_options import EngineOptions
from cairn.workers.execution.tp_runner import RankWorkers, free_address, load_rank_model
from cairn.workers.sizing import arena_sized, graph_rows, head_for
from cairn.workers.speculative.mtp_drafter import MtpDrafter


def generation_eos_ids(model_dir: Path) -> frozenset[int]:
    """EOS ids listed in generation_config.json (chat models end turns on more than one id)."""
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return frozenset()
    ids = eos if isinstance(eos, list) else [eos]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_engine(cls: type, model_dir: str | Path, asked: EngineOptions, worker_id: str = "local",
                start_ranks=None):
    """An engine of class `cls` (`cairn.workers.engine.Engine`) over the checkpoint in `model_dir`.
    `start_ranks` starts ranks 1..N-1 (default: local processes, `RankWorkers.start`; a Ray
    replica's actors: cairn.cluster.tp_ranks)."""
    path = Path(model_dir)
    workers = mtp = None
    if asked.tensor_parallel_size == 1:
        model = load_model(model_dir, dtype=asked.dtype, device=_pick_device(asked.device))
        p = next(model.parameters())
        mtp = head_for(path, asked, model)
        device = p.device
        graphs = device.type == "cuda" and not asked.enforce_eager
        reserve = device_budget.graph_reserve_bytes(model.config, graph_rows(asked, mtp is not None)) if graphs else 0
        device_budget.make_workspaces(device, p.dtype)
        sized = arena_sized(asked, model, mtp is not None, reserve)  # memory_utilization: what weights and graphs left
    else:
        shard_config(read_model_config(path / "config.json"), asked.tensor_parallel_size)  # fits?
        address = free_address()
        start = start_ranks or functools.partial(RankWorkers.start, drafter_type=MtpDrafter)
        workers = start(model_dir, asked, address)
    try:
        if workers is not None:
            model = load_rank_model(model_dir, asked, 0, address)
            mtp = head_for(path, asked, model)
            sized = arena_sized(asked, model, mtp is not None)  # the same on every rank
        engine = cls(model, sized, fingerprint=model_fingerprint(model_dir), worker_id=worker_id,
                     eos_token_ids=generation_eos_ids(path), rank_workers=workers, mtp=mtp)
        engine.use_tokenizer(path)
        engine.use_vision(path)
        if asked.warm_up:
            engine.warm_up()
        return engine
    except BaseException:
        if workers is not None:
            workers.close()
        raise
