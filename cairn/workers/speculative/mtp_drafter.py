"""Drafting with the checkpoint's MTP head (cairn.workers.model.mtp): the engine's `Drafter`
(cairn.workers.speculative.drafts).

`MtpDrafter(runner, head)` makes the runner keep each step's final hidden states and holds the
head's K/V: one page per arena block, beside the arena ([num_blocks, page_size, H_kv, D], K and
V, in the model's dtype: 1 / L_attn of the arena's bytes), read through the sequences' page
tables as the target's layers read theirs. So a page's head K/V moves with it (the runner's
MOVE and COPY block copies move its rows too, and DEMOTE and PROMOTE carry them through host rows
of their own: `ModelRunner.add_block_rows`), and a page fetched from a speculating peer brings
its head K/V too (`cairn.workers.cache.transfer`). One from a peer without a head keeps whatever
that block held: it changes what the head drafts there, never what the engine outputs (every
draft is verified).

`propose(runs)`, when the step after the one that kept those tokens begins (`Verifier.propose`):
`plan` (rank 0, which holds the sequences) makes a `DraftWork` of host arrays, and `run` (every
rank of a tensor-parallel engine, in step: `dispatch`) carries it out:
1. The head runs over every position each run kept (one varlen batch: a run of a few
   positions, a decode's or a verify's, as that many decode rows; a prompt's chunk as a prefill
   segment), each position t reading the target's hidden state at t and the embedding of token
   t + 1 (`ModelRunner.prepare`'s `shift`): it writes its K/V there.
2. A run that wants drafts picks a token from the LM head's logits over the head's state at its
   last position (`pick`, on rank 0: the engine's draws it as the sequence's sampler would draw
   its next output token, its grammar, penalties and uniform included; the other ranks take rank
   0's ids; without `pick`, the argmax): the first draft. Each further one applies the head
   again, one row a sequence at the next position (`StepWork.decode_rows`), reading the drafted
   token's embedding and the head's own last state, while that position lies in the pages the
   sequence holds (its verify step needs them too).
Each draft round reads its tokens back (one small read a round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cairn import kernels
from cairn.workers.execution.runner import ModelRunner
from cairn.workers.execution.step_work import StepWork
from cairn.workers.model import ModelCaches
from cairn.workers.model import packed_linear
from cairn.workers.model.packed_linear import pack_linears
from cairn.workers.model.mtp import MultiTokenPredictor
from cairn.workers.plan import Segment, StepPlan
from cairn.workers.sequence import Sequence
from cairn.workers.speculative.drafts import DraftRun

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
        # it follows its pages: device moves and copies, and the host tier (a host row a block)
        self.host_bytes = runner.add_block_rows(*self.kv)
        # a round's drafts from its logits [n, vocab] of these sequences after their drafts so far
        # ([n] int64, -1: none; the engine's: drawn as its sampler draws, `Sampler.draft_tokens`);
        # None: the argmax
        self.pick: Callable[[torch.Tensor, list[Sequence], list[list[int]]], torch.Tensor] | None = None
        # runs a `DraftWork` on every rank: (work, this rank's run) -> its result (one device: the run)
        self.dispatch: Callable[[DraftWork, Callable[[], list[list[int]]]], list[list[int]]] = \
            lambda work, local: local()

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
        sampled, and leaves out segments of which nothing stands): `plan`, then `run` on every
        rank (`dispatch`)."""
        hidden = self.runner.hidden
        kept = [run.hidden for run in runs if run.hidden is not None]  # runs with hidden states of their own
        if kept:  # (one device: `held_back`) after the step's rows, in the order of the runs
            at, placed = 0 if hidden is None else hidden.shape[0], []
            for run in runs:
                if run.hidden is not None:
                    run, at = DraftRun(run.segment, at, run.want), at + run.hidden.shape[0]
                placed.append(run)
            runs, hidden = placed, torch.cat(([] if hidden is None else [hidden]) + kept)
        if not runs or hidden is None:
            return
        work, seqs = self.plan(runs)
        drafts = self.dispatch(work, lambda: self.run(work, seqs, hidden))
        for seq, tokens in zip(seqs, drafts):
            seq.draft = tokens

    def plan(self, runs: list[DraftRun]) -> tuple[DraftWork, list[Sequence]]:
        """The host's part of `propose` (rank 0, which holds the sequences): the head's first
        pass over every kept position, and each drafting sequence's numbers; with those
        sequences, in the work's order."""
        runner = self.runner
        # a run of a few positions (a decode, a verify's kept tokens) is that many decode rows,
        # each attending up to its own position (every row's K/V is stored before any attends):
        # the prefill path's per-segment work is for prompts
        short = [r for r in runs if r.segment.num_tokens <= SHORT_RUN]
        prefills = [r for r in runs if r.segment.num_tokens > SHORT_RUN]
        order = short + prefills
        decodes = [Segment(r.segment.seq, r.segment.start + j, 1) for r in short for j in range(r.segment.num_tokens)]
        first = runner.prepare(StepPlan(decodes=decodes, prefills=[
            Segment(r.segment.seq, r.segment.start, r.segment.num_tokens) for r in prefills]), shift=1)
        rows = np.concatenate([np.arange(r.row, r.row + r.segment.num_tokens) for r in order])
        ends = np.cumsum([r.segment.num_tokens for r in order]) - 1  # each run's last row in the first pass
        drafting = [(i, r) for i, r in enumerate(order) if r.want > 0]
        seqs = [r.segment.seq for _, r in drafting]
        ps = runner.page_size
        limit = np.array([len(seq.cache.page_ids) * ps for seq in seqs], np.int64)
        width = int(-(-limit.max() // ps)) if seqs else 1
        return DraftWork(first=first, rows=rows, last=np.array([ends[i] for i, _ in drafting], np.int64),
                         want=np.array([r.want for _, r in drafting], np.int64),
                         start=np.array([seq.num_computed for seq in seqs], np.int64), limit=limit,
                         page_table=runner.page_table.rows([seq.cache.row for seq in seqs], width),
                         slots=np.array([seq.cache.state_slot for seq in seqs], np.int64)), seqs

    @torch.inference_mode()
    def run(self, work: DraftWork, seqs: list[Sequence] = (), hidden: torch.Tensor | None = None) -> list[list[int]]:
        """The device's part (every rank of a tensor-parallel engine, in step: the head's layer
        is sharded as the target's are): the first pass, then the draft rounds. Each round's
        tokens are rank 0's (`pick` applies there, to `seqs`, the work's drafting sequences that
        rank 0 holds; the ranks take its ids, one small collective); returns each drafting
        sequence's drafts. `hidden`: the final hidden states `work.rows` index (default: the
        runner's, the last step's)."""
        runner, model = self.runner, self.runner.model
        hidden = runner.hidden if hidden is None else hidden
        hidden = hidden.index_select(0, torch.from_numpy(work.rows).to(hidden.device))
        x = self._apply(work.first, hidden)
        drafts: list[list[int]] = [[] for _ in work.want]
        if not drafts:
            return drafts
        state = x.index_select(0, torch.from_numpy(work.last).to(x.device))
        active = list(range(len(drafts)))
        for j in range(int(work.want.max())):
            logits = model.head_logits(state)
            if self.pick is not None and seqs:
                ids = self.pick(logits, [seqs[i] for i in active], [drafts[i] for i in active])
            else:
                ids = kernels.argmax_rows(logits)
            if model.group is not None:  # rank 0's ids on every rank
                ids = model.group.all_reduce(ids if model.group.rank == 0 else torch.zeros_like(ids))
            going, keep = [], []
            for at, (i, token) in enumerate(zip(active, ids.tolist())):
                if token < 0:  # non-finite draft logits: no more drafts for it
                    continue
                drafts[i].append(token)
                position = int(work.start[i]) + j  # where the next round reads this token
                if len(drafts[i]) < work.want[i] and position < work.limit[i]:
                    going.append(i)
                    keep.append(at)
            if not going:
                break
            step = StepWork.decode_rows(work.page_table[going], work.start[going] + j,
                                        [drafts[i][-1] for i in going], work.slots[going], runner.page_size)
            state = self._apply(step, state.index_select(0, torch.tensor(keep, device=state.device)))
            active = going
        return drafts

    def _apply(self, work: StepWork, hidden: torch.Tensor) -> torch.Tensor:
        """The head over one prepared batch: its normed states [T, H]."""
        tensors = self.runner.upload(work.arrays())
        batch = work.batch(tensors)
        return self.head(self.runner.model.embed(batch.input_ids), hidden, batch, self.caches)


@dataclass
class DraftWork:
    """One `MtpDrafter.propose` as plain host data: what every rank runs (`MtpDrafter.run`).
    Per drafting sequence (the arrays after `last`): its drafts wanted, where its first draft
    is read (its computed tokens), the positions its pages hold, its page-table row, its slot."""
    first: StepWork  # the head over every kept position (`ModelRunner.prepare`'s shift 1)
    rows: np.ndarray  # their rows in the step's hidden states
    last: np.ndarray  # each drafting sequence's last row in the first pass
    want: np.ndarray
    start: np.ndarray
    limit: np.ndarray
    page_table: np.ndarray
    slots: np.ndarray
