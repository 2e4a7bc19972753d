"""The model's shape, read from a Hugging Face `config.json` of `model_type: qwen3_next`.

Contract:
- `ModelConfig.from_file(path)` accepts what transformers' `Qwen3NextConfig` writes
  (`layer_types`, `rope_parameters`) and the older spelling the published Qwen3-Next checkpoints
  use (`full_attention_interval`, top-level `rope_theta` / `partial_rotary_factor`).
- Anything we cannot run raises `CheckpointError` naming the file and the field, so the person
  holding the checkpoint knows what to change. We never guess a missing size.
- Derived sizes (`key_dim`, `conv_dim`, which layers are MoE) live here so the model, the pools
  and the loader agree on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint directory we cannot load; the message names the file and the field."""


LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    source: str = field(default="config.json", compare=False)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def value_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def has_recurrent_layers(self) -> bool:
        return bool(self.linear_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: not found (a checkpoint directory needs config.json)") from None
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        def bad(field_name: str, why: str) -> CheckpointError:
            return CheckpointError(f"{source}: field '{field_name}' {why}")

        model_type = raw.get("model_type")
        if model_type != "qwen3_next":
            raise bad("model_type", f"is {model_type!r}; cairn runs 'qwen3_next' models")

        def need(name: str, kind: type = int) -> Any:
            if name not in raw or raw[name] is None:
                raise bad(name, "is missing")
            value = raw[name]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise bad(name, f"must be a positive integer, got {value!r}")
            return value

        def opt(name: str, default: Any) -> Any:
            value = raw.get(name)
            return default if value is None else value

        num_layers = need("num_hidden_layers")
        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        layer_types = raw.get("layer_types")
        if layer_types is None:
            interval = opt("full_attention_interval", 4)
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
        if len(layer_types) != num_layers:
            raise bad("layer_types", f"has {len(layer_types)} entries for {num_layers} layers")
        unknown = sorted({t for t in layer_types if t not in (LINEAR, FULL)})
        if unknown:
            raise bad("layer_types", f"has unsupported types {unknown}; expected {LINEAR!r} or {FULL!r}")

        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise bad("rope_parameters.rope_type", f"is {rope_type!r}; only 'default' RoPE is supported")
        rope_theta = rope.get("rope_theta", opt("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", opt("partial_rotary_factor", 0.25))

        act = opt("hidden_act", "silu")
        if act != "silu":
            raise bad("hidden_act", f"is {act!r}; only 'silu' is supported")

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

        cfg = cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=opt("num_key_value_heads", heads),
            head_dim=opt("head_dim", hidden // heads),
            layer_types=tuple(layer_types),
            rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=opt("max_position_embeddings", 32768),
            attention_bias=bool(opt("attention_bias", False)),
            tie_word_embeddings=bool(opt("tie_word_embeddings", False)),
            linear_conv_kernel_dim=opt("linear_conv_kernel_dim", 4),
            linear_key_head_dim=opt("linear_key_head_dim", 128),
            linear_value_head_dim=opt("linear_value_head_dim", 128),
            linear_num_key_heads=opt("linear_num_key_heads", 16),
            linear_num_value_heads=opt("linear_num_value_heads", 32),
            num_experts=opt("num_experts", 0),
            num_experts_per_tok=opt("num_experts_per_tok", 0),
            moe_intermediate_size=opt("moe_intermediate_size", 0),
            shared_expert_intermediate_size=opt("shared_expert_intermediate_size", 0),
            decoder_sparse_step=opt("decoder_sparse_step", 1),
            norm_topk_prob=bool(opt("norm_topk_prob", True)),
            mlp_only_layers=tuple(opt("mlp_only_layers", ())),
            hidden_act=act,
            torch_dtype=str(opt("dtype", opt("torch_dtype", "float32"))),
            eos_token_ids=eos_ids,
            source=source,
        )
        cfg._check(bad)
        return cfg

    def _check(self, bad) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"({self.num_key_value_heads}) must divide "
                      f"num_attention_heads ({self.num_attention_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_value_heads", f"({self.linear_num_value_heads}) must be a multiple "
                      f"of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise bad("partial_rotary_factor", f"gives rotary dim {self.rotary_dim}; expected an even "
                      f"number in (0, head_dim={self.head_dim}]")
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise bad("num_experts_per_tok", f"is {self.num_experts_per_tok}; expected 1..{self.num_experts}")
        if self.linear_conv_kernel_dim < 2:
            raise bad("linear_conv_kernel_dim", f"is {self.linear_conv_kernel_dim}; expected >= 2")
        if self.torch_dtype not in ("float32", "bfloat16", "float16"):
            raise bad("dtype", f"is {self.torch_dtype!r}; expected float32, bfloat16 or float16")
