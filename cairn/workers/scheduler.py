"""Continuous batching over the prefix cache: each step, which sequences compute how many tokens,
from where, and which states are saved on the way; after it, what the step's tokens mean.

`schedule` builds a `StepPlan`: decodes (one token each) and prefill chunks together, at most
`max_num_batched_tokens` tokens and `max_num_seqs` running sequences. Running sequences are
served oldest first; when one needs a page and none can be had, the newest running sequence is
preempted: it gives back what it holds and waits at the head of the queue to recompute later.
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
(`snapshots`).

A paused sequence (`Sequence.paused`: its reader has not taken its outputs, `cairn.workers.async_engine`)
keeps its slot and pages but gets no tokens until it is resumed.

`postprocess` is the step's second half: computed tokens advance, whole pages are registered,
checkpoints committed, sampled tokens appended, and sequences that stop (EOS, a stop id,
`max_tokens`, the model's length) finish. Plans, not tensors: this module imports no torch.
It is `advance` (what needs no sampled token) then `apply_tokens`: async scheduling
(cairn.workers.engine) runs them apart, and plans the next step between them when `plans_ahead`
says that plan is the one `schedule` would make once the tokens are known (less the rows of
sequences that stop), leaving the checkpoints at the page boundaries it reaches to
`plan_deferred` (with the next token's page, which a decoding sequence whose next token starts
a page takes a step early, after the step's own pages and admissions, where no one is preempted
for it: `_look_ahead`).

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
from cairn.workers.cache.checkpoint_policy import BRANCH, EVERY, CheckpointPolicy
from cairn.workers.cache.prefix_cache import Match, PrefixCache
from cairn.workers.engine_errors import SequenceFault
from cairn.workers.engine_options import EngineOptions
from cairn.workers.plan import Commit, Segment, StepPlan
from cairn.workers.sequence import Sequence, Status, TokenLogprob
from cairn.workers.slot import HostSlot
from cairn.workers.tenant_queue import TenantQueue, fair_order, running_by_tenant, share_among_tenants

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, options: EngineOptions, cache: PrefixCache, policy: CheckpointPolicy,
                 eos_token_ids: frozenset[int] = frozenset()):
        self.options, self.cache, self.policy = options, cache, policy
        self.eos_token_ids = eos_token_ids
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
        # that verify segments keep their intermediate states in (`_take_states`, `settle`)
        self.spare_slots: list[int] = []

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
        (`plans_ahead` said it may be): the checkpoints of decodes reaching a page boundary are
        left to `plan_deferred`, once it is known which of them go on."""
        plan = StepPlan()
        budget = self.options.max_num_batched_tokens
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
            if n > budget:
                n = budget
            if left is not None:
                n = min(n, left.get(seq.tenant, 0))
                if n <= 0:  # its tenant's share of the step is spent
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
            elif n == 1:
                decodes.append(Segment(seq, start, 1))
                plan.lookahead.append(seq)
            else:
                prefills.append(Segment(seq, start, n))
            budget -= n
            if left is not None:
                left[seq.tenant] -= n
            i += 1
        if self.waiting and budget > 0 and not plan.preempted:
            inflight = self._inflight_pages()
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
            self._take_early_pages(plan)
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
                        self._checkpoints_or_fail(plan, seg)
            self._take_states(plan, whole=budget > 0 or not self.waiting)
        if plan:
            plan.page_table_writes = self.cache.take_page_table_writes()
            plan.block_copies = self.cache.take_block_copies()
        return plan

    def _take_states(self, plan: StepPlan, whole: bool = True) -> None:
        """A spare slot (`spare_slots`: beside the cache's arena, so the cache is as without
        speculation) for the state after each drafted token of the plan's verify segments: a
        segment gets as many drafts as slots are left (none: a plain decode). A step that
        prefills verifies drafts beside its prompts' chunks where the token budget held them
        all: every running prompt's chunk is the rest of it, and the budget was not spent before
        the waiting prompts (`whole`); else none (drafts never take a prompt's tokens)."""
        cut = plan.prefilling and (not whole or any(
            seg.end < seg.seq.num_tokens for seg in plan.prefills if not seg.verify))
        for seg in plan.decodes + plan.prefills:
            if seg.drafts:
                take = 0 if cut else min(seg.drafts, len(self.spare_slots))
                seg.states = [self.spare_slots.pop() for _ in range(take)]
                seg.drafts, seg.num_tokens = take, 1 + take
        # a verify chunk's states the chunked rule takes (verify decode rows: `ForwardBatch.level_saves`);
        # one left without drafts is a plain decode
        for seg in plan.prefills:
            if seg.verify:
                seg.ckpt_slots = {j + 1: [slot] for j, slot in enumerate(seg.states)}
        plain = [seg for seg in plan.prefills if seg.verify and not seg.drafts]
        if plain:
            plan.prefills = [seg for seg in plan.prefills if seg.drafts or not seg.verify]
            plan.decodes += plain

    def settle(self, plan: StepPlan, kept: dict[int, int]) -> list[tuple[int, int]]:
        """After a step with verify segments, once it is known how many tokens of each stand
        (`kept`, by `id(seq)`: 1 + the drafted tokens kept; a sequence missing there, finished or
        failed, keeps none): each such segment ends after its kept tokens, so only they advance,
        and only whole pages of them are registered. A verify segment lies in one page, so a
        boundary its kept tokens reach is their end: the page after it is taken a step early, and
        the checkpoints there are planned, as for a decode ending the page (`schedule`), copied
        after the step from the sequence's slot once rolled back (`plan.snapshots` /
        `plan.host_snapshots`, which the caller runs after the returned copies). Returns the
        rollbacks, (spare slot, sequence's state slot): the state after its last kept token,
        copied over the one after its last drafted one. The spare slots are free again."""
        rollbacks: list[tuple[int, int]] = []
        plan.snapshots, plan.host_snapshots = [], []
        for seg in plan.decodes + plan.prefills:
            if not seg.verify:
                continue
            seq, states = seg.seq, seg.states
            seg.states = []
            self.spare_slots += states
            n = kept.get(id(seq), 0) if not seq.finished else 0
            seg.num_tokens = n  # nothing stands: nothing of it is advanced or stored
            if n == 0:
                continue
            if n <= len(states):
                rollbacks.append((states[n - 1], seq.cache.state_slot))
            if n > 1 and seg.end % self.page_size == 0:  # as a decode ending this page would have
                self._look_ahead(seq, seg.end + 1)
            if self.cache.recurrent:  # (a boundary it reaches is its end: it lies in one page)
                self._checkpoints_or_fail(plan, seg)
        return rollbacks

    def plans_ahead(self, pending: list[Sequence]) -> bool:
        """Whether the next plan can be made before the tokens that `pending` (the running
        sequences sampling in the step in flight, already `advance`d) draw there are known
        (async scheduling, cairn.workers.engine): true when that plan is the one `schedule` would
        make once they are, less the rows of those that stop there. So: nothing waits to be
        admitted, every running sequence that is not paused is one of `pending` (its next
        segment is the decode of its pending token), the new pages those decodes need come from
        free blocks alone (nothing evicted, so nothing preempted, and a page taken for a sequence
        that stops goes back leaving the cache as it was), and they fit the step's budget.
        Checkpoints at the page boundaries they reach wait for `plan_deferred`."""
        if self.waiting:
            return False
        ps, mine = self.page_size, {id(seq) for seq in pending}
        rows = pages = 0
        for seq in self.running:
            if seq.paused:
                continue
            position = seq.num_computed  # where the pending token goes
            if id(seq) not in mine or position != seq.num_tokens:
                return False
            rows += 1
            pages += len(seq.cache.page_ids) * ps <= position
        return rows <= self.options.max_num_batched_tokens and self.cache.can_take_free_pages(pages)

    def plan_deferred(self, plan: StepPlan) -> None:
        """What `schedule` would have done for a plan made `ahead` once the tokens before it are
        known, for the sequences that go on (one that stopped does none of it), in its order: the
        next token's page taken a step early (`_look_ahead`), then the checkpoints of decodes
        reaching a page boundary (states taken after the step: the runner copies them now, after
        the step it launched)."""
        self._take_early_pages(plan)
        for seg in plan.deferred:
            if not seg.seq.finished:
                self._checkpoints_or_fail(plan, seg)
        plan.deferred = []

    def _take_early_pages(self, plan: StepPlan) -> None:
        """`_look_ahead` for the plan's decodes still running (not preempted by a later one's
        pages, not stopped), in plan order."""
        for seq in plan.lookahead:
            if seq.status is Status.RUNNING:
                self._look_ahead(seq)
        plan.lookahead = []

    def _look_ahead(self, seq: Sequence, upto: int | None = None) -> None:
        """A decoding sequence whose next token starts a page takes that page now, if it can
        without preempting anyone (evicting as any growth does), after the step's own pages and
        admissions: so the step after this one needs no page for it, and can be planned before
        this one's tokens are read (`plans_ahead`). `upto`: its tokens once the next is in
        (default: once this step's token and the next are)."""
        upto = upto or seq.num_tokens + 1  # its tokens once this step's is in, and the next one's
        if upto <= seq.max_total_tokens and len(seq.cache.page_ids) * self.page_size < upto and \
                self.cache.can_grow(seq, upto):
            self.cache.grow(seq, upto)

    def _checkpoints_or_fail(self, plan: StepPlan, seg: Segment) -> None:
        """`_plan_checkpoints`; if it raises, the segment's sequence alone fails."""
        try:
            self._plan_checkpoints(plan, seg)
        except Exception as e:
            self._fail_in_plan(plan, seg.seq, SequenceFault(f"planning its checkpoints failed: {type(e).__name__}"), e)

    # ---- tenants ---------------------------------------------------------------------------------
    def _inflight_pages(self) -> dict[bytes, Sequence]:
        """Whole prompt pages running sequences compute from this step on, by hash."""
        inflight: dict[bytes, Sequence] = {}
        for seq in self.running:
            self._add_inflight(inflight, seq)
        return inflight

    def _add_inflight(self, inflight: dict[bytes, Sequence], seq: Sequence) -> None:
        whole = seq.num_tokens // self.page_size
        if seq.cache.registered_pages < whole:
            hashes = self.cache.extend_hashes(seq, whole)
            for j in range(seq.cache.registered_pages, whole):
                inflight.setdefault(hashes[j], seq)

    def _defer_for_twin(self, seq: Sequence, hit_pages: int, inflight: dict[bytes, Sequence]) -> bool:
        """True if a running sequence is computing `seq`'s next pages right now: `seq` waits a
        step and resumes from them, and the running one checkpoints where the two part."""
        hashes, whole = seq.cache.page_hashes, seq.num_tokens // self.page_size
        if hit_pages >= whole or hashes[hit_pages] not in inflight:
            return False
        if self.cache.recurrent and not ({BRANCH, EVERY} & self.policy.kinds):
            return False  # no state would be kept where they part: waiting would gain nothing
        owner, k = inflight[hashes[hit_pages]], hit_pages
        while k < whole and inflight.get(hashes[k]) is owner:
            k += 1
        if self.cache.recurrent:
            self.cache.want_checkpoint(owner, k * self.page_size, BRANCH)
        return True

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan, inflight: dict[bytes, Sequence]) -> int | None:
        """Starts `seq` at its resume point; returns the tokens scheduled (None: not now)."""
        cache = self.cache
        m = cache.match(seq)
        if self._defer_for_twin(seq, m.hit_pages, inflight):
            return None
        n = min(seq.num_tokens - m.resume_token, budget)
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
        self._add_inflight(inflight, seq)
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
        (plan.decodes if n == 1 else plan.prefills).append(segment)

    def _plan_checkpoints(self, plan: StepPlan, seg: Segment) -> None:
        seq, ps, policy, cache = seg.seq, self.page_size, self.policy, self.cache
        first, last = seg.start // ps + 1, seg.end // ps  # boundaries inside (start, end]
        targets = seq.cache.checkpoint_targets
        if any(seg.start < p <= seg.end for p in targets):  # (a decode step past the prompt has none)
            targets = policy.thin(targets, ps, bool(seq.hints), not cache.checkpoint_room())
        wanted = {p: set(k) for p, k in targets.items() if seg.start < p <= seg.end}
        if EVERY in policy.kinds:
            for j in range(max(first, seq.num_prompt_tokens // ps + 1), last + 1):
                wanted.setdefault(j * ps, set()).add(EVERY)  # decode crossings of the `all` baseline
        for pos in sorted(wanted):
            admitted = policy.admit(wanted[pos], room=cache.checkpoint_room())
            if not admitted:
                continue
            slot = cache.take_checkpoint_slot()
            if slot is None and cache.host:  # no device slot: the state goes straight
                slot = cache.take_host_checkpoint_slot()  # to the host tier, copied from the sequence's slot after the step
                if slot is not None:
                    seg.num_tokens = pos - seg.start  # so the segment ends at this boundary
                    plan.host_snapshots.append((seq.cache.state_slot, slot.blocks))
                    plan.commits.append(Commit(seq, slot, pos, admitted))
                    return  # later positions (and the finish capture) wait for the next step
            if slot is not None:
                self._attach(plan, seg, pos - seg.start, slot)
                plan.commits.append(Commit(seq, slot, pos, admitted))
        # The finish capture: the last boundary crossed, from the prompt's last one on.
        if policy.captures_finish is None or last < max(first, seq.num_prompt_tokens // ps, 1):
            return
        offset = last * ps - seg.start
        slot = cache.finish_capture(seq, last, at_end=offset == seg.num_tokens)
        if isinstance(slot, HostSlot):  # copied from the sequence's slot after the step
            plan.host_snapshots.append((seq.cache.state_slot, slot.blocks))
        elif slot is not None:
            self._attach(plan, seg, offset, slot)

    @staticmethod
    def _attach(plan: StepPlan, seg: Segment, offset: int, slot: int) -> None:
        if offset == seg.num_tokens:  # the segment's final state: copy the slot after the step
            plan.snapshots.append((seg.seq.cache.state_slot, slot))
        else:
            seg.ckpt_slots.setdefault(offset, []).append(slot)

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
