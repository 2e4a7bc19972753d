"""Continuous batching: each step, which sequences compute how many tokens.

A step holds decodes (one token each) and prefill chunks together, at most
`max_num_batched_tokens` tokens and `max_num_seqs` running sequences. Running sequences are
served oldest first; waiting ones are admitted while tokens, pages and a state slot are free.
When a running sequence needs a page and none is free, the newest running sequence is
preempted: it gives back its pages and slot and waits at the head of the queue to recompute
its tokens later. Running out of pages is never an error.

Plans, not tensors: this module imports no torch. The runner turns a `StepPlan` into tensors.
Decode segments come first in a plan (the model batches them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.options import EngineOptions
from workers.page_pool import PagePool
from workers.sequence import Sequence, Status
from workers.state_pool import StatePool


@dataclass
class Segment:
    seq: Sequence
    start: int  # tokens computed before this step
    num_tokens: int  # tokens computed in this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens


@dataclass
class StepPlan:
    decodes: list[Segment] = field(default_factory=list)
    prefills: list[Segment] = field(default_factory=list)
    fresh_state_slots: list[int] = field(default_factory=list)  # zero these before the step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def segments(self) -> list[Segment]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    def __init__(self, options: EngineOptions, pages: PagePool, states: StatePool):
        self.options = options
        self.pages = pages
        self.states = states
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.options.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if not self._reserve_pages(seq, n, plan):
                break  # seq itself was preempted; everything after it already was
            self._add_segment(plan, seq, n)
            budget -= n
            i += 1
        while (self.waiting and budget > 0 and not plan.preempted
               and len(self.running) < self.options.max_num_seqs and self.states.can_allocate()):
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            need = self.pages.pages_for_tokens(seq.num_computed + n) - len(seq.page_ids)
            if not self.pages.can_allocate(need):
                break
            self.waiting.popleft()
            seq.page_ids += self.pages.allocate(need)
            seq.state_slot = self.states.allocate()
            plan.fresh_state_slots.append(seq.state_slot)
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._add_segment(plan, seq, n)
            budget -= n
        return plan

    def _reserve_pages(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        need = self.pages.pages_for_tokens(seq.num_computed + n) - len(seq.page_ids)
        while not self.pages.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.page_ids += self.pages.allocate(need)
        return True

    @staticmethod
    def _add_segment(plan: StepPlan, seq: Sequence, n: int) -> None:
        segment = Segment(seq, seq.num_computed, n)
        (plan.decodes if n == 1 else plan.prefills).append(segment)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.pages.release(seq.page_ids)
        seq.page_ids = []
        if seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (stop, length or abort) and returns what it holds."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
