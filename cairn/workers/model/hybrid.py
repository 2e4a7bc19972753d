"""The hybrid decoder every family builds: embeddings, layers of gated attention or a recurrent
mixer (by `config.layer_types`), each followed by a dense or sparse MLP, a final norm and the LM
head, over a varlen paged batch.

Contract: `HybridForCausalLM(cfg)` has transformers' parameter names under `model.*` and
`lm_head`, so a family's weight map is a renaming of checkpoint names, not a reshaping. A family
subclass sets `delta_net`, its recurrent layer class.

Tensor parallel: `HybridForCausalLM(shard_config(full, N), shard, group)` is one rank's part
(cairn.workers.model.sharding): its layers are the ordinary ones at 1/N of the heads and widths. The
rank's partial sums meet in one all-reduce after each attention or DeltaNet block and one after
each MLP; the embedding is vocab-parallel (each rank looks up its rows, one all-reduce) and so
is the LM head (one all-gather of the sampled rows' logits), so every rank returns the full
vocabulary's logits. The model is a pure function of (weights,
ForwardBatch, caches): it writes K/V for the new tokens into pages, advances each sequence's
recurrent state in its slot, and returns fp32 logits of the rows in `batch.logits_indices`.
It never decides anything; the runner does.
"""

from __future__ import annotations

import torch
from torch import nn

from cairn.workers.model.batch import ForwardBatch
from cairn.workers.model.model_config import FULL, ModelConfig
from cairn.workers.model.gated_deltanet import GatedDeltaNet
from cairn.workers.model.layers import MLP, Attention, RMSNorm, SparseMoE
from cairn.workers.model.sharding import Shard, vocab_rows


class ModelCaches:
    """The tensors the model reads and writes besides weights (see cairn.workers.model.batch)."""

    def __init__(self, kv: list[tuple[torch.Tensor, torch.Tensor]], conv_states: torch.Tensor,
                 ssm_states: torch.Tensor):
        self.kv, self.conv_states, self.ssm_states = kv, conv_states, ssm_states


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, linear_rank: int, attention_rank: int,
                 delta_net: type[GatedDeltaNet], group=None):
        super().__init__()
        self.group = group  # cairn.workers.execution.tp_group.TPGroup, or None on one device
        self.is_attention = cfg.layer_types[layer] == FULL
        self.cache_rank = attention_rank if self.is_attention else linear_rank
        if self.is_attention:
            self.self_attn = Attention(cfg)
        else:
            self.linear_attn = delta_net(cfg, linear_rank)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                caches: ModelCaches) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, with no
        residual yet); residual: the stream before it. Returns (this layer's MLP output, the
        stream before it): each residual add is fused into the norm that follows it."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.is_attention:
            h = self.self_attn(h, batch, caches.kv[self.cache_rank])
        else:
            h = self.linear_attn(h, batch, caches.conv_states, caches.ssm_states)
        if self.group is not None:
            h = self.group.all_reduce(h)
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        if self.group is not None:
            h = self.group.all_reduce(h)
        return h, residual


class HybridForCausalLM(nn.Module):
    delta_net: type[GatedDeltaNet] = GatedDeltaNet  # a family's recurrent layer

    def __init__(self, cfg: ModelConfig, shard: Shard = Shard(), group=None):
        """`cfg`: the rank's config (`shard_config`); `group`: the ranks' TPGroup (None: one device)."""
        super().__init__()
        self.config, self.shard, self.group = cfg, shard, group
        self.vocab_start, _, rows = vocab_rows(cfg.vocab_size, shard)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(rows, cfg.hidden_size)
        layers, lin, att = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            layers.append(DecoderLayer(cfg, i, lin, att, self.delta_net, group))
            att, lin = (att + 1, lin) if kind == FULL else (att, lin + 1)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.model.embed_tokens(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.model.embed_tokens.num_embeddings)
        x = self.model.embed_tokens(torch.where(mine, local, 0)) * mine[:, None]
        return self.group.all_reduce(x)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of `ids` [T] -> [T, hidden] (the MTP head shares them)."""
        return self._embed(ids)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of final normed hidden states `x` [N, hidden] (the LM head,
        which the MTP head shares)."""
        logits = self.lm_head(x).float()
        if self.group is not None:
            logits = self.group.all_gather(logits, dim=-1)[:, :self.config.vocab_size]
        return logits

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, caches: ModelCaches, hidden: bool = False):
        """Returns fp32 logits [len(batch.logits_indices), vocab]; with `hidden`, (those logits,
        every row's final normed hidden state [T, hidden]: what the MTP head reads)."""
        x, residual = self._embed(batch.input_ids), None  # [T, hidden]
        if batch.image_embeds is not None:  # image tokens read the vision tower's embeddings
            x = x.index_copy(0, batch.image_rows, batch.image_embeds.to(x.dtype))
        for layer in self.model.layers:
            x, residual = layer(x, residual, batch, caches)
        rows = batch.logits_indices
        if hidden:
            normed, _ = self.model.norm(x, residual)
            return self.head_logits(normed[rows]), normed
        x, _ = self.model.norm(x[rows], residual[rows])  # the last residual add, for the sampled rows
        return self.head_logits(x)
