"""`Family`: what a model family gives cairn, so that adding one is one module plus one line in
cairn.workers.model.family_registry, and the prefix cache, the pools and the router need no change.

A family provides:
- `model_types`: the `config.json` `model_type` values it reads (a vision-language wrapper and
  its text-only config are both listed when both are published), and
- `read_config(raw, source)`: that `config.json` as a `ModelConfig` (cairn.workers.model.model_config), every
  field accounted for, anything it cannot run refused with a `CheckpointError` naming the field;
  both are its line in cairn.workers.model.model_types, which reads configs without torch;
- `model_class`: a `HybridForCausalLM` subclass (cairn.workers.model.hybrid) whose recurrent layer keeps
  its state in the slot-indexed pools (`ModelConfig.conv_state_shape`, `ssm_state_shape`);
- `tensor_name(name)`: a checkpoint tensor's name in the model, or None for a tensor that is
  skipped without being read (a vision tower, multi-token-prediction heads). Per-expert MoE
  tensors are fused by the loader after renaming (cairn.workers.model.loader);
- `shard_rules`: for tensor parallelism, the split of the tensors only this family has (its
  recurrent layer's input projections), by name suffix; the shared layers' split is
  cairn.workers.model.sharding's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cairn.workers.model.model_config import ModelConfig
from cairn.workers.model.model_types import FAMILY_CONFIGS


@dataclass(frozen=True)
class Family:
    name: str  # its key in cairn.workers.model.model_types.FAMILY_CONFIGS: its model types and config reader
    model_class: type  # a cairn.workers.model.hybrid.HybridForCausalLM subclass
    tensor_name: Callable[[str], str | None]
    shard_rules: Mapping[str, Callable] = field(default_factory=dict)  # suffix -> cairn.workers.model.sharding.Rule

    @property
    def model_types(self) -> tuple[str, ...]:
        return FAMILY_CONFIGS[self.name][0]

    @property
    def read_config(self) -> Callable[[dict[str, Any], str], ModelConfig]:
        return FAMILY_CONFIGS[self.name][1]
