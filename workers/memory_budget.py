"""How big the cache pools are, from the engine options and the model's shape (rule 7).

One budget in bytes pays for attention pages (held or cached) and recurrent-state checkpoints
(pending or stored); the prefix cache enforces it. Physical pools are sized so that either kind
alone can fill the budget: `num_pages` = budget // page bytes, `max_checkpoints` =
budget // checkpoint bytes, capped at `CHECKPOINT_SLOT_CAP`. Running sequences' own state slots
(`max_num_seqs`) are a fixed cost outside the budget.

Given `num_pages` without `cache_memory_bytes`, the budget is those pages plus room for the
checkpoints (`max_checkpoints`, default 256), so tests can size pools exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.model import ModelConfig
from workers.options import EngineOptions

DEFAULT_BUDGET = 256 * 2**20
CHECKPOINT_SLOT_CAP = 4096


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV page costs across all attention layers."""
    elem = torch.empty(0, dtype=dtype).element_size()
    return page_size * len(cfg.attention_layers) * 2 * cfg.num_key_value_heads * cfg.head_dim * elem


def checkpoint_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one recurrent-state slot costs across all linear layers (conv in dtype, ssm fp32)."""
    elem = torch.empty(0, dtype=dtype).element_size()
    per_layer = (cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * elem
                 + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    return len(cfg.linear_layers) * per_layer


@dataclass(frozen=True)
class MemoryBudget:
    budget_bytes: int
    page_bytes: int
    checkpoint_bytes: int
    num_pages: int
    max_checkpoints: int

    @classmethod
    def plan(cls, cfg: ModelConfig, options: EngineOptions, dtype: torch.dtype, max_model_len: int) -> "MemoryBudget":
        pb = page_bytes(cfg, options.page_size, dtype)
        cb = checkpoint_bytes(cfg, dtype)
        if options.num_pages:
            num_pages = options.num_pages
            slots = 0 if cb == 0 else (options.max_checkpoints if options.max_checkpoints is not None else 256)
            budget = options.cache_memory_bytes or num_pages * pb + slots * cb
        else:
            budget = options.cache_memory_bytes or DEFAULT_BUDGET
            # Without attention layers pages cost nothing: enough for every slot at full length.
            num_pages = max(1, budget // pb) if pb else options.max_num_seqs * -(-max_model_len // options.page_size)
            slots = 0 if cb == 0 else (options.max_checkpoints if options.max_checkpoints is not None
                                       else min(budget // cb, CHECKPOINT_SLOT_CAP))
        return cls(budget_bytes=budget, page_bytes=pb, checkpoint_bytes=cb, num_pages=num_pages,
                   max_checkpoints=slots)
