"""The vision tower loaded from a checkpoint gives the image embeddings transformers'
`Qwen3_5VisionModel` gives the language model (its `pooler_output`: the merged tokens; its
`last_hidden_state` is the blocks' output before merging), for grids of several shapes, for
several images at once, and from image bytes through preprocessing; the loader reads only the
tower and refuses a checkpoint that does not fit the config, naming the tensor."""

import copy
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

from cairn.workers.vision.image_processing import preprocess_image, read_preprocessor_config
from cairn.workers.vision import vision_config, vision_tower
from cairn.workers.vision.vision_config import CheckpointError, load_vision_config
from cairn.workers.vision.vision_tower import load_vision_tower
from tests.support.checkpoints import Q35_TEXT

# A 4x4 learned position grid, so every grid below resamples it (up, down, and unevenly).
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24, patch_size=4,
              num_position_embeddings=16)
GRIDS = {"non_square": (1, 4, 6), "larger_than_the_position_grid": (1, 10, 14), "one_merge_window": (1, 2, 2),
         "two_frames": (2, 4, 4)}
ATOL = 1e-5  # fp32; the same math in another order differs by ~1e-6 here


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A vision-language checkpoint directory: transformers' config.json and its random tower
    (every parameter perturbed, so LayerNorm's ones and zeros hide nothing) under `model.visual.*`,
    beside a language-model tensor the tower's loader must not take."""
    path = tmp_path_factory.mktemp("q35-vision")
    config = transformers.Qwen3_5Config(text_config=Q35_TEXT, vision_config=VISION)
    config.save_pretrained(path)
    torch.manual_seed(0)
    reference = Qwen3_5VisionModel(config.vision_config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    tensors = {f"model.visual.{k}": v.contiguous() for k, v in reference.state_dict().items()}
    tensors["model.language_model.embed_tokens.weight"] = torch.randn(8, 48)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, reference


@pytest.fixture(scope="module")
def tower(checkpoint):
    path, _ = checkpoint
    return load_vision_tower(path, load_vision_config(path), torch.float32, "cpu")


def patches(grids, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 4 * 4, generator=generator), grid_thw


@torch.no_grad()
def expected(reference, pixel_values, grid_thw) -> torch.Tensor:
    return reference(pixel_values, grid_thw=grid_thw).pooler_output


@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
@torch.no_grad()
def test_one_image_gives_transformers_embeddings(grid, checkpoint, tower):
    pixel_values, grid_thw = patches([grid])
    got = tower(pixel_values, grid_thw)
    t, h, w = grid
    assert got.shape == (t * h * w // 4, 24)
    torch.testing.assert_close(got, expected(checkpoint[1], pixel_values, grid_thw), atol=ATOL, rtol=0)


@torch.no_grad()
def test_two_images_at_once_equal_each_alone_and_transformers(checkpoint, tower):
    grids = [GRIDS["larger_than_the_position_grid"], GRIDS["non_square"]]
    pixel_values, grid_thw = patches(grids, seed=1)
    together = tower(pixel_values, grid_thw)
    torch.testing.assert_close(together, expected(checkpoint[1], pixel_values, grid_thw), atol=ATOL, rtol=0)
    first = grids[0][0] * grids[0][1] * grids[0][2]
    alone = torch.cat([tower(pixel_values[:first], grid_thw[:1]), tower(pixel_values[first:], grid_thw[1:])])
    torch.testing.assert_close(together, alone, atol=ATOL, rtol=0)


@torch.no_grad()
def test_image_bytes_give_the_embeddings_transformers_processor_and_tower_give(checkpoint, tower):
    raw = {"size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}, "patch_size": 4, "temporal_patch_size": 2,
           "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    rng = np.random.default_rng(0)
    data = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)).save(data, "PNG")
    image = preprocess_image(data.getvalue(), read_preprocessor_config(raw), max_source_pixels=10 ** 6)
    got = tower(torch.from_numpy(image.pixel_values), torch.tensor([image.grid_thw]))
    assert got.shape == (image.num_image_tokens, 24)

    theirs = Qwen2VLImageProcessorPil(**raw)(images=[Image.open(data)], return_tensors="pt")
    want = expected(checkpoint[1], theirs["pixel_values"], theirs["image_grid_thw"])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_a_bfloat16_tower_gives_transformers_bfloat16_embeddings_to_a_rounding(checkpoint):
    """bf16 rounding differs by one unit in the last place (2^-6 at these magnitudes of 2-4) where
    the patch embedding's matmul sums in another order than transformers' Conv3d."""
    path, reference = checkpoint
    half = load_vision_tower(path, load_vision_config(path), "bfloat16", "cpu")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    pixel_values, grid_thw = patches([GRIDS["larger_than_the_position_grid"], GRIDS["two_frames"]])
    want = expected(copy.deepcopy(reference).to(torch.bfloat16), pixel_values, grid_thw)
    torch.testing.assert_close(half(pixel_values, grid_thw), want, atol=2 ** -5, rtol=0)


def test_every_activation_a_config_may_name_is_one_the_tower_runs():
    assert sorted(vision_tower.ACTIVATIONS) == sorted(vision_config.ACTIVATIONS)


def test_pixels_that_do_not_match_the_grid_are_refused(tower):
    pixel_values, _ = patches([GRIDS["non_square"]])
    with pytest.raises(ValueError, match="expected 40 patches"):
        tower(pixel_values, torch.tensor([[1, 4, 10]]))
    with pytest.raises(ValueError, match="multiples of 2"):
        tower(pixel_values[:15], torch.tensor([[1, 3, 5]]))


def rewritten(checkpoint, tmp_path, change) -> Path:
    """A copy of the checkpoint whose tensors `change` edits in place."""
    path, _ = checkpoint
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("change, error", [
    (lambda t: t.pop("model.visual.blocks.1.attn.qkv.bias"),
     r"missing tensor 'model\.visual\.blocks\.1\.attn\.qkv\.bias'"),
    (lambda t: t.update({"model.visual.blocks.2.norm1.weight": torch.ones(32)}),
     r"unexpected tensor 'model\.visual\.blocks\.2\.norm1\.weight'"),
    (lambda t: t.update({"model.visual.pos_embed.weight": torch.zeros(25, 32)}),
     r"tensor 'model\.visual\.pos_embed\.weight' has shape \(25, 32\).*implies \(16, 32\)"),
], ids=["missing", "unexpected", "wrong_shape"])
def test_the_loader_refuses_a_checkpoint_that_does_not_fit_naming_the_tensor(checkpoint, tmp_path, change, error):
    path = rewritten(checkpoint, tmp_path, change)
    with pytest.raises(CheckpointError, match=error):
        load_vision_tower(path, load_vision_config(path))


def test_the_loader_reads_the_tower_from_sharded_checkpoints(checkpoint, tmp_path, tower):
    path, _ = checkpoint
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, held in shards.items():
        save_file({n: tensors[n] for n in held}, tmp_path / shard)
    index = {"weight_map": {n: shard for shard, held in shards.items() for n in held}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    sharded = load_vision_tower(tmp_path, load_vision_config(tmp_path))
    for name, value in tower.state_dict().items():
        torch.testing.assert_close(sharded.state_dict()[name], value, atol=0, rtol=0)
