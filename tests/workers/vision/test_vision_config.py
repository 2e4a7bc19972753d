"""A checkpoint's vision tower is read from its `config.json` as transformers writes it, dense and
MoE; a missing or impossible field is an error that names it; a checkpoint without a tower has
none; and reading it loads no torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from cairn.workers.vision.vision_config import CheckpointError, load_vision_config, read_vision_config
from tests.support.checkpoints import BASE, Q35_TEXT

ROOT = Path(__file__).resolve().parents[3]
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24, patch_size=4,
              num_position_embeddings=16)


def saved_config(tmp_path: Path, config) -> dict:
    config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("config_class", ["Qwen3_5Config", "Qwen3_5MoeConfig"])
def test_a_vision_language_config_gives_its_tower_and_image_token_ids(tmp_path, config_class, caplog):
    text = dict(Q35_TEXT) if config_class == "Qwen3_5Config" else dict(Q35_TEXT, num_experts=4, num_experts_per_tok=2)
    hf = getattr(transformers, config_class)(text_config=text, vision_config=VISION, image_token_id=201)
    saved_config(tmp_path, hf)
    cfg = load_vision_config(tmp_path)
    v = hf.vision_config
    assert (cfg.depth, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads) == (2, 32, 48, 2)
    assert (cfg.in_channels, cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size) == \
        (v.in_channels, 4, v.temporal_patch_size, v.spatial_merge_size)
    assert (cfg.out_hidden_size, cfg.num_position_embeddings, cfg.hidden_act) == (24, 16, v.hidden_act)
    assert cfg.rope_theta == v.rope_parameters["rope_theta"]
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == \
        (201, hf.vision_start_token_id, hf.vision_end_token_id)
    assert (cfg.head_dim, cfg.patch_dim, cfg.merge_unit, cfg.grid_side) == (16, 3 * 2 * 4 * 4, 4, 4)
    assert not caplog.records, "every field transformers writes is accounted for"


@pytest.fixture
def raw(tmp_path) -> dict:
    return saved_config(tmp_path, transformers.Qwen3_5Config(text_config=Q35_TEXT, vision_config=VISION))


@pytest.mark.parametrize("name", ["depth", "hidden_size", "patch_size", "spatial_merge_size", "out_hidden_size"])
def test_a_missing_size_is_an_error_naming_it(raw, name):
    del raw["vision_config"][name]
    with pytest.raises(CheckpointError, match=rf"field 'vision_config\.{name}' is missing"):
        read_vision_config(raw, "ckpt/config.json")


def test_a_missing_image_token_id_is_an_error_naming_it(raw):
    del raw["image_token_id"]
    with pytest.raises(ValueError, match=r"ckpt/config.json: field 'image_token_id' is missing"):
        read_vision_config(raw, "ckpt/config.json")


@pytest.mark.parametrize("change, field, why", [
    (dict(num_heads=3), "num_heads", "must divide hidden_size"),
    (dict(hidden_size=36, num_heads=6), "hidden_size", "multiple of 4"),
    (dict(num_position_embeddings=18), "num_position_embeddings", "square"),
    (dict(hidden_act="relu"), "hidden_act", "'relu'"),
    (dict(depth=0), "depth", "positive integer"),
    (dict(patch_size=[16, 16]), "patch_size", "positive integer"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_parameters.rope_type", "axial"),
])
def test_a_shape_the_tower_cannot_take_is_an_error_naming_the_field(raw, change, field, why):
    raw["vision_config"].update(change)
    with pytest.raises(CheckpointError, match=rf"field 'vision_config\.{field}' .*{why}"):
        read_vision_config(raw, "config.json")


def test_checkpoints_without_a_tower_have_none(tmp_path):
    next_raw = saved_config(tmp_path / "next", transformers.Qwen3NextConfig(**BASE))
    text_only = saved_config(tmp_path / "text", transformers.Qwen3_5TextConfig(**Q35_TEXT))
    assert read_vision_config(next_raw) is None
    assert read_vision_config(text_only) is None


def test_reading_a_vision_config_loads_no_torch():
    probe = ("import sys\nimport cairn.workers.vision.vision_config, cairn.workers.vision.image_processing\n"
             "import cairn.workers.vision as v; v.VisionConfig; v.preprocess_image\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False"
