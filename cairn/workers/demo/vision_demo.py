"""The demo checkpoint's vision part (`write_demo_model(..., vision=True)`): what makes a Qwen3.5
demo model a vision-language one in the published layout.

Contract, for a `DemoSize` and a seed:
- `VISION_TOKENS` are added to the demo tokenizer as special tokens, after its control tokens (the
  text tokens keep their ids: a text prompt tokenizes as on the text-only demo model);
- `vision_language_config(text_config, size, token_ids)`: the published `*ForConditionalGeneration`
  config, the text config under `text_config`, a tiny tower under `vision_config`, the vision
  token ids at the top;
- `preprocessor_config(size)`: transformers' Qwen2-VL image processor fields with small pixel
  bounds (an image becomes at most `MAX_TOKENS[size]` tokens: cheap on a CPU);
- `vision_language_weights(text_weights, vision_config, seed)`: the text tensors renamed under
  `model.language_model.*` (the LM head stays `lm_head`), beside a random tower under
  `model.visual.*` (LayerNorms at one and zero, the rest normal with std fan_in^-1/2), every
  name and shape the tower's loader expects (cairn.workers.vision.vision_tower).
Deterministic: same arguments, same bytes.
"""

from __future__ import annotations

import math

import torch

from cairn.workers.demo.shape import DemoSize

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH, MERGE, TEMPORAL = 16, 2, 2  # the published patch, merge and temporal patch sizes
MAX_TOKENS = {"tiny": 16, "bench": 64}  # image tokens at most, at the demo's max_pixels


def vision_tower_config(size: DemoSize) -> dict:
    tiny = size.hidden_size <= 64
    return {
        "model_type": "qwen3_5", "depth": 1 if tiny else 2, "hidden_size": 32 if tiny else 128,
        "intermediate_size": 64 if tiny else 256, "num_heads": 2 if tiny else 4, "in_channels": 3,
        "patch_size": PATCH, "temporal_patch_size": TEMPORAL, "spatial_merge_size": MERGE,
        "out_hidden_size": size.hidden_size, "num_position_embeddings": 64 if tiny else 256,
        "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.02, "deepstack_visual_indexes": [],
    }


def vision_language_config(text_config: dict, size: DemoSize, token_ids: dict[str, int]) -> dict:
    """`token_ids`: the ids of `VISION_TOKENS` by token."""
    moe = text_config["model_type"] == "qwen3_5_moe_text"
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text_config,
        "vision_config": vision_tower_config(size),
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


def preprocessor_config(size_name: str) -> dict:
    side = PATCH * MERGE
    return {
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE, "min_pixels": side * side, "max_pixels": MAX_TOKENS[size_name] * side * side,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "resample": 3,
    }


def vision_language_weights(text: dict[str, torch.Tensor], tower_config: dict, seed: int) -> dict[str, torch.Tensor]:
    from cairn.workers.vision.vision_config import SIZES, read_vision_config
    from cairn.workers.vision.vision_tower import VisionTower

    out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in text.items()}
    ids = dict(image_token_id=0, vision_start_token_id=0, vision_end_token_id=0)  # unread by the tower's shapes
    cfg = read_vision_config({"vision_config": {k: tower_config[k] for k in SIZES + ("hidden_act",)}, **ids})
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in VisionTower(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in shapes.items():
        if "norm" in name and name.endswith("weight"):
            t = torch.ones(shape)
        elif name.endswith("bias"):
            t = torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, math.prod(shape[1:]) ** -0.5 if len(shape) > 1 else 1.0,
                                          generator=gen)
        out["model.visual." + name] = t
    return out
