"""What an engine is sized to, from the options asked and the model loaded: whether it drafts
(the checkpoint's MTP head), how many rows its decode graphs hold, and its arena. Every rank
derives them alike: rank 0 as it builds the engine (cairn.workers.loading), ranks 1..N-1 as they
build theirs (cairn.workers.execution.tp_runner), each from the same asked `EngineOptions`, at
the same point of its start (after loading its shard), so that all lay out the same arena.

Contract:
- `head_for(model_dir, asked, model)`: the checkpoint's MTP head beside `model` (this rank's
  share of it under tensor parallelism: `model.shard`, `model.group`) when `asked` speculates
  (`num_speculative_tokens` > 0), else None. `require_head(options, head, checkpoint)` is the one
  refusal of an engine asked to speculate without a head (`EngineOptionError` on
  `num_speculative_tokens`); `head_for` makes it, naming the checkpoint's folder, and so may
  anything handed a head it did not load.
- `graph_depth(options, drafting)`: the levels of rows past the first that a decode graph's
  bucket holds: `num_speculative_tokens` for an engine that drafts (`drafting`: it has a head) in
  the exact mode, whose verify steps run through the decode kernels (k + 1 rows a sequence),
  else 0. `graph_rows(options, drafting)`: the rows of the largest bucket,
  `max_num_seqs * (1 + depth)`, what `device_budget.graph_reserve_bytes` estimates the decode
  graphs' memory for (cairn.workers.execution.decode_graphs).
- `arena_sized(asked, model, drafting, reserve)`: the options the arena is laid out from, a new
  value (`asked` is never changed): with `memory_utilization`, sized from what `model`'s device
  has left less `reserve` bytes (under tensor parallelism the smallest over `model.group`), and
  with the verify steps' spare state slots and the head's K/V taken out first when `drafting`
  (cairn.workers.cache.device_budget); `asked` itself otherwise.
"""

from __future__ import annotations

from pathlib import Path

from cairn.workers.cache import device_budget
from cairn.workers.engine_options import EngineOptionError, EngineOptions
from cairn.workers.model import read_model_config
from cairn.workers.model.mtp import MultiTokenPredictor, load_mtp


def require_head(options: EngineOptions, head: MultiTokenPredictor | None,
                 checkpoint: str = "the checkpoint") -> None:
    """Refuses `options` when they speculate and `head` is None: `checkpoint` (how the message
    names where the head was looked for) has none to draft with."""
    if options.num_speculative_tokens and head is None:
        raise EngineOptionError("num_speculative_tokens", f"num_speculative_tokens {options.num_speculative_tokens}: "
                                f"{checkpoint} has no MTP head (no mtp.* tensors) to draft with")


def head_for(model_dir: Path, asked: EngineOptions, model) -> MultiTokenPredictor | None:
    """The checkpoint's MTP head beside `model` (this rank's share of it under tensor
    parallelism) when `asked` speculates; refused where the checkpoint has none."""
    if not asked.num_speculative_tokens:
        return None
    p = next(model.parameters())
    full = read_model_config(model_dir / "config.json")
    mtp = load_mtp(model_dir, full, p.dtype, p.device, cache_rank=len(model.config.attention_layers),
                   shard=model.shard, group=model.group)
    require_head(asked, mtp, f"the checkpoint in {model_dir}")
    return mtp


def graph_depth(options: EngineOptions, drafting: bool) -> int:
    """The levels of rows past the first a decode graph's bucket holds (see the module doc)."""
    return options.num_speculative_tokens if drafting and options.speculative_exact else 0


def graph_rows(options: EngineOptions, drafting: bool) -> int:
    """The rows of the decode graphs' largest bucket: every running sequence, at `graph_depth`."""
    return options.max_num_seqs * (1 + graph_depth(options, drafting))


def arena_sized(asked: EngineOptions, model, drafting: bool, reserve: int = 0) -> EngineOptions:
    """The options the arena is laid out from, sized from what `model`'s device has left less
    `reserve` (every rank alike over `model.group`), with the spare state slots and the head's
    K/V when `drafting` (see the module doc)."""
    p = next(model.parameters())
    if drafting:
        return device_budget.sized_for_speculation(asked, model.config, p.dtype.itemsize, p.device, model.group,
                                                   reserve)
    return device_budget.sized(asked, p.device, model.group, reserve)
