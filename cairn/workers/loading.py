"""Building an engine from a checkpoint directory (`Engine.from_pretrained`): the model on one
device, or rank 0's shard with ranks 1..N-1 started beside it (`cairn.workers.execution.tp_runner`); the arena
sized to what the weights (and decode graphs) left on the device (`cairn.workers.cache.device_budget`);
the EOS ids generation_config.json adds; the tokenizer for structured outputs; a warm-up when
asked.

`load_engine` takes the `EngineOptions` asked for, whole, and hands the same value to ranks
1..N-1 and to the sizing; the engine gets the sized value, a new one (the asked one is not
changed). With `num_speculative_tokens`, the checkpoint's MTP head is loaded too (refused where
there is none; each rank's share of it under tensor parallelism), and an arena sized from the
device's free memory leaves the verify steps' spare state slots (cairn.workers.cache.arena) and
the head's K/V (a page per block beside the arena: cairn.workers.execution.mtp_drafter) their
shares (`device_budget.sized_for_speculation`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cairn.cache_service.hashing import model_fingerprint
from cairn.workers.cache import device_budget
from cairn.workers.model import load_model, read_model_config
from cairn.workers.model.mtp import MultiTokenPredictor, load_mtp
from cairn.workers.model.sharding import shard_config
from cairn.workers.engine_options import EngineOptionError, EngineOptions
from cairn.workers.execution.tp_runner import RankWorkers, free_address, load_rank_model


def generation_eos_ids(model_dir: Path) -> frozenset[int]:
    """EOS ids listed in generation_config.json (chat models end turns on more than one id)."""
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return frozenset()
    ids = eos if isinstance(eos, list) else [eos]
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def head_for(model_dir: Path, asked: EngineOptions, model) -> MultiTokenPredictor | None:
    """The checkpoint's MTP head beside `model` (this rank's share of it under tensor
    parallelism) when `asked` speculates; refused where the checkpoint has none."""
    if not asked.num_speculative_tokens:
        return None
    p = next(model.parameters())
    full = read_model_config(model_dir / "config.json")
    mtp = load_mtp(model_dir, full, p.dtype, p.device, cache_rank=len(model.config.attention_layers),
                   shard=model.shard, group=model.group)
    if mtp is None:
        raise EngineOptionError("num_speculative_tokens", f"num_speculative_tokens {asked.num_speculative_tokens}: "
                                f"the checkpoint in {model_dir} has no MTP head (no mtp.* tensors) to draft with")
    return mtp


def arena_sized(asked: EngineOptions, model, speculating: bool, reserve: int = 0) -> EngineOptions:
    """The options the arena is laid out from, sized from what `model`'s device has left less
    `reserve` (cairn.workers.cache.device_budget; under tensor parallelism, every rank alike over
    `model.group`), with the spare state slots and the head's K/V when `speculating`."""
    p = next(model.parameters())
    if speculating:
        return device_budget.sized_for_speculation(asked, model.config, p.dtype.itemsize, p.device, model.group,
                                                   reserve)
    return device_budget.sized(asked, p.device, model.group, reserve)


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
        rows = asked.max_num_seqs * (1 + (asked.num_speculative_tokens if asked.speculative_exact else 0))
        reserve = device_budget.graph_reserve_bytes(model.config, rows) if graphs else 0
        device_budget.make_workspaces(device, p.dtype)
        sized = arena_sized(asked, model, mtp is not None, reserve)  # memory_utilization: what weights and graphs left
    else:
        shard_config(read_model_config(path / "config.json"), asked.tensor_parallel_size)  # fits?
        address = free_address()
        workers = (start_ranks or RankWorkers.start)(model_dir, asked, address)
    try:
        if workers is not None:
            model = load_rank_model(model_dir, asked, 0, address)
            mtp = head_for(path, asked, model)
            sized = arena_sized(asked, model, mtp is not None)  # the same on every rank
        engine = cls(model, sized, fingerprint=model_fingerprint(model_dir), worker_id=worker_id,
                     eos_token_ids=generation_eos_ids(path), rank_workers=workers, mtp=mtp)
        engine.use_tokenizer(path)
        if asked.warm_up:
            engine.warm_up()
        return engine
    except BaseException:
        if workers is not None:
            workers.close()
        raise
