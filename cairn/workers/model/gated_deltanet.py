"""Gated DeltaNet over a varlen batch with slot-indexed recurrent state, as transformers computes it.

Per token: the input projections give q|k|v (one conv input), an output gate z, and b, a per
value head; a depthwise causal conv1d + SiLU runs over q|k|v; q and k are L2-normed inside the
delta rule; decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); the output is a
gated RMSNorm with z, then out_proj. Families differ only in how the projections are stored
(`_split_projections`): Qwen3-Next groups them per key head, Qwen3.5 keeps them separate.

Decode rows (one new token each) update their conv window and state in place in their slots, in
levels when a sequence has several (verify rows, cairn.workers.model.batch), its states after
each level copied where the batch says;
prefill segments run the chunked rule, and copy the states after each requested checkpoint
offset into the checkpoint slots asking for them (see cairn.workers.model.batch).
"""

from __future__ import annotations

import torch
from torch import nn

from cairn import kernels
from cairn.workers.model.batch import ForwardBatch
from cairn.workers.model.model_config import ModelConfig
from cairn.workers.model.layers import GatedRMSNorm

JOINED_ROWS = 64  # at most this many prefill tokens: a checkpoint's conv rows from one joined source


class GatedDeltaNet(nn.Module):
    """The recurrent layer. A family subclass adds its input projections (the checkpoint's
    tensor names) and `_split_projections`, which maps a row of hidden states to the conv input
    q|k|v [T, conv_dim], the output gate z [T, H_v, D_v], and b, a [T, H_v]."""

    def __init__(self, cfg: ModelConfig, rank: int):
        super().__init__()
        self.rank = rank  # index of this layer among the linear-attention layers (state pool axis)
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.key_dim, cfg.value_dim, cfg.conv_dim
        self.kernel = cfg.linear_conv_kernel_dim
        # Stored as [conv_dim, 1, K] like nn.Conv1d so checkpoints load unchanged.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)

    def _split_projections(self, x: torch.Tensor):
        raise NotImplementedError

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_states: torch.Tensor,
                ssm_states: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        mixed, z, b, a = self._split_projections(x)
        g, beta = kernels.delta_gates(a, b, self.A_log, self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)  # [conv_dim, K]
        nd, r = batch.num_decodes, self.rank
        conv_pool, ssm_pool = conv_states[:, r], ssm_states[:, r]  # [num_slots, ...] views of this layer
        parts = []  # the core output of the decode rows, then of the prefill rows

        if nd:  # one new token per row, states updated in their slots, level after level (batch doc)
            at, saved = 0, 0
            for level, n in enumerate(batch.decode_levels or (nd,)):
                rows = slice(at, at + n)
                slots = batch.state_slots[rows]
                q, k, v = self._heads(kernels.causal_conv1d_update_slots(mixed[rows], weight, conv_pool, slots))
                parts.append(kernels.gated_delta_rule_step_slots(q, k, v, g[rows], beta[rows], ssm_pool, slots))
                saves = batch.level_save_counts[level] if batch.level_save_counts else 0
                if saves:
                    pairs = batch.level_saves[saved:saved + saves]
                    kernels.copy_state_slots((conv_pool, ssm_pool), pairs[:, 0], pairs[:, 1])
                    saved += saves
                at += n

        if nd < batch.num_seqs:  # every prefill segment in one call per op
            slots, plan = batch.state_slots[nd:], batch.prefill
            cu = plan.device("cu")
            rows = slice(nd, T)  # decode tokens come first, one each
            saving = batch.checkpoint_targets.shape[0] > 0
            before = conv_pool[slots] if saving else None  # conv states the segments start from
            q, k, v = self._heads(kernels.causal_conv1d_varlen(mixed[rows], weight, cu, conv_pool, slots, plan))
            out, states = kernels.chunk_gated_delta_rule_varlen(
                q, k, v, g[rows], beta[rows], cu, ssm_pool, slots, plan=plan)
            parts.append(out)
            if saving:
                self._save_checkpoints(batch, mixed[rows], before, states, conv_pool, ssm_pool)

        core = torch.cat(parts) if len(parts) > 1 else parts[0]  # [T, H_v, D_v]
        core = self.norm(core.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(T, self.value_dim)
        return self.out_proj(core)

    @staticmethod
    def _save_checkpoints(batch: ForwardBatch, mixed: torch.Tensor, before: torch.Tensor, states: torch.Tensor,
                          conv_pool: torch.Tensor, ssm_pool: torch.Tensor) -> None:
        """Copies the states after each checkpoint offset into the slots asking for them, all at
        once from the step's tables (cairn.workers.model.batch): the conv window ending there, gathered
        from the segments' starting windows and their tokens, and the delta-rule state the
        chunked rule saved there. The rows are gathered from the two sources apart where the
        tokens are many: joining them first would copy every token's conv input (a 4k prefill's,
        per layer) for a few rows; a few tokens (a verify step's) are joined, which takes fewer
        ops. Each target slot is written once (a checkpoint's slots are distinct)."""
        windows = before.transpose(1, 2).reshape(-1, before.shape[1])  # [segments * (K-1), conv_dim]
        rows, n, targets = batch.checkpoint_rows, windows.shape[0], batch.checkpoint_targets
        if mixed.shape[0] <= JOINED_ROWS:
            gathered = torch.cat((windows, mixed.to(windows.dtype)))[rows]
        else:
            gathered = torch.where((rows < n)[..., None], windows[rows.clamp(max=n - 1)],
                                   mixed[(rows - n).clamp(min=0)].to(windows.dtype))
        conv_pool.index_copy_(0, targets, gathered.transpose(1, 2))
        ssm_pool.index_copy_(0, targets, states.index_select(0, batch.checkpoint_states))

    def _heads(self, y: torch.Tensor):
        n = y.shape[0]
        q, k, v = torch.split(y, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return q.reshape(n, self.nk, self.dk), k.reshape(n, self.nk, self.dk), v.reshape(n, self.nv, self.dv)
