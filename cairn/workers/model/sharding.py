"""Tensor parallelism's split of a model: which part of every weight one rank holds.

Contract:
- `Shard(rank, world)` names a rank; `shard_config(cfg, world)` is the `ModelConfig` one rank
  builds its layers from: the same model with 1/world of the heads and intermediate sizes, so
  the layers, the arena and the runner of a rank need no TP code of their own. A world size the
  model's shapes do not divide is refused with a `ValueError` naming the field.
- `ranges(name, cfg, shard)`: for a parameter of the full model (`cfg` the full config), the dim
  and the index ranges along it whose concatenation is this rank's part; None: replicated.
  The loader reads exactly those ranges from safetensors (`get_slice`), never the whole tensor.
- `zero_on_other_ranks(name)`: a row-parallel layer's bias, added once: rank 0 keeps it.

The split, per layer (N = world):
- attention: by heads; q_proj rows hold [query | gate] per head, so a rank's rows are its heads'.
  K/V heads are split when N divides them, else each of the N / H_kv ranks of a K/V head holds a
  replica of it (N must be a multiple of H_kv); o_proj by input columns (row-parallel);
- Gated DeltaNet: by key heads together with their value heads (value head h belongs to key head
  h // (H_v / H_k)), so a group never straddles ranks; the conv channels [q | k | v] follow,
  three ranges; A_log, dt_bias per value head; out_proj row-parallel. Each family names the
  ranges of its own input projections (`Family.shard_rules`);
- MLP and every MoE expert: gate/up by rows of the intermediate size, down by its columns; the
  router gate and the shared-expert gate are replicated;
- embeddings and LM head: by vocabulary rows, ceil(V / N) per rank (the last rank's tail is
  padding, zero rows);
- norms: replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from cairn.workers.model.model_config import ModelConfig


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    world: int = 1

    def part(self, total: int) -> tuple[int, int]:
        """This rank's [start, stop) of `total` items split evenly (`total` divisible)."""
        n = total // self.world
        return self.rank * n, (self.rank + 1) * n


Ranges = tuple[int, list[tuple[int, int]]]  # (dim, [(start, stop), ...])
Rule = Callable[[ModelConfig, Shard], Ranges]


def _divides(world: int, value: int, name: str) -> None:
    if value % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide {name} ({value})")


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """One rank's view of the model: 1/world of its heads and intermediate sizes."""
    if world == 1:
        return cfg
    _divides(world, cfg.num_attention_heads, "num_attention_heads")
    kv = cfg.num_key_value_heads
    if kv % world and world % kv:
        raise ValueError(f"tensor_parallel_size {world} and num_key_value_heads ({kv}): one must divide the other")
    changes = dict(num_attention_heads=cfg.num_attention_heads // world, num_key_value_heads=max(1, kv // world))
    if cfg.recurrent:
        _divides(world, cfg.linear_num_key_heads, "linear_num_key_heads")
        changes.update(linear_num_key_heads=cfg.linear_num_key_heads // world,
                       linear_num_value_heads=cfg.linear_num_value_heads // world)
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        _divides(world, cfg.intermediate_size, "intermediate_size")
        changes["intermediate_size"] = cfg.intermediate_size // world
    if cfg.num_experts:
        _divides(world, cfg.moe_intermediate_size, "moe_intermediate_size")
        _divides(world, cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        changes.update(moe_intermediate_size=cfg.moe_intermediate_size // world,
                       shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // world)
    return replace(cfg, **changes)


def vocab_rows(vocab_size: int, shard: Shard) -> tuple[int, int, int]:
    """(start, stop, rows per rank) of the vocabulary rows a rank holds; stop <= vocab_size."""
    per = -(-vocab_size // shard.world)
    start = min(shard.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


# ---- rules shared by every family ----------------------------------------------------------------

def rows(size: Callable[[ModelConfig], int]) -> Rule:
    """Split dim 0 of a tensor whose rows are `size(cfg)` equal items (heads, channels)."""
    return lambda cfg, shard: (0, [shard.part(size(cfg))])


def scaled_rows(items: Callable[[ModelConfig], int], width: Callable[[ModelConfig], int], dim: int = 0) -> Rule:
    """Split `dim` of a tensor laid out as `items(cfg)` groups of `width(cfg)` rows each."""
    def rule(cfg: ModelConfig, shard: Shard) -> Ranges:
        a, b = shard.part(items(cfg))
        w = width(cfg)
        return dim, [(a * w, b * w)]
    return rule


def _kv_rows(cfg: ModelConfig, shard: Shard) -> Ranges:
    kv, d = cfg.num_key_value_heads, cfg.head_dim
    if kv >= shard.world:
        a, b = shard.part(kv)
    else:  # each K/V head replicated on world / kv ranks
        a = shard.rank * kv // shard.world
        b = a + 1
    return 0, [(a * d, b * d)]


def conv_channels(cfg: ModelConfig, shard: Shard, dim: int = 0) -> Ranges:
    """The rank's [q | k | v] channels of a DeltaNet layer: its key heads' q and k, its value heads' v."""
    qa, qb = shard.part(cfg.linear_num_key_heads)
    va, vb = shard.part(cfg.linear_num_value_heads)
    dk, dv, key_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.key_dim
    return dim, [(qa * dk, qb * dk), (key_dim + qa * dk, key_dim + qb * dk),
                 (2 * key_dim + va * dv, 2 * key_dim + vb * dv)]


def _moe_gate_up(cfg: ModelConfig, shard: Shard) -> Ranges:
    a, b = shard.part(cfg.moe_intermediate_size)
    i = cfg.moe_intermediate_size
    return 1, [(a, b), (i + a, i + b)]


def _vocab(cfg: ModelConfig, shard: Shard) -> Ranges:
    start, stop, _ = vocab_rows(cfg.vocab_size, shard)
    return 0, [(start, stop)]


_value_heads = lambda cfg: cfg.linear_num_value_heads  # noqa: E731
COMMON_RULES: dict[str, Rule] = {
    "self_attn.q_proj.weight": scaled_rows(lambda c: c.num_attention_heads, lambda c: 2 * c.head_dim),
    "self_attn.q_proj.bias": scaled_rows(lambda c: c.num_attention_heads, lambda c: 2 * c.head_dim),
    "self_attn.k_proj.weight": _kv_rows,
    "self_attn.k_proj.bias": _kv_rows,
    "self_attn.v_proj.weight": _kv_rows,
    "self_attn.v_proj.bias": _kv_rows,
    "self_attn.o_proj.weight": scaled_rows(lambda c: c.num_attention_heads, lambda c: c.head_dim, dim=1),
    "linear_attn.conv1d.weight": conv_channels,
    "linear_attn.A_log": rows(_value_heads),
    "linear_attn.dt_bias": rows(_value_heads),
    "linear_attn.out_proj.weight": scaled_rows(_value_heads, lambda c: c.linear_value_head_dim, dim=1),
    "mlp.gate_proj.weight": rows(lambda c: c.intermediate_size),
    "mlp.up_proj.weight": rows(lambda c: c.intermediate_size),
    "mlp.down_proj.weight": (lambda cfg, shard: (1, [shard.part(cfg.intermediate_size)])),
    "mlp.shared_expert.gate_proj.weight": rows(lambda c: c.shared_expert_intermediate_size),
    "mlp.shared_expert.up_proj.weight": rows(lambda c: c.shared_expert_intermediate_size),
    "mlp.shared_expert.down_proj.weight": (lambda cfg, shard: (1, [shard.part(cfg.shared_expert_intermediate_size)])),
    "mlp.experts.gate_up_proj": _moe_gate_up,
    "mlp.experts.down_proj": (lambda cfg, shard: (2, [shard.part(cfg.moe_intermediate_size)])),
    "model.embed_tokens.weight": _vocab,
    "lm_head.weight": _vocab,
}
# One expert's tensor, as transformers' save_pretrained writes MoE layers: (its MLP, expert, projection).
PER_EXPERT = re.compile(r"^((?:model\.)?layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
ROW_PARALLEL_BIASES = ("self_attn.o_proj.bias",)


def ranges(name: str, cfg: ModelConfig, shard: Shard, family_rules: Mapping[str, Rule] = {}) -> Ranges | None:
    """The dim and ranges of parameter `name` (checkpoint spelling, after the family's renaming)
    that `shard` holds, or None when every rank holds all of it."""
    if shard.world == 1:
        return None
    m = PER_EXPERT.match(name)
    if m:  # one expert of a checkpoint that stores them apart: [I, H] or [H, I]
        part = shard.part(cfg.moe_intermediate_size)
        return (1, [part]) if m.group(3) == "down_proj" else (0, [part])
    for suffix, rule in (*family_rules.items(), *COMMON_RULES.items()):
        if name.endswith(suffix):
            return rule(cfg, shard)
    return None


def zero_on_other_ranks(name: str) -> bool:
    return name.endswith(ROW_PARALLEL_BIASES)
