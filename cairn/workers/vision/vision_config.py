"""The shape of a Qwen3.5 / Qwen3.6 vision tower, read from a checkpoint's `config.json`. No torch:
the ingress and the deploy step read it to count image tokens without loading a model.

Contract:
- `read_vision_config(raw, source)` gives a `VisionConfig` for a vision-language checkpoint
  (`vision_config` beside `text_config`, as `Qwen3_5ForConditionalGeneration` writes it, dense or
  MoE), and None for one without a `vision_config` (Qwen3-Next, the text-only Qwen3.5 layouts).
- Every size the forward pass depends on is required: a missing or non-positive one is a
  `CheckpointError` (a ValueError) naming the file and the field. We never guess a size. What
  transformers' `Qwen3_5VisionConfig` defaults without changing a shape (the activation, the
  rotary base) takes transformers' default.
- Refused: a head size the 2-D rotary cannot split (it needs a multiple of 4), a position table
  that is not a square grid, an activation we do not run, a rotary type other than axial.
- The image token ids are the top-level ones, as transformers reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cairn.workers.model.model_config import BOOKKEEPING, CheckpointError, ConfigReader, read_json

# transformers' ACT2FN names whose exact torch function cairn.workers.vision.vision_tower runs.
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "quick_gelu", "silu")
# Fields of published vision configs that do not change the tower's forward pass: Qwen3.5 has no
# deepstack mergers (transformers deletes them from Qwen3-VL's tower), so its index list is unread.
NOT_READ = ("deepstack_visual_indexes",)


@dataclass(frozen=True)
class VisionConfig:
    depth: int  # vision blocks
    hidden_size: int
    intermediate_size: int  # each block's MLP
    num_heads: int
    in_channels: int
    patch_size: int  # pixels per patch side
    temporal_patch_size: int  # frames per patch (a still image is repeated to fill it)
    spatial_merge_size: int  # patches per merged token side: merge^2 patches make one LLM token
    out_hidden_size: int  # the language model's hidden size
    num_position_embeddings: int  # the learned position table: a square grid of this many rows
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    source: str = field(default="config.json", compare=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x frames x pixels x pixels."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one image token."""
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid."""
        return math.isqrt(self.num_position_embeddings)

    def check(self, bad) -> None:
        """Refuses shapes the tower cannot be built with; `bad(field, why)` makes the error."""
        if self.hidden_size % self.num_heads:
            raise bad("num_heads", f"({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        if self.head_dim % 4:
            raise bad("hidden_size", f"gives head dim {self.head_dim}; the 2-D rotary needs a multiple of 4")
        if self.grid_side ** 2 != self.num_position_embeddings:
            raise bad("num_position_embeddings", f"is {self.num_position_embeddings}; expected a square "
                      "(the learned positions are a square grid)")
        if self.hidden_act not in ACTIVATIONS:
            raise bad("hidden_act", f"is {self.hidden_act!r}; expected one of {list(ACTIVATIONS)}")


SIZES = ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
         "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings")
TOKEN_IDS = ("image_token_id", "vision_start_token_id", "vision_end_token_id")


def read_vision_config(raw: dict[str, Any], source: str = "config.json") -> VisionConfig | None:
    """The vision tower of a `config.json` (as a dict), or None when it has none."""
    vision = raw.get("vision_config")
    if vision is None:
        return None
    top = ConfigReader(raw, source)
    if not isinstance(vision, dict):
        raise top.bad("vision_config", f"must be an object, got {type(vision).__name__}")
    r = ConfigReader(vision, source, prefix="vision_config.")
    r.ignore(*BOOKKEEPING, *NOT_READ)
    rope = r.opt("rope_parameters", None) or {}
    if not isinstance(rope, dict):
        raise r.bad("rope_parameters", f"must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", "axial")
    if rope_type not in ("axial", "default"):
        raise r.bad("rope_parameters.rope_type", f"is {rope_type!r}; the vision tower runs axial 2-D RoPE only")
    token_ids = {}
    for name in TOKEN_IDS:
        value = top.opt(name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise top.bad(name, "is missing" if value is None else f"must be a token id, got {value!r}")
        token_ids[name] = value
    cfg = VisionConfig(**{name: r.need(name) for name in SIZES}, **token_ids,
                       hidden_act=str(r.opt("hidden_act", "gelu_pytorch_tanh")),
                       rope_theta=float(rope.get("rope_theta", 10000.0)), source=source)
    cfg.check(r.bad)
    r.warn_unread()
    return cfg


def load_vision_config(model_dir: str | Path) -> VisionConfig | None:
    """The vision tower of the checkpoint in `model_dir`, or None when it has none."""
    path = Path(model_dir) / "config.json"
    return read_vision_config(read_json(path), str(path))

