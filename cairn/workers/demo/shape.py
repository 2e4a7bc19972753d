"""The demo model's shape (`DemoSize`), its architectures, and the `config.json` they imply.

Contract: `SIZES` names the sizes and `ARCHS` the architectures `write_demo_model` accepts.
`hf_config(size, token_ids, arch)` returns a `config.json` dict with every field of that
architecture's transformers config written out (nothing left to transformers' defaults, so our
engine reads the same numbers transformers does): explicit `layer_types` with full attention
every `full_attention_interval`-th layer (the rest Gated DeltaNet), partial rotary (1/4 of the
head dim), fp32, untied embeddings, token ids taken from the tokenizer.
- `qwen3_next`: `Qwen3NextForCausalLM`, dense MLP (`num_experts: 0`);
- `qwen3_5`: `Qwen3_5ForCausalLM` (the text-only layout), dense MLP, interleaved M-RoPE;
- `qwen3_5_moe`: `Qwen3_5MoeForCausalLM`, every layer a routed MoE with a shared expert.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class DemoSize:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    full_attention_interval: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    num_experts: int  # the MoE architecture's shape; the dense ones ignore these
    num_experts_per_tok: int
    moe_intermediate_size: int
    linear_conv_kernel_dim: int = 4

    def layer_types(self) -> list[str]:
        """Full attention on every `full_attention_interval`-th layer (1-based), else linear."""
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]


SIZES: dict[str, DemoSize] = {
    # Tests: loads and runs in milliseconds.
    "tiny": DemoSize(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16,
        intermediate_size=128, max_position_embeddings=4096,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    ),
    # Benchmarks on CPU: big enough that compute, not Python overhead, dominates a step.
    "bench": DemoSize(
        vocab_size=4096, hidden_size=512, num_hidden_layers=8, full_attention_interval=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64,
        intermediate_size=1536, max_position_embeddings=16384,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
    ),
}


ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def hf_config(size: DemoSize, token_ids: dict[str, int], arch: str = "qwen3_next") -> dict:
    """`config.json` for `size` and `arch`; `token_ids` maps "eos", "bos", "pad" to ids (bos may be None)."""
    if arch == "qwen3_next":
        return _qwen3_next_config(size, token_ids)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        return _qwen3_5_config(size, token_ids, moe=arch == "qwen3_5_moe")
    raise ValueError(f"expected arch in {list(ARCHS)}, got {arch!r}")


def _shared_fields(size: DemoSize, token_ids: dict[str, int]) -> dict:
    return {
        "dtype": "float32",
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "num_hidden_layers": size.num_hidden_layers,
        "layer_types": size.layer_types(),
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "head_dim": size.head_dim,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": size.max_position_embeddings,
        "linear_conv_kernel_dim": size.linear_conv_kernel_dim,
        "linear_key_head_dim": size.linear_key_head_dim,
        "linear_value_head_dim": size.linear_value_head_dim,
        "linear_num_key_heads": size.linear_num_key_heads,
        "linear_num_value_heads": size.linear_num_value_heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": token_ids["bos"],
        "eos_token_id": token_ids["eos"],
        "pad_token_id": token_ids["pad"],
    }


def _qwen3_5_config(size: DemoSize, token_ids: dict[str, int], moe: bool) -> dict:
    rotary_half = size.head_dim // 4 // 2  # partial rotary 1/4, in frequency pairs
    section = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    cfg = {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        **_shared_fields(size, token_ids),
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": section, "mrope_interleaved": True,
        },
    }
    if moe:
        cfg.update(num_experts=size.num_experts, num_experts_per_tok=size.num_experts_per_tok,
                   moe_intermediate_size=size.moe_intermediate_size,
                   shared_expert_intermediate_size=size.moe_intermediate_size,
                   output_router_logits=False, router_aux_loss_coef=0.001)
    else:
        cfg["intermediate_size"] = size.intermediate_size
    return cfg


def _qwen3_next_config(size: DemoSize, token_ids: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        **_shared_fields(size, token_ids),
        "intermediate_size": size.intermediate_size,
        "full_attention_interval": size.full_attention_interval,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        },
        "num_experts": 0,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": size.intermediate_size,
        "shared_expert_intermediate_size": size.intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
