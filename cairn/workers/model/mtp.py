"""The multi-token-prediction head Qwen3-Next and Qwen3.5 / 3.6 checkpoints ship (`mtp.*`), as
their published weights and vLLM's and SGLang's implementations lay it out.

Contract: `MultiTokenPredictor(cfg, cache_rank)` has the checkpoint's names under `mtp.*`, less
the prefix: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` (2H -> H, no bias), `layers.0`
(one decoder layer with full attention and the model's MLP at its first layer: the sparse MoE
with its shared expert in the MoE models, the SwiGLU MLP in the dense ones), `norm`. Given the
target's final hidden state at position t (after its final norm: what its LM head reads) and
the embedding of the token at t + 1 (the target's embedding table: the head has none of its own),
`forward` computes

    x = fc(cat(pre_fc_norm_embedding(e_{t+1}), pre_fc_norm_hidden(h_t)))
    x = layers.0(x)        (attention over the head's own K/V pages: `caches.kv[cache_rank]`)
    return norm(x)         (the hidden state the target's LM head turns into draft logits)

over a varlen paged batch, as the target's layers do (cairn.workers.model.hybrid): the head's
K/V at position t is written at t's KV slot. Norms are the model's (1 + w) RMSNorm.

`load_mtp(model_dir, cfg, dtype, device, cache_rank, shard, group)` reads only the `mtp.*`
tensors (per-expert or fused experts, as the main loader fuses them): the head, or None when the
checkpoint has none. One head layer only (`mtp_num_hidden_layers` 1, as every published Qwen
checkpoint has). Tensor parallel as the target (`cfg` the full config, `shard` the rank): its
decoder layer split as the target's layers are (cairn.workers.model.sharding; only the rank's
part is read), `fc` and the norms replicated (the inputs and the output are the whole hidden
state on every rank).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from cairn.workers.model.batch import ForwardBatch
from cairn.workers.model.gated_deltanet import GatedDeltaNet
from cairn.workers.model.hybrid import DecoderLayer, ModelCaches
from cairn.workers.model.layers import RMSNorm, Rotary
from cairn.workers.model.model_config import FULL, CheckpointError, ModelConfig
from cairn.workers.model.sharding import Shard, shard_config

PREFIX = "mtp."


class MultiTokenPredictor(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_rank: int, group=None):
        """cache_rank: the index of the head's K/V pages in `ModelCaches.kv`; `cfg` a rank's
        (`shard_config`) and `group` the ranks' TPGroup under tensor parallelism."""
        super().__init__()
        hidden = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(hidden, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        layer_cfg = replace(cfg, layer_types=(FULL,) + tuple(cfg.layer_types[1:]))  # its first layer, attention
        self.layers = nn.ModuleList([DecoderLayer(layer_cfg, 0, 0, cache_rank, GatedDeltaNet, group)])
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                caches: ModelCaches) -> torch.Tensor:
        """embeddings [T, H]: the next tokens'; hidden [T, H]: the target's final hidden states at
        the batch's positions. Returns the head's normed hidden states [T, H]."""
        x = self.fc(torch.cat((self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)), dim=-1))
        x, residual = self.layers[0](x, None, batch, caches)
        x, _ = self.norm(x, residual)
        return x


def mtp_tensor_name(name: str) -> str | None:
    """A checkpoint tensor's name in the head, or None for one outside it."""
    return name[len(PREFIX):] if name.startswith(PREFIX) else None


def load_mtp(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
             cache_rank: int, shard: Shard = Shard(), group=None) -> MultiTokenPredictor | None:
    from cairn.workers.model.family import Family
    from cairn.workers.model.loader import fused_name, read_tensors, weight_files

    if cfg.mtp_num_hidden_layers > 1:
        raise CheckpointError(f"{model_dir}: an MTP head of {cfg.mtp_num_hidden_layers} layers (mtp_num_hidden_layers); "
                              f"cairn reads heads of one layer, as every published Qwen checkpoint has")
    files = weight_files(Path(model_dir))
    reader = Family(name="mtp", model_class=MultiTokenPredictor, tensor_name=mtp_tensor_name)
    state = {fused_name(k): v for k, v in read_tensors(files, dtype, reader, cfg, shard).items()}
    if not state:
        return None
    with torch.device("meta"):
        head = MultiTokenPredictor(shard_config(cfg, shard.world), cache_rank, group)
    expected = head.state_dict()
    where = files[0].parent
    for name in sorted(set(expected) | set(state)):
        if name not in state:
            raise CheckpointError(f"{where}: the MTP head lacks tensor '{PREFIX}{name}'")
        if name not in expected:
            raise CheckpointError(f"{where}: unexpected MTP tensor '{PREFIX}{name}' (one head layer is read)")
        if tuple(state[name].shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{where}: MTP tensor '{PREFIX}{name}' has shape {tuple(state[name].shape)}, "
                                  f"config.json implies {tuple(expected[name].shape)}")
    head.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True)
    for module in head.modules():  # non-persistent buffers are not in the checkpoint
        if isinstance(module, Rotary):
            module.refresh(cfg, device)
    return head.eval()
