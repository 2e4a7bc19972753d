"""Drafting with the checkpoint's MTP head (cairn.workers.model.mtp): the engine's `Drafter`
(cairn.workers.speculation).

`MtpDrafter(runner, head)` makes the runner keep each step's final hidden states and holds the
head's K/V: one page per arena block, beside the arena ([num_blocks, page_size, H_kv, D], K and
V, in the model's dtype: 1 / L_attn of the arena's bytes), read through the sequences' page
tables as the target's layers read theirs. So a page's head K/V moves with it on the device (the
runner's MOVE and COPY block copies move its rows too: `ModelRunner.block_rows`); a page brought back from the host tier or
a peer brings only the target's K/V, and its head K/V is whatever that block held: it changes
what the head drafts there, never what the engine outputs (every draft is verified).

`propose(runs)`, after a step's kept tokens are applied:
1. The head runs over every position each run kept (one varlen batch: a run of a few
   positions, a decode's or a verify's, as that many decode rows; a prompt's chunk as a prefill
   segment), each position t reading the target's hidden state at t and the embedding of token
   t + 1 (`ModelRunner.prepare`'s `shift`): it writes its K/V there.
2. A run that wants drafts takes the argmax of the LM head over the head's state at its last
   position (among the tokens `constrain` leaves: a grammar's, so that a constrained row's
   drafts are ones its grammar allows): the first draft. Each further one applies the head again, one row a sequence at the
   next position, reading the drafted token's embedding and the head's own last state, while
   that position lies in the pages the sequence holds (its verify step needs them too).
Each draft round reads its argmax back (one small read a round).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from cairn import kernels
from cairn.workers.execution.runner import ModelRunner
from cairn.workers.model import ModelCaches
from cairn.workers.model import packed_linear
from cairn.workers.model.packed_linear import pack_linears
from cairn.workers.model.mtp import MultiTokenPredictor
from cairn.workers.plan import Segment, StepPlan
from cairn.workers.sequence import Sequence
from cairn.workers.speculation import DraftRun

SHORT_RUN = 8  # a run of at most this many positions goes through the decode rows (`propose`)


class MtpDrafter:
    def __init__(self, runner: ModelRunner, head: MultiTokenPredictor):
        self.runner, self.head = runner, head
        runner.keep_hidden = True
        pack_linears(head)
        shape = tuple(runner.caches.kv[0][0].shape)  # [num_blocks, page_size, H_kv, D]: one attention layer's K
        self.kv = (torch.zeros(shape, dtype=runner.dtype, device=runner.device),
                   torch.zeros(shape, dtype=runner.dtype, device=runner.device))
        self.caches = ModelCaches(list(runner.caches.kv) + [self.kv], runner.caches.conv_states,
                                  runner.caches.ssm_states)
        runner.block_rows += self.kv  # it follows the device's page moves and copies
        # masks a round's logits [n, vocab] (fp32) of these sequences to what each may draft next
        # (the engine's: a grammar's allowed tokens after its output and its drafts so far)
        self.constrain: Callable[[torch.Tensor, list[Sequence]], None] | None = None

    def warm_up(self, max_rows: int) -> int:
        """The head's packed linears at every row count a pass of at most `max_rows` rows gives
        them (CPU; cairn.workers.model.packed_linear.warm_up); the products run."""
        return packed_linear.warm_up(self.head, max_rows, 0)

    @property
    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    @torch.inference_mode()
    def propose(self, runs: list[DraftRun]) -> None:
        """Drafts for `runs` (the engine has emptied the drafts of every sequence the step
        sampled, and leaves out segments of which nothing stands)."""
        if not runs or self.runner.hidden is None:
            return
        runner, model = self.runner, self.runner.model
        # a run of a few positions (a decode, a verify's kept tokens) is that many decode rows,
        # each attending up to its own position (every row's K/V is stored before any attends):
        # the prefill path's per-segment work is for prompts
        short = [r for r in runs if r.segment.num_tokens <= SHORT_RUN]
        prefills = [r for r in runs if r.segment.num_tokens > SHORT_RUN]
        order = short + prefills
        decodes = [Segment(r.segment.seq, r.segment.start + j, 1) for r in short for j in range(r.segment.num_tokens)]
        plan = StepPlan(decodes=decodes, prefills=[Segment(r.segment.seq, r.segment.start, r.segment.num_tokens)
                                                   for r in prefills])
        work = runner.prepare(plan, shift=1)
        rows = np.concatenate([np.arange(r.row, r.row + r.segment.num_tokens) for r in order])
        hidden = runner.hidden.index_select(0, torch.from_numpy(rows).to(runner.hidden.device))
        x = self._apply(work, hidden)
        ends = np.cumsum([r.segment.num_tokens for r in order]) - 1  # each run's last row in `x`
        drafting = [(i, r) for i, r in enumerate(order) if r.want > 0]
        if not drafting:
            return
        last = torch.tensor([int(ends[i]) for i, _ in drafting], device=x.device)
        state = x.index_select(0, last)
        active = [r.segment.seq for _, r in drafting]
        wants = {id(r.segment.seq): r.want for _, r in drafting}
        ps = runner.page_size
        for j in range(max(wants.values())):
            logits = model.head_logits(state)
            if self.constrain is not None:
                self.constrain(logits, active)
            ids = kernels.argmax_rows(logits).tolist()
            going, keep = [], []
            for i, (seq, token) in enumerate(zip(active, ids)):
                if token < 0:  # non-finite draft logits: no more drafts for it
                    continue
                seq.draft.append(token)
                position = seq.num_computed + j  # where the next round reads this token
                if len(seq.draft) < wants[id(seq)] and position < len(seq.cache.page_ids) * ps:
                    going.append(seq)
                    keep.append(i)
            if not going:
                return
            step = StepPlan(decodes=[Segment(seq, seq.num_computed + j, 1) for seq in going])
            work = runner.prepare(step, input_ids=[seq.draft[-1] for seq in going])
            state = self._apply(work, state.index_select(0, torch.tensor(keep, device=state.device)))
            active = going

    def _apply(self, work, hidden: torch.Tensor) -> torch.Tensor:
        """The head over one prepared batch: its normed states [T, H]."""
        tensors = self.runner.upload(work.arrays())
        batch = work.batch(tensors)
        return self.head(self.runner.model.embed(batch.input_ids), hidden, batch, self.caches)
