"""The shape of a hybrid model, whatever family wrote its `config.json`.

Contract:
- `ModelConfig` is the one description every part of cairn sizes itself from: the model
  classes, the loader, the arena (`page_bytes`, the recurrent state shapes) and the engine spec.
  A family (cairn.workers.model.family_registry) turns its own `config.json` into this value.
- `ConfigReader` is how a family reads a `config.json`: `need`/`opt` take fields, `bad` makes the
  error, and `reject_unknown_values` / `unread` let a family account for every field it was
  given. Anything we cannot run raises `CheckpointError` naming the file and the field, so the
  person holding the checkpoint knows what to change. We never guess a missing size.
- `read_hybrid_fields` reads the fields every Gated DeltaNet + gated-attention family shares
  (transformers' `Qwen3NextConfig` spelling, and the older one published Qwen3-Next checkpoints
  use: `full_attention_interval`, top-level `rope_theta` / `partial_rotary_factor`).
- Derived sizes (`key_dim`, `conv_dim`, the state shapes, which layers are MoE) live here so the
  model, the pools and the loader agree on them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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
    model_type: str = "qwen3_next"  # the family (cairn.workers.model.family_registry) that runs it
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    # M-RoPE (Qwen3.5): frequencies split into (temporal, height, width) sections. A text token
    # has all three positions equal, so for text it is the plain rotation; kept for the fingerprint.
    mrope_section: tuple[int, ...] = ()
    mrope_interleaved: bool = False
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
    # layers of the checkpoint's multi-token-prediction head (`mtp.*`, cairn.workers.model.mtp);
    # the target's computation does not depend on it
    mtp_num_hidden_layers: int = field(default=0, compare=False)
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
    def recurrent(self) -> bool:
        return bool(self.linear_layers)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """One recurrent layer's convolution window: [channels, kernel - 1], in the model dtype."""
        return (self.conv_dim, self.linear_conv_kernel_dim - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """One recurrent layer's state matrix per head: [heads, key dim, value dim], in fp32."""
        return (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def check(self, bad) -> None:
        """Refuses shapes the model cannot be built with; `bad(field, why)` makes the error."""
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"({self.num_key_value_heads}) must divide "
                      f"num_attention_heads ({self.num_attention_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_value_heads", f"({self.linear_num_value_heads}) must be a multiple "
                      f"of linear_num_key_heads ({self.linear_num_key_heads})")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise bad("partial_rotary_factor", f"gives rotary dim {self.rotary_dim}; expected an even "
                      f"number in (0, head_dim={self.head_dim}]")
        if self.mrope_section and sum(self.mrope_section) != self.rotary_dim // 2:
            raise bad("rope_parameters.mrope_section", f"sums to {sum(self.mrope_section)}; expected "
                      f"rotary dim / 2 = {self.rotary_dim // 2}")
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise bad("num_experts_per_tok", f"is {self.num_experts_per_tok}; expected 1..{self.num_experts}")
        if self.linear_conv_kernel_dim < 2:
            raise bad("linear_conv_kernel_dim", f"is {self.linear_conv_kernel_dim}; expected >= 2")
        if self.torch_dtype not in ("float32", "bfloat16", "float16"):
            raise bad("dtype", f"is {self.torch_dtype!r}; expected float32, bfloat16 or float16")


def read_json(path: str | Path) -> dict[str, Any]:
    """A checkpoint's `config.json` as a dict, or a `CheckpointError` saying what is wrong."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found (a checkpoint directory needs config.json)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


class ConfigReader:
    """Reads one JSON object of a `config.json` (the file, or its `text_config`) and remembers
    which fields were read, so a family can say what it did with every field."""

    def __init__(self, raw: dict[str, Any], source: str, prefix: str = ""):
        self.raw, self.source, self.prefix = raw, source, prefix
        self.read: set[str] = set()

    def bad(self, name: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: field '{self.prefix}{name}' {why}")

    def need(self, name: str, kind: type = int) -> Any:
        self.read.add(name)
        if self.raw.get(name) is None:
            raise self.bad(name, "is missing")
        value = self.raw[name]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise self.bad(name, f"must be a positive integer, got {value!r}")
        return value

    def opt(self, name: str, default: Any) -> Any:
        self.read.add(name)
        value = self.raw.get(name)
        return default if value is None else value

    def opt_eos(self) -> tuple[int, ...]:
        """`eos_token_id`, one id or a list of them, as a tuple (empty when absent)."""
        eos = self.opt("eos_token_id", None)
        return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

    def opt_int(self, name: str, default: int, minimum: int = 0) -> int:
        value = self.opt(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.bad(name, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def expect(self, name: str, allowed: tuple[Any, ...], why: str) -> None:
        """Accepts the field absent or with one of `allowed` values; anything else is refused."""
        value = self.opt(name, allowed[0])
        if value not in allowed:
            raise self.bad(name, f"is {value!r}; {why}")

    def ignore(self, *names: str) -> None:
        """Fields that do not change what inference computes (training knobs, bookkeeping)."""
        self.read.update(names)

    def warn_unread(self) -> None:
        unread = sorted(set(self.raw) - self.read)
        if unread:
            log.warning("%s: ignoring fields cairn does not know: %s", self.source,
                        ", ".join(self.prefix + name for name in unread))


# Fields of every Hugging Face config that say nothing about the computation.
BOOKKEEPING = ("architectures", "transformers_version", "model_type", "initializer_range", "use_cache",
               "pad_token_id", "bos_token_id", "attention_dropout", "output_router_logits",
               "router_aux_loss_coef", "_name_or_path", "auto_map")


def read_hybrid_fields(r: ConfigReader) -> dict[str, Any]:
    """The `ModelConfig` keyword arguments shared by the Gated DeltaNet + gated-attention
    families: sizes, layer types, RoPE, the DeltaNet shapes. The caller adds the MLP fields."""
    num_layers = r.need("num_hidden_layers")
    hidden = r.need("hidden_size")
    heads = r.need("num_attention_heads")
    layer_types = r.opt("layer_types", None)
    interval = r.opt("full_attention_interval", 4)
    if layer_types is None:
        layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise r.bad("layer_types", f"has {len(layer_types) if isinstance(layer_types, list) else 'no'} "
                    f"entries for {num_layers} layers")
    unknown = sorted({str(t) for t in layer_types if t not in (LINEAR, FULL)})
    if unknown:
        raise r.bad("layer_types", f"has unsupported types {unknown}; expected {LINEAR!r} or {FULL!r}")

    rope = r.opt("rope_parameters", None) or r.opt("rope_scaling", None) or {}
    if not isinstance(rope, dict):
        raise r.bad("rope_parameters", f"must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise r.bad("rope_parameters.rope_type", f"is {rope_type!r}; only 'default' RoPE is supported")
    rope_theta = rope.get("rope_theta", r.opt("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", r.opt("partial_rotary_factor", 0.25))
    section = rope.get("mrope_section") or ()
    if not (isinstance(section, (list, tuple)) and all(isinstance(s, int) and s >= 0 for s in section)):
        raise r.bad("rope_parameters.mrope_section", f"must be a list of non-negative integers, got {section!r}")
    unknown_rope = sorted(set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor",
                                       "mrope_section", "mrope_interleaved"})
    if unknown_rope:
        raise r.bad(f"rope_parameters.{unknown_rope[0]}", "is not supported (only default RoPE, "
                    "optionally with M-RoPE sections)")

    act = r.opt("hidden_act", "silu")
    if act != "silu":
        raise r.bad("hidden_act", f"is {act!r}; only 'silu' is supported")
    return dict(
        vocab_size=r.need("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=r.opt_int("num_key_value_heads", heads, minimum=1),
        head_dim=r.opt_int("head_dim", hidden // heads, minimum=1),
        layer_types=tuple(layer_types),
        rms_norm_eps=float(r.opt("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        partial_rotary_factor=float(partial),
        mrope_section=tuple(section),
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        max_position_embeddings=r.opt_int("max_position_embeddings", 32768, minimum=1),
        attention_bias=bool(r.opt("attention_bias", False)),
        linear_conv_kernel_dim=r.opt_int("linear_conv_kernel_dim", 4, minimum=1),
        linear_key_head_dim=r.opt_int("linear_key_head_dim", 128, minimum=1),
        linear_value_head_dim=r.opt_int("linear_value_head_dim", 128, minimum=1),
        linear_num_key_heads=r.opt_int("linear_num_key_heads", 16, minimum=1),
        linear_num_value_heads=r.opt_int("linear_num_value_heads", 32, minimum=1),
        hidden_act=act,
        eos_token_ids=r.opt_eos(),
        mtp_num_hidden_layers=r.opt_int("mtp_num_hidden_layers", 0),
    )
