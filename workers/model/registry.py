"""Which family runs a checkpoint: `config.json`'s `model_type` -> workers.model.family.Family.

Adding a family is one module (workers/model/<family>.py, exporting its `Family`) plus its line
in `FAMILIES` below. `family_for` and `read_model_config` refuse a `model_type` nobody
registered, naming the ones that are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.model import qwen3_5, qwen3_next
from workers.model.config import CheckpointError, ModelConfig, read_json
from workers.model.family import Family

FAMILIES: tuple[Family, ...] = (
    qwen3_next.FAMILY,
    *qwen3_5.FAMILIES,
)
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_NAME = {f.name: f for f in FAMILIES}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def family_for(raw: dict[str, Any], source: str = "config.json") -> Family:
    model_type = raw.get("model_type")
    if model_type not in _BY_MODEL_TYPE:
        raise CheckpointError(f"{source}: field 'model_type' is {model_type!r}; cairn runs "
                              f"{', '.join(repr(t) for t in supported_model_types())}")
    return _BY_MODEL_TYPE[model_type]


def family_named(name: str) -> Family:
    """The family a `ModelConfig.model_type` names."""
    return _BY_NAME[name]


def config_from_dict(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    return family_for(raw, source).read_config(raw, source)


def read_model_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of a checkpoint's `config.json`, whichever registered family wrote it."""
    return config_from_dict(read_json(path), str(path))
