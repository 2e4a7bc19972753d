"""Continuous batching over the prefix cache: each step, which sequences compute how many tokens,
from where, and which states are saved on the way; after it, what the step's tokens mean.

`schedule` builds a `StepPlan`: decodes (one token each) and prefill chunks together, at most
`max_num_batched_tokens` tokens, `max_num_seqs` running sequences and the image tokens
`cairn.workers.image_budget` lets one step encode. Running sequences are served oldest first;
when one needs a page and none can be had, the newest running sequence is preempted: it gives
back what it holds and waits at the head of the queue to recompute later.
Tenants (each sequence's `tenant`) share the engine (`cairn.workers.tenant_queue`): with more than one
at work, the slots are shared (a tenant with waiting work below its share of `max_num_seqs`
takes a slot from the tenant most above it, whose newest sequence is preempted), the step's
tokens are split max-min fairly among them, running sequences are served with tenants taking
turns (a page shortage preempts the newest of the tenant running the most), and the next to
admit is the oldest waiting sequence of the tenant running the fewest. With one tenant all of
this is first come, first served, as above.
Running out of pages is never an error. A waiting sequence is matched against the prefix cache
and admitted only if the cache says it fits (`can_admit`, no side effects), starting at its
resume point with its state restored from the checkpoint it resumes from; one whose next pages a
running sequence is computing right now waits a step to share them (that sequence checkpoints
where the two prompts part).

Checkpoints cost a copy, not compute: a state wanted at a boundary inside a segment is taken
from the chunked delta rule (`ckpt_slots`), one at a segment's end is a slot copy after the step
(`snapshots`): cairn.workers.checkpoint_planning. A waiting prompt whose next pages a running
sequence computes now waits a step for them (cairn.workers.shared_prefill).

A paused sequence (`Sequence.paused`: its reader has not taken its outputs, cairn.workers.engine_front)
keeps its slot and pages but gets no tokens until it is resumed.

`postprocess` is the step's second half: computed tokens advance, whole pages are registered,
checkpoints committed, sampled tokens appended, and sequences that stop (EOS, a stop id,
`max_tokens`, the model's length) finish. Plans, not tensors: this module imports no torch.
It is `advance` (what needs no sampled token) then `apply_tokens`, which async scheduling runs
apart (cairn.workers.async_scheduling), planning the next step between them (`schedule(ahead=True)`,
which leaves the checkpoints of decodes reaching a page boundary to be planned once their tokens
are known). A decoding sequence whose next token starts a page takes it a step early, after the
step's own pages and admissions, where no one is preempted for it (`look_ahead`).

Admission never livelocks: when nothing runs, the head of the queue is admitted cold (no hit
pages held, no checkpoint pinned) if its deepest resume point does not fit, since a cold start
always fits an idle cache (`Engine.add` refused what could never fit).

Faults stay with their sequence: an exception in one sequence's admission, page reservation,
sample, stop check or cache operation fails that sequence alone (`fail`: finish_reason "error",
what it holds given back) and the step goes on for the others; `take_failed` hands them to the
engine, which reports them.
"""

from __future__ import annotations

import logging
import time

from cairn.cache_service.events import HOST
from cairn.workers.cache.checkpoint_policy import CheckpointPolicy
from cairn.workers.checkpoint_planning import plan_checkpoints
from cairn.workers.shared_prefill import add_inflight, defer_for_twin, inflight_pages
from cairn.workers.cache.prefix_cache import Match, PrefixCache
from cairn.workers.engine_errors import SequenceFault
from cairn.workers.engine_options import EngineOptions
from cairn.workers.image_budget import ImageBudget
from cairn.workers.plan import Segment, StepPlan
from cairn.workers.sequence import Sequence, Status, TokenLogprob
from cairn.workers.speculative.verify_slots import take_states
from cairn.workers.tenant_queue import TenantQueue, fair_order, running_by_tenant, share_among_tenants

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, options: EngineOptions, cache: PrefixCache, policy: CheckpointPolicy,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.options, self.cache, self.policy, self.eos_token_ids = options, cache, policy, eos_token_ids
        self.page_size = cache.page_size
        self.waiting = TenantQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_fair_preemptions = 0  # of those, to give a tenant below its share of the slots one
        self.hit_tokens = 0
        self.hit_tokens_by_tier: dict[str, int] = {}  # device: resumed from the device alone; host: with host copies
        # A request whose resume point is copied back from the host starts a step later when other
        # sequences run in this one, so the copy overlaps their step (the engine sets it on CUDA,
        # where the copies run on a stream of their own: cairn.workers.execution.runner).
        self.overlap_promotions = False
        self.overlapped_promotions = 0
        self._failed: list[Sequence] = []
        # speculative decoding: state slots beside the cache's arena (`ArenaLayout.spare_slots`)
        # that verify segments keep their intermediate states in (cairn.workers.speculative.verify_slots)
        self.spare_slots: list[int] = []
        self.merge_size = 1  # a vision-language model's spatial merge size (Engine.use_vision), for ImageBudget

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable_work(self) -> bool:
        """Work a step could do now: a waiting sequence, or a running one that is not paused."""
        return bool(self.waiting) or any(not seq.paused for seq in self.running)

    # ---- planning ------------------------------------------------------------------------------
    def schedule(self, ahead: bool = False) -> StepPlan:
        """The next step's plan. `ahead`: it is made before the last step's tokens are read
        (cairn.workers.async_scheduling.plans_ahead said it may be): the checkpoints of decodes
        reaching a page boundary are left to `plan_deferred` there, once it is known which of them
        go on."""
        plan = StepPlan()
        budget = self.options.max_num_batched_tokens
        self.images = ImageBudget(self.options.max_image_tokens_per_step or budget, self.merge_size)
        ps, running, decodes, prefills = self.page_size, self.running, plan.decodes, plan.prefills
        # tokens each tenant may take this step (None: one tenant at work)
        left = share_among_tenants(running, self.waiting, self.options.max_num_seqs, budget,
                                   self._preempt_for_fairness)
        order = list(running) if left is None else fair_order(running)
        i = 0
        while i < len(order) and budget > 0:
            seq = order[i]
            if seq.paused:  # its reader is behind: it keeps what it holds and waits
                i += 1
                continue
            start = seq.num_computed
            n = len(seq.token_ids) - start
            n = min(n, budget if left is None else min(budget, left.get(seq.tenant, 0)))
            n = self.images.cut(seq, start, n) if seq.images else n
            if n <= 0:  # its tenant's share of the step is spent, or the step's image budget
                i += 1
                continue
            if len(seq.cache.page_ids) * ps < start + n:
                try:
                    if not self._reserve_pages(seq, start + n, plan, order):
                        break  # seq itself was preempted; everything after it already was
                except Exception as e:  # its page reservation failed: it alone ends
                    order.pop(i)
                    self.fail(seq, SequenceFault(f"reserving pages failed: {type(e).__name__}"), e)
                    continue
            if n == 1 and seq.draft:  # a decode and the tokens drafted after it: one verify segment
                room = budget if left is None else min(budget, left.get(seq.tenant, 0))
                d = min(len(seq.draft), room - 1, ps - 1 - start % ps)  # (in its first token's page)
                # a chunk of the prefill path, or (exact) rows of the decode path, one per token
                (prefills if d > 0 and not self.options.speculative_exact else decodes).append(
                    Segment(seq, start, 1 + max(d, 0), drafts=max(d, 0), verify=True))
                plan.lookahead.append(seq)
                n += max(d, 0)
            elif n == 1 and seq.decodes_at(start):
                decodes.append(Segment(seq, start, 1))
                plan.lookahead.append(seq)
            else:
                prefills.append(Segment(seq, start, n))
            budget -= n
            if left is not None:
                left[seq.tenant] -= n
            i += 1
        if self.waiting and budget > 0 and not plan.preempted:
            inflight = inflight_pages(self.cache, self.running)
            counts = running_by_tenant(running) if left is not None else {}
            while self.waiting and budget > 0 and len(running) < self.options.max_num_seqs:
                seq = self.waiting.head(counts, left)
                if seq is None:  # every tenant with waiting work has spent its share
                    break
                try:
                    admitted = self._admit(seq, budget if left is None else min(budget, left[seq.tenant]), plan,
                                           inflight)
                except Exception as e:  # its admission failed: it alone ends
                    self._fail_in_plan(plan, seq, SequenceFault(f"admission failed: {type(e).__name__}"), e)
                    continue
                if admitted is None:
                    break
                budget -= admitted
                if left is not None:
                    left[seq.tenant] -= admitted
                    counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
        if not ahead:  # after every admission: a page a step early never costs anyone theirs
            self.take_early_pages(plan)
        if self.cache.recurrent:  # after admission: it may add branch targets to running ones
            for seg in plan.decodes + plan.prefills:  # a boundary crossed, or a target inside a page (in the prompt)
                if seg.verify:  # planned once it is known how many of its tokens stand (`settle`)
                    continue
                start, end = seg.start, seg.start + seg.num_tokens
                if start // ps != end // ps or (end <= len(seg.seq.prompt_token_ids) and
                                                any(start < p <= end for p in seg.seq.cache.checkpoint_targets)):
                    if ahead:
                        plan.deferred.append(seg)
                    else:
                        self.checkpoints_or_fail(plan, seg)
            take_states(plan, self.spare_slots, whole=budget > 0 or not self.waiting)
        if plan:
            plan.page_table_writes = self.cache.take_page_table_writes()
            plan.block_copies = self.cache.take_block_copies()
        return plan

    def take_early_pages(self, plan: StepPlan) -> None:
        """`look_ahead` for the plan's decodes still running (not preempted by a later one's
        pages, not stopped), in plan order."""
        for seq in plan.lookahead:
            if seq.status is Status.RUNNING:
                self.look_ahead(seq)
        plan.lookahead = []

    def look_ahead(self, seq: Sequence, upto: int | None = None) -> None:
        """A decoding sequence whose next token starts a page takes that page now, if it can
        without preempting anyone (evicting as any growth does), after the step's own pages and
        admissions: so the step after this one needs no page for it, and can be planned before
        this one's tokens are read (async scheduling). `upto`: its tokens once the next is in
        (default: once this step's token and the next are)."""
        upto = upto or seq.num_tokens + 1  # its tokens once this step's is in, and the next one's
        if upto <= seq.max_total_tokens and len(seq.cache.page_ids) * self.page_size < upto and \
                self.cache.can_grow(seq, upto):
            self.cache.grow(seq, upto)

    def checkpoints_or_fail(self, plan: StepPlan, seg: Segment) -> None:
        """`_plan_checkpoints`; if it raises, the segment's sequence alone fails."""
        try:
            plan_checkpoints(self.cache, self.policy, plan, seg)
        except Exception as e:
            self._fail_in_plan(plan, seg.seq, SequenceFault(f"planning its checkpoints failed: {type(e).__name__}"), e)

    # ---- tenants ---------------------------------------------------------------------------------
    def _admit(self, seq: Sequence, budget: int, plan: StepPlan, inflight: dict[bytes, Sequence]) -> int | None:
        """Starts `seq` at its resume point; returns the tokens scheduled (None: not now)."""
        cache = self.cache
        m = cache.match(seq)
        if defer_for_twin(self.cache, self.policy, seq, m.hit_pages, inflight):
            return None
        n = min(seq.num_tokens - m.resume_token, budget)
        n = self.images.cut(seq, m.resume_token, n) if seq.images else n
        if n <= 0:
            return None  # the step's image budget is spent: it starts next step
        if not cache.can_admit(seq, m, n):
            if self.running:
                return None  # running sequences will finish and give back what it needs
            m = Match(0, 0, 0, None)  # nothing will: start cold, holding nothing of the cache
            n = min(seq.num_tokens, budget)
            if not cache.can_admit(seq, m, n):
                return None
        self.waiting.remove(seq)
        restore = cache.admit(seq, m, n)
        seq.num_computed = m.resume_token
        slot = seq.cache.state_slot
        if restore is not None:
            plan.restores.append((restore, slot))
        elif not m.from_host:  # (from the host: its blocks are copied into the slot before the step)
            plan.fresh_state_slots.append(slot)
        if not seq.admitted_once:
            seq.admitted_once = True
            seq.queue_s = time.monotonic() - seq.added_at
            seq.cached_tokens = m.resume_token
            self.hit_tokens += m.resume_token
            if m.resume_token:
                self.hit_tokens_by_tier[m.tier] = self.hit_tokens_by_tier.get(m.tier, 0) + m.resume_token
        seq.status = Status.RUNNING
        self.running.append(seq)
        add_inflight(self.cache, inflight, seq)
        if m.tier == HOST:
            if self.overlap_promotions and plan:
                self.overlapped_promotions += 1
                return 0  # its first segment is the next step's, once the copies are in
            plan.promotions_for_now = True
        self._add_segment(plan, seq, n)
        return n

    def _reserve_pages(self, seq: Sequence, upto: int, plan: StepPlan, order: list[Sequence]) -> bool:
        """Pages for `seq`'s tokens up to `upto`, preempting the last sequences of the step's
        `order` (the newest, with one tenant) until they can be had; False if `seq` itself was
        preempted."""
        while not self.cache.can_grow(seq, upto):
            victim = order.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is seq:
                return False
        self.cache.grow(seq, upto)
        return True

    def _add_segment(self, plan: StepPlan, seq: Sequence, n: int) -> None:
        segment = Segment(seq, seq.num_computed, n)
        (plan.decodes if n == 1 and seq.decodes_at(segment.start) else plan.prefills).append(segment)

    # ---- after the step --------------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, sampling: list[Sequence],
                    sampled: list[tuple[int, TokenLogprob | None] | SequenceFault]
                    ) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Applies a computed step: `sampled` holds one result for each of `sampling` (the plan's
        `sampling_sequences()`): a (token, logprob), or the `SequenceFault` of that row. Returns
        (sequence, token, logprob) for each sequence that got a token; finished ones are
        finished, failed ones are left to `take_failed`. It is `advance`, then `apply_tokens`."""
        self.advance(plan)
        return self.apply_tokens(sampling, sampled)

    def advance(self, plan: StepPlan) -> None:
        """The first half of `postprocess`, which needs no sampled token: the computed tokens
        advance, whole pages are registered, checkpoints committed. A sequence that ended since
        the plan was made (an abort between steps) is skipped, and its checkpoint slots go back."""
        cache, ps = self.cache, self.page_size
        for seg in plan.decodes + plan.prefills:
            seq = seg.seq
            if seq.finished:
                continue
            seq.num_computed = end = seg.start + seg.num_tokens
            if end // ps > seq.cache.registered_pages:
                try:
                    cache.register_pages(seq)
                except Exception as e:
                    self.fail(seq, SequenceFault(f"registering its pages failed: {type(e).__name__}"), e)
        for c in plan.commits:
            if c.seq.finished:
                cache.drop_pending_if_any(c.slot)
                continue
            try:
                cache.commit_checkpoint(c.seq, c.slot, c.position, c.kinds)
            except Exception as e:
                self.fail(c.seq, SequenceFault(f"storing a checkpoint failed: {type(e).__name__}"), e)
                cache.drop_pending_if_any(c.slot)

    def apply_tokens(self, sampling: list[Sequence], sampled: list[tuple[int, TokenLogprob | None] | SequenceFault]
                     ) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """The second half of `postprocess`: each of `sampling` gets its sampled token (or fails
        with its row's fault) and finishes if it stops there."""
        out = []
        for seq, result in zip(sampling, sampled):
            if result.__class__ is SequenceFault:
                self.fail(seq, result)
                continue
            if seq.finish_reason is not None:
                continue
            token, logprob = result
            try:
                seq.token_ids.append(token)
                if logprob is not None:
                    seq.logprobs.append(logprob)
                reason = self.stop_reason(seq, token, len(seq.token_ids))
                if reason is not None:
                    self.finish(seq, reason)
            except Exception as e:
                self.fail(seq, SequenceFault(f"applying its token failed: {type(e).__name__}"), e)
                continue
            out.append((seq, token, logprob))
        return out

    def stop_reason(self, seq: Sequence, token: int, length: int) -> str | None:
        """Why `seq` stops once `token` is its token number `length` (prompt included): "stop"
        (EOS unless ignored, a stop id), "length" (`max_total_tokens`), or None: it goes on."""
        params = seq.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        return "length" if length >= seq.max_total_tokens else None

    # ---- ending ----------------------------------------------------------------------------------
    def _preempt_for_fairness(self, seq: Sequence) -> None:
        self._preempt(seq)
        self.num_fair_preemptions += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fail(self, seq: Sequence, fault: SequenceFault, cause: BaseException | None = None) -> None:
        """Ends `seq` alone because of `fault` (finish_reason "error"); it is reported once by
        `take_failed`. What it holds goes back; if even that fails, its holdings are dropped from
        the sequence (the cache's integrity check would then say what is off)."""
        if seq.finished:
            return
        if cause is not None:
            log.error("request %s: %s", seq.request_id, fault, exc_info=cause)
        seq.error = str(fault)
        try:
            self.finish(seq, "error")
        except Exception:
            log.exception("request %s: giving back what it held failed", seq.request_id)
        self._failed.append(seq)

    def _fail_in_plan(self, plan: StepPlan, seq: Sequence, fault: SequenceFault, cause: BaseException) -> None:
        """`fail` for a sequence the plan being made already counts: it leaves the plan too, and
        the checkpoint slots taken for it go back."""
        state_slot, finish_slot = seq.cache.state_slot, seq.cache.finish_slot
        mine = {c.slot for c in plan.commits if c.seq is seq}
        self.fail(seq, fault, cause)
        plan.drop(seq, state_slot, mine | ({finish_slot} if finish_slot is not None else set()))
        for slot in mine:
            self.cache.drop_pending_if_any(slot)

    def abandon(self, plan: StepPlan) -> None:
        """The plan's step did not run (its forward pass failed): the checkpoint slots taken for
        it, and its verify segments' state slots, go back."""
        for c in plan.commits:
            self.cache.drop_pending_if_any(c.slot)
        for seg in plan.decodes + plan.prefills:
            self.spare_slots += seg.states
            seg.states = []

    def take_failed(self) -> list[Sequence]:
        """Sequences failed since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence (stop, length, abort or error) and returns what it holds; a sequence
        that stopped leaves its finish checkpoint, an aborted or failed one does not."""
        if seq.status is Status.FINISHED:
            return
        for queue in (self.running, self.waiting):
            try:
                queue.remove(seq)
                break
            except ValueError:
                pass
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if reason in ("abort", "error"):
            self.cache.release(seq)
        else:
            self.cache.finish(seq)
