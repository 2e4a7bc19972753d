"""An MTP head added to a transformers checkpoint under the published names (`mtp.*`): what
tests of the head (tests/workers/model/test_mtp.py) and of speculative decoding read."""

import torch
from safetensors.torch import load_file, save_file


def hf_layer_module(config, kind: str):
    import transformers

    if kind.startswith("q35_moe"):
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
        layer_class, rotary_class = m.Qwen3_5MoeDecoderLayer, m.Qwen3_5MoeTextRotaryEmbedding
    elif kind.startswith("q35"):
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m
        layer_class, rotary_class = m.Qwen3_5DecoderLayer, m.Qwen3_5TextRotaryEmbedding
    else:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
        layer_class, rotary_class = m.Qwen3NextDecoderLayer, m.Qwen3NextRotaryEmbedding
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    config.layer_types = ["full_attention"] + list(config.layer_types[1:])
    config._attn_implementation = "eager"
    assert transformers
    return layer_class(config, 0).eval(), rotary_class(config), config


def with_mtp(path, kind: str, seed: int = 0):
    """Adds an MTP head to the checkpoint at `path` under the published names; returns the
    transformers decoder layer, rotary, and the head's other weights (the reference's)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(seed)
    layer, rotary, text = hf_layer_module(config, kind)
    hidden = text.hidden_size
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.2))
    head = {"fc.weight": torch.randn(hidden, 2 * hidden) * 0.1,
            "pre_fc_norm_embedding.weight": torch.randn(hidden) * 0.1,
            "pre_fc_norm_hidden.weight": torch.randn(hidden) * 0.1, "norm.weight": torch.randn(hidden) * 0.1}
    tensors = {f"mtp.{k}": v for k, v in head.items()}
    for name, t in layer.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # written per expert, as published Qwen3-Next heads are
            prefix = name[:-len("gate_up_proj")]
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                tensors[f"mtp.layers.0.{prefix}{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"mtp.layers.0.{prefix}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e, w in enumerate(t):
                tensors[f"mtp.layers.0.{prefix}{e}.down_proj.weight"] = w.contiguous()
        else:
            tensors[f"mtp.layers.0.{name}"] = t.contiguous()
    weights = path / "model.safetensors"
    save_file({**load_file(weights), **tensors}, weights, metadata={"format": "pt"})
    return layer, rotary, head, text
