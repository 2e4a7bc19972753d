"""What one model forward needs besides the weights: the flattened tokens of a step and where
their caches live.

A step runs a varlen batch: the new tokens of B sequences concatenated into T rows. The runner
orders sequences so the first `num_decodes` have exactly one new token and a state that already
exists (decodes), and the rest are prefill segments; each layer runs the first group through the
slot-indexed decode ops and the second through the varlen prefill ops: one call per op for all.

Images (a vision-language model): `positions` is then [3, T] (M-RoPE's t, h, w rows, equal for
text: cairn.workers.model.mrope), and the `image_rows` of the step take `image_embeds` in place of
their token embeddings. Positions are rotary positions: a token past an image sits at its index
plus the prompt's shift, while `slot_mapping` holds where its K/V goes.

Units: `positions`, `seq_lens`, `cu_seqlens` are in tokens; `page_table` holds page ids;
`slot_mapping` holds KV slots (`page * page_size + offset`); `state_slots` index the state pool.

Caches are passed beside the batch, not inside it:
- `kv_caches[i]` = (k, v) for the i-th attention layer, each [num_pages, page_size, H_kv, D];
- `conv_states` [num_slots, L_lin, conv_dim, K-1] and `ssm_states`
  [num_slots, L_lin, H_v, D_k, D_v] (fp32), indexed by a linear layer's rank among linear layers.
A sequence's state slot always holds its state at the start of the segment (zeros for a fresh
sequence, a restored checkpoint for a resumed one); the model leaves it at the segment's end.

Everything a step's kernels need to know about its lengths is computed on the host before the
step and arrives with it (`prefill`, the checkpoint tables), so that the forward never reads a
value back from the device: the tensors here are the device's, every int and list is the host's.

Verify rows (speculative decoding's exact mode, cairn.workers.speculative): a sequence's
drafted tokens can be decode rows too, each at its own position over the sequence's one state
slot. The decode rows then come in `decode_levels`: level 0 holds every decoding sequence's first
row, level j the j-th drafted row of those with j drafts or more; the recurrent layers run the
levels one after another, each through the same per-token ops as a decode (so a row computes
exactly what decoding it alone would), and after level j copy the states `level_saves` names
for it (`level_save_counts[j]` rows of (sequence's slot, slot keeping the state after j + 1 of
its tokens)). Attention needs no order: every row's K/V is stored before any row attends.

Checkpoints: the prefill plan's `positions[i]` are the offsets in prefill segment i after which
its recurrent state is saved, each into one or more state slots. The N copies are tables:
`checkpoint_targets` [N] the slots, `checkpoint_states` [N] the index of the delta-rule state the
chunked rule saved (segment by segment, offset by offset), and `checkpoint_rows` [N, K-1] the
conv window's rows in [each prefill segment's starting conv window, K-1 rows each; then the
prefill tokens' conv inputs].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cairn.kernels import VarlenPlan


# The tensor fields, which are also the names the runner uploads them by; a prefill plan's tables
# travel beside them as PREFILL + their name (`plan_arrays`).
TENSORS = ("input_ids", "positions", "cu_seqlens", "seq_lens", "page_table", "slot_mapping", "state_slots",
           "logits_indices", "checkpoint_rows", "checkpoint_targets", "checkpoint_states")
PREFILL = "prefill."


def plan_arrays(plan: VarlenPlan) -> dict[str, np.ndarray]:
    """A prefill plan's host tables, named as `ForwardBatch.over` finds them."""
    return {PREFILL + name: t for name, t in plan.tables.items()}


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64; [3, T] in a step with image tokens
    cu_seqlens: torch.Tensor  # [B+1] int32
    num_seqs: int  # B
    seq_lens: torch.Tensor  # [B] int32, each sequence's length after this step
    page_table: torch.Tensor  # [B, max_pages] int32
    slot_mapping: torch.Tensor  # [T] int64
    state_slots: torch.Tensor  # [B] int64
    num_decodes: int  # the first num_decodes sequences have one new token each
    logits_indices: torch.Tensor  # [N] int64: rows of T whose logits are computed
    prefill: VarlenPlan  # sequences num_decodes.. : their boundaries from 0, tables on the device
    checkpoint_rows: torch.Tensor  # [N, K-1] int64 (see above)
    checkpoint_targets: torch.Tensor  # [N] int64
    checkpoint_states: torch.Tensor  # [N] int64
    decode_levels: tuple[int, ...] = ()  # decode rows per level (verify rows; empty: one level)
    level_saves: torch.Tensor | None = None  # [S, 2] int64 (see above)
    level_save_counts: tuple[int, ...] = ()
    image_rows: torch.Tensor | None = None  # [N] int64: rows whose embedding is an image token's
    image_embeds: torch.Tensor | None = None  # [N, hidden]: the vision tower's, for those rows

    @classmethod
    def over(cls, tensors: dict[str, torch.Tensor], num_decodes: int, prefill: VarlenPlan,
             decode_levels: tuple[int, ...] = (), level_save_counts: tuple[int, ...] = ()) -> "ForwardBatch":
        """The batch over a step's uploaded arrays (`TENSORS` by name, the plan's tables as
        `plan_arrays` names them, `level_saves` with verify rows), with `prefill` bound to its
        tables' device copies."""
        plan = prefill.bind({name[len(PREFILL):]: t for name, t in tensors.items() if name.startswith(PREFILL)})
        return cls(**{name: tensors[name] for name in TENSORS}, num_seqs=tensors["cu_seqlens"].shape[0] - 1,
                   num_decodes=num_decodes, prefill=plan, decode_levels=decode_levels,
                   level_saves=tensors.get("level_saves"), level_save_counts=level_save_counts,
                   image_rows=tensors.get("image_rows"))
