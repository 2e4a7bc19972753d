"""Random weights for the demo model, named and shaped exactly as transformers saves them.

Contract: `random_weights(size, seed, arch)` returns fp32 tensors keyed by the names the
architecture's published checkpoints use (untied `lm_head`): Qwen3-Next's grouped DeltaNet
projections, Qwen3.5's separate ones, and for `qwen3_5_moe` the router, the fused experts
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and the gated shared
expert. They are drawn from one `torch.Generator` seeded with `seed` in a fixed name order:
same arguments, same bytes. Nothing here imports transformers.

The draws are chosen so a random model still behaves like a model — context changes the
logits and greedy decoding has a clear winner — because the engine's cache tests compare a
resumed request with a cold one, and that comparison only means something if the skipped
prefix (KV pages and recurrent state) actually shows in the logits:
- every projection (conv1d and `lm_head` included) N(0, 1/fan_in), embeddings N(0, 1): each
  layer adds as much to the residual stream as the token embedding, so a token 250 positions
  back still moves the logits, and logits are unit-scale (top-2 gap rarely below 1e-3).
  transformers' N(0, 0.02) would leave a bigram model: the embedding swamps every layer;
- Qwen3-Next RMSNorm weights 0 (it computes norm(x) * (1 + w)); the gated norm's weight 1;
- `A_log = log(U(1, 16))`; `dt_bias = softplus^-1(dt)`, dt log-uniform in [1e-3, 1e-1] (the
  Mamba / FLA scheme) so per-token state decay exp(-A * dt) spans ~0.2 to ~0.999: some heads
  remember hundreds of tokens, and a wrong resumed state stays visible in later logits.
"""

import math

import torch

from cairn.workers.demo.shape import DemoSize

DT_MIN, DT_MAX = 1e-3, 1e-1


def weight_shapes(size: DemoSize, arch: str = "qwen3_next", mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, in the order they are drawn; with `mtp`, an MTP head's
    after them, under the published names (cairn.workers.model.mtp): its two norms, `fc`, and one
    decoder layer with full attention and the model's MLP (fused experts where the model's are)."""
    h = size.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (size.vocab_size, h)}
    for i, kind in enumerate(size.layer_types()):
        shapes.update(_layer_shapes(f"model.layers.{i}.", kind, size, arch))
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (size.vocab_size, h)
    if mtp:
        shapes.update({"mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
                       "mtp.fc.weight": (h, 2 * h)})
        shapes.update(_layer_shapes("mtp.layers.0.", "full_attention", size, arch))
        shapes["mtp.norm.weight"] = (h,)
    return shapes


def _layer_shapes(p: str, kind: str, size: DemoSize, arch: str) -> dict[str, tuple[int, ...]]:
    h = size.hidden_size
    shapes = {p + "input_layernorm.weight": (h,)}
    if kind == "full_attention":
        q, kv, d = size.num_attention_heads, size.num_key_value_heads, size.head_dim
        shapes[p + "self_attn.q_proj.weight"] = (2 * q * d, h)  # query and its output gate
        shapes[p + "self_attn.k_proj.weight"] = (kv * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q * d)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
    else:
        key_dim = size.linear_num_key_heads * size.linear_key_head_dim
        value_dim = size.linear_num_value_heads * size.linear_value_head_dim
        heads = size.linear_num_value_heads
        conv_dim = 2 * key_dim + value_dim
        if arch == "qwen3_next":  # grouped per key head
            shapes[p + "linear_attn.in_proj_qkvz.weight"] = (2 * key_dim + 2 * value_dim, h)
            shapes[p + "linear_attn.in_proj_ba.weight"] = (2 * heads, h)
        else:  # Qwen3.5: separate projections
            shapes[p + "linear_attn.in_proj_qkv.weight"] = (conv_dim, h)
            shapes[p + "linear_attn.in_proj_z.weight"] = (value_dim, h)
            shapes[p + "linear_attn.in_proj_b.weight"] = (heads, h)
            shapes[p + "linear_attn.in_proj_a.weight"] = (heads, h)
        shapes[p + "linear_attn.conv1d.weight"] = (conv_dim, 1, size.linear_conv_kernel_dim)
        shapes[p + "linear_attn.dt_bias"] = (heads,)
        shapes[p + "linear_attn.A_log"] = (heads,)
        shapes[p + "linear_attn.norm.weight"] = (size.linear_value_head_dim,)
        shapes[p + "linear_attn.out_proj.weight"] = (h, value_dim)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    if arch == "qwen3_5_moe":
        e, i = size.num_experts, size.moe_intermediate_size
        shapes[p + "mlp.gate.weight"] = (e, h)
        shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * i, h)
        shapes[p + "mlp.experts.down_proj"] = (e, h, i)
        shapes.update(_swiglu(p + "mlp.shared_expert.", h, i))
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    else:
        shapes.update(_swiglu(p + "mlp.", h, size.intermediate_size))
    return shapes


def _swiglu(prefix: str, hidden: int, intermediate: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (intermediate, hidden), prefix + "up_proj.weight": (intermediate, hidden),
            prefix + "down_proj.weight": (hidden, intermediate)}


def random_weights(size: DemoSize, seed: int, arch: str = "qwen3_next", mtp: bool = False) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights for `size` and `arch` from `seed` (with `mtp`, a random MTP
    head's too, drawn after the model's: the model's bytes are the same either way)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: _draw(name, shape, gen) for name, shape in weight_shapes(size, arch, mtp).items()}


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if name.endswith("norm.weight"):
        return torch.zeros(shape)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
    if name.endswith("dt_bias"):
        u = torch.empty(shape).uniform_(0.0, 1.0, generator=gen)
        dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    # (out, in) linears; (channels, 1, kernel) depthwise conv; (experts, out, in) fused experts
    fan_in = shape[-1] if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else math.prod(shape[1:])
    std = 1.0 if name == "model.embed_tokens.weight" else fan_in**-0.5
    return torch.empty(shape).normal_(0.0, std, generator=gen)
