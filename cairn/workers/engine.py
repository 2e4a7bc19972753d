"""The engine: requests in, tokens out, one step at a time. No Ray, no asyncio.

`Engine.from_pretrained(dir, options)` (an `EngineOptions`, or its fields as keyword arguments)
loads a checkpoint (see cairn.workers.model.loader) and lays out the cache's arena from the
options (cairn.workers.cache.arena). `add` checks a request
(`cairn.workers.request_check`: one that can never fit, a prompt beyond `max_model_len` or more pages
than the arena holds beside a state, is refused with `RequestRejected` there, never halfway
through) and queues it, or holds it while its grammar compiles or its resume point is fetched
from a peer (`cairn.workers.engine_peer_fetch`); `add_request` is `add` from loose fields. `step` is the
loop's body: the scheduler plans, the runner runs the model once, the sampler picks tokens, the
scheduler applies the step (`postprocess`), and a `RequestOutput` (`cairn.workers.output`) comes back
for every request that produced a token or finished; `generate` runs a batch to completion, and
says at once which requests can never finish if the engine has nothing left to run.

Stops: EOS ids from config.json and generation_config.json (unless `ignore_eos`),
`stop_token_ids`, `max_tokens`, or the model's length (`finish_reason` "stop" / "length";
"abort" for `abort`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cairn.cache_service.events import EventBatch, EventStream
from cairn.kernels.common import compile_watch
from cairn.kernels.common.dispatch import runs_triton
from cairn.workers.cache import transfer
from cairn.workers.cache.arena import ArenaLayout
from cairn.workers.cache.checkpoint_policy import CheckpointPolicy
from cairn.workers.cache.device_budget import graph_reserve_bytes
from cairn.workers.cache.prefix_cache import Match, PrefixCache
from cairn.workers.cache.transfer import FetchPlan, ResumeExport
from cairn.workers.engine_errors import EngineBroken, EngineError, RequestRejected, SequenceFault
from cairn.workers.output import RequestOutput
from cairn.workers.engine_peer_fetch import EnginePeerFetch
from cairn.workers.grammar import Grammars
from cairn.workers.kernel_warm_up import warm_kernels
from cairn.workers.engine_metrics import EngineMetrics, EngineTotals
from cairn.workers.model import HybridForCausalLM, ModelConfig
from cairn.workers.model.mtp import MultiTokenPredictor
from cairn.workers.engine_options import EngineOptionError, EngineOptions
from cairn.workers.plan import BlockCopy, Segment, StepPlan
from cairn.workers.request import GenerateRequest
from cairn.workers.request_check import check
from cairn.workers.execution.runner import ModelRunner
from cairn.workers.sampler import Draw, Sampler
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.scheduler import Scheduler
from cairn.workers.sequence import PENDING, Sequence, Status
from cairn.workers.spec import EngineSpec
from cairn.workers.speculation import (WAITING_STEPS, DraftRun, Drafter, SpeculationGate, SpeculationTotals,
                                       held_back, kept_tokens)
from cairn.workers.execution.tp_runner import TensorParallelRunner

log = logging.getLogger(__name__)



@dataclass
class _Flight:
    """A step launched by one call of `Engine.step` whose tokens the next call reads."""
    plan: StepPlan
    sampling: list[Sequence]  # its sampling rows, in the order of `draw`
    draw: Draw


class Engine:
    def __init__(self, model: HybridForCausalLM, options: EngineOptions | None = None,
                 fingerprint: str | None = None, worker_id: str = "local",
                 eos_token_ids: frozenset[int] = frozenset(), rank_workers=None,
                 mtp: MultiTokenPredictor | None = None):
        """`model`: the whole model, or rank 0's shard of it with `rank_workers`
        (cairn.workers.execution.tp_runner.RankWorkers) running the other ranks' shards. `mtp`:
        the checkpoint's MTP head, which `num_speculative_tokens` > 0 needs (one device)."""
        dtype = next(model.parameters()).dtype
        # The engine runs in its model's dtype, which its options (and its spec) then name.
        self.options = options = replace(options or EngineOptions(), dtype=str(dtype).removeprefix("torch."))
        self.model = model
        cfg: ModelConfig = model.config
        self.config = cfg
        self.spec = EngineSpec.of(cfg, options, fingerprint)
        self.worker_id = worker_id
        self.layout = layout = ArenaLayout.plan(cfg, options, dtype.itemsize)
        self._eos = frozenset(cfg.eos_token_ids) | eos_token_ids
        self.runner = ModelRunner(model, layout, options.page_size, options.max_num_seqs + 1)
        self.policy, self.cache, self.scheduler = self._bookkeeping()
        if layout.host_blocks:  # the cost rule starts from a measured host bandwidth
            self.cache.tier_cost.bandwidth = self.runner.measure_host_bandwidth()
        on_cuda = self.runner.device.type == "cuda"
        self.drafter: Drafter | None = None  # speculative decoding (cairn.workers.speculation)
        self.speculation = SpeculationTotals()
        self.gate = SpeculationGate() if options.speculative_adaptive else None
        # the head's pass over the last step's kept positions, run when the next one begins (`_propose`)
        self._proposal: list[DraftRun] = []
        self._waiting: dict[int, DraftRun] = {}  # runs over prompts' earlier chunks (`held_back`)
        if options.num_speculative_tokens:
            if mtp is None:
                raise EngineOptionError("num_speculative_tokens", "num_speculative_tokens needs the checkpoint's MTP "
                                        "head (mtp.* tensors)")
            from cairn.workers.execution.mtp_drafter import MtpDrafter
            self.drafter = MtpDrafter(self.runner, mtp)
            log.info("speculative decoding: %d drafted tokens a step (%s mode); the MTP head's K/V %.1f MiB "
                     "(%.1f MiB more on the host tier), %d spare state slots %.1f MiB", options.num_speculative_tokens,
                     "exact" if options.speculative_exact else "default", self.drafter.memory_bytes / 2**20,
                     self.drafter.host_bytes / 2**20, layout.spare_slots, layout.spare_bytes / 2**20)
        eager = not on_cuda if options.enforce_eager is None else options.enforce_eager
        if rank_workers is None and not eager:
            # decode steps at fixed batch sizes over fixed buffers; graphs captured on CUDA (a
            # tensor-parallel engine stays eager: its collectives are not captured). In the exact
            # mode verify steps too: k + 1 levels of rows a bucket (the default mode's verify is a
            # prefill chunk, eager); their padding rows' state saves go to the last spare slot
            depth = options.num_speculative_tokens if self.drafter is not None and options.speculative_exact else 0
            self.runner.use_decode_graphs(options.max_num_seqs, -(-self.spec.max_model_len // options.page_size),
                                          capture=on_cuda, depth=depth, padding_slot=layout.padding_slot)
            if on_cuda:
                estimate = graph_reserve_bytes(cfg, options.max_num_seqs * (1 + depth))
                (log.warning if self.runner.graphs.memory_bytes > estimate else log.info)(
                    "decode graphs hold %.1f MiB (the arena was sized leaving %.1f MiB for them under "
                    "memory_utilization); capture took %.1f s", self.runner.graphs.memory_bytes / 2**20,
                    estimate / 2**20, self.runner.graphs.capture_s)
        if rank_workers is not None:
            rank_workers.wait_ready(layout.num_blocks, timeout_s=max(120.0, options.collective_timeout_s))
            self.runner = TensorParallelRunner(self.runner, rank_workers)
            if self.drafter is not None:  # every rank runs the head's share
                self.drafter.dispatch = self.runner.dispatch
        self.sampler = Sampler(options.seed, self._eos)
        if self.drafter is not None:  # drafts drawn as the sampler would draw them (its current one)
            self.drafter.pick = lambda logits, seqs, drafts: self.sampler.draft_tokens(logits, seqs, drafts)
        self.events = EventStream(worker_id)
        self.stats = EngineTotals()
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.broken: str | None = None  # why the engine can run nothing more (EngineBroken)
        self.fetches = EnginePeerFetch(self.cache, lambda: transfer.BlockIO(
            self.runner.read_blocks, self.flush_block_copies, self.runner.read_block_rows, self.runner.block_row_bytes),
            options.tensor_parallel_size > 1)
        if self.drafter is not None:  # an export's pages carry the head's K/V at every position they hold
            self.fetches.before_export = lambda: (self._proposal or self._waiting) and self._propose(flush=True)
        self.on_runnable: Callable[[], None] | None = None  # called from other threads when held work may run
        self._held: list[Sequence] = []  # held back until their grammars compile and their fetches arrive
        self._compiles_seen: int | None = None  # kernel compiles at warm-up's end (None: not warmed up)
        # async scheduling (`step`): one device only (a rank's inputs travel from the host)
        self._async = options.async_scheduling and rank_workers is None and self.drafter is None
        self._flight: _Flight | None = None  # the step whose drawn tokens the next call reads
        self.overlapped_steps = 0  # steps planned and launched before the last one's tokens were read
        self.dropped_rows = 0  # rows of those steps computed for sequences that stopped the step before
        self.late_compiles = 0  # kernel compiles since warm-up: each a step shape the warm-up missed

    def _bookkeeping(self) -> tuple[CheckpointPolicy, PrefixCache, Scheduler]:
        """A checkpoint policy, prefix cache and scheduler over this engine's arena layout, all
        empty: the engine's own (made at start), or a scratch set (`scratch_bookkeeping`)."""
        options, layout = self.options, self.layout
        # A checkpoint is judged once the conversations in flight had time to come back to it.
        policy = CheckpointPolicy(options.cache_policy, tail_guard=options.tail_guard,
                                  interval_pages=options.checkpoint_interval_pages, seed=options.seed,
                                  settle_after=4 * options.max_num_seqs)
        # rows: running sequences, and one scored by prompt_logits. Events are queued once
        # something drains them (the cluster's replica does; the first drain is a snapshot): an
        # engine used alone, or served in-process, keeps none.
        cache = PrefixCache(layout, policy, options.page_size, recurrent=self.config.recurrent,
                            max_rows=options.max_num_seqs + 1, record_events=False)
        scheduler = Scheduler(options, cache, policy, self._eos)
        scheduler.spare_slots = list(range(layout.spare_start, layout.spare_start + layout.spare_slots - 1))
        scheduler.overlap_promotions = bool(layout.host_blocks) and self.runner.device.type == "cuda"
        return policy, cache, scheduler

    @contextmanager
    def scratch_bookkeeping(self) -> Iterator[None]:
        """Within it, requests run on a scratch policy, prefix cache, scheduler and sampler over
        the same runner, with their own totals; after it, the engine's own are back as they were (what
        `cairn.workers.kernel_warm_up` runs its steps on). Only for an engine with no request:
        the arena's pages and slots the scratch steps write are free ones, which every later step
        writes before it reads (fresh slots are zeroed; a page is read only once computed)."""
        if self._requests or self._held or self.scheduler.has_work() or self._flight is not None:
            raise EngineError("scratch bookkeeping needs an engine without requests")
        saved = self.policy, self.cache, self.scheduler, self.stats, self.sampler
        self.policy, self.cache, self.scheduler = self._bookkeeping()
        self.stats, self.sampler = EngineTotals(), Sampler(self.options.seed, self._eos)
        try:
            yield
        finally:
            for request_id in list(self._requests):
                self.abort(request_id)
            self._flight = None
            self.policy, self.cache, self.scheduler, self.stats, self.sampler = saved
            self.runner.take_copy_timing()  # the scratch steps' copies feed no cost rule

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, options: EngineOptions | None = None, *,
                        worker_id: str = "local", start_ranks=None, **fields: object) -> "Engine":
        """An engine over the checkpoint in `model_dir` (`cairn.workers.loading`) with `options`, or
        with the `EngineOptions` `fields` name (`Engine.from_pretrained(dir, max_num_seqs=8)`), not
        both. With `tensor_parallel_size` N > 1, this process is rank 0 and starts ranks 1..N-1
        (cairn.workers.execution.tp_runner, or `start_ranks`); each loads only its shard."""
        from cairn.workers.loading import load_engine

        if options is not None and fields:
            raise TypeError(f"give the engine's options as one EngineOptions or as fields, not both: {sorted(fields)}")
        options = options if options is not None else EngineOptions(**fields)
        return load_engine(cls, model_dir, options, worker_id, start_ranks)

    def use_tokenizer(self, model_dir: Path) -> None:
        """Structured outputs from the tokenizer in `model_dir` (loaded in the background; an
        engine without one refuses requests with a grammar)."""
        self.sampler.grammars = Grammars.for_model(model_dir, self.spec.vocab_size,
                                                   tuple(sorted(self._eos)))

    def warm_up(self) -> float:
        """Compiles, before any request, the kernels a step's shapes would compile during one: on
        CPU every packed linear at every row count a step can give it (`max_num_batched_tokens`
        at most, `max_num_seqs` for the LM head; cairn.workers.model.packed_linear.warm_up); where
        the ops are Triton kernels (CUDA), every kernel at every specialisation a step can take,
        autotuned (cairn.workers.kernel_warm_up). From then on a kernel compile is a bug: each one
        is logged and counted (`kernel_compiles_after_warm_up_total`). Returns the seconds it took
        (logged)."""
        began = time.perf_counter()
        sampled = self.options.max_num_seqs * (1 + self.options.num_speculative_tokens)  # a verify samples each row
        products = self.runner.warm_up(self.options.max_num_batched_tokens, sampled)
        if self.drafter is not None and hasattr(self.drafter, "warm_up"):
            products += self.drafter.warm_up(self.options.max_num_batched_tokens)
        kernels = warm_kernels(self) if runs_triton(self.runner.device.type) else None
        self._compiles_seen = compile_watch.compiles()
        seconds = time.perf_counter() - began
        log.info("warmed up in %.2f s (%d linear products%s)", seconds, products,
                 f"; {kernels.steps} kernel warm-up steps, {kernels.compiles} kernel compiles, "
                 f"{kernels.tunings_loaded} autotune choices from disk" if kernels else "")
        return seconds

    @property
    def kernel_compiles(self) -> int:
        """Kernel compiles in this process so far (cairn.kernels.common.compile_watch)."""
        return compile_watch.compiles()

    def _check_compiles(self) -> None:
        """After warm-up: logs the kernels a step compiled (a shape the warm-up missed)."""
        now = compile_watch.compiles()
        if now != self._compiles_seen:
            late = compile_watch.seen()[self._compiles_seen:now]
            self.late_compiles += len(late)
            self._compiles_seen = now
            log.warning("a step compiled %d kernel(s) after warm-up (a shape it missed): %s", len(late),
                        "; ".join(f"{kernel}[{key}]" for kernel, key in late))

    def close(self) -> None:
        """Stops a tensor-parallel engine's other ranks (nothing to do on one device)."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, hash_root: bytes | None = None,
                    page_hashes: list[bytes] | None = None, checkpoint_hints: list[int] | None = None,
                    tenant: str | None = None) -> str:
        """`add` of a `GenerateRequest` built from these fields (an id made up when None);
        returns the request id."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.add(GenerateRequest(request_id, list(prompt_token_ids), params or SamplingParams(),
                                 hash_root=hash_root, page_hashes=page_hashes,
                                 checkpoint_hints=list(checkpoint_hints or ()), tenant=tenant))
        return request_id

    def add(self, request: GenerateRequest, fetch: bool = False) -> FetchPlan | None:
        """Queues a request; raises `RequestRejected` naming the field at fault. Its `hash_root`
        (`spec.hash_root(cache_salt)`, default: no salt) roots its page hashes; `page_hashes`
        (from the ingress, under that root) save hashing here; `checkpoint_hints` are token
        positions (message starts) where a state checkpoint may pay off; `tenant` is who asked
        (None: one tenant for all), whom the scheduler shares sequence slots among.

        With `fetch` (the caller can pull from a peer) and a `request.fetch` hint naming another
        replica that resumes deeper than this one, returns what to ask the holder for
        (`cairn.workers.cache.transfer.FetchPlan`): the request is then held out of the scheduler
        until `deliver_fetch` brings the export (or the reason there is none)."""
        if self.broken is not None:
            raise EngineBroken(self.broken)
        params, request_id = request.params, request.request_id
        checked = check(request, self.spec, self.layout, self.sampler.grammars is not None)
        if request_id in self._requests:
            raise RequestRejected(f"request_id {request_id!r} is already in use", "request_id")
        seq = Sequence(request_id, checked.prompt, params, hash_root=checked.hash_root, hints=checked.hints,
                       max_total_tokens=checked.total_tokens, tenant=request.tenant)
        if request.page_hashes:
            self.cache.adopt_hashes(seq, request.page_hashes)
        self._requests[request_id] = seq
        hint, plan = request.fetch, None
        if fetch and hint is not None and hint.holder != self.worker_id and request.page_hashes:
            ps = self.spec.page_size
            tail = tuple(checked.prompt[hint.depth * ps:hint.depth * ps + hint.tail]) if hint.tail else ()
            plan = self.fetches.plan(request.page_hashes, len(checked.prompt), hint.depth, tail, checked.hash_root)
        if plan is not None:  # held until the holder's export is delivered
            seq.fetch_pending = True
            self.fetches.hold(request_id, plan)
        compiled = None if params.grammar is None else self.sampler.grammars.prepare(params.grammar)
        if compiled is not None and not compiled.done():  # held back while its grammar compiles, in the
            seq.grammar_pending = True                       # background: a slow grammar stalls no other
            compiled.add_done_callback(lambda _: self._grammar_compiled(seq))
        if seq.grammar_pending or seq.fetch_pending:
            self._held.append(seq)
        else:
            self.scheduler.add(seq)
        self.stats.prompt_tokens += len(checked.prompt)
        return plan

    def deliver_fetch(self, request_id: str, export: ResumeExport | str | None) -> None:
        """What a peer fetch for a held request brought (`add`): the holder's export, or why
        there is none (a fallback reason: "timeout", "holder_failed", "evicted"; None: nothing
        was asked). Safe from any thread: it is adopted at the start of the next step, before
        the request is scheduled, so fetching and admitting cross to the engine's thread once."""
        self.fetches.deliver(request_id, export)
        if self.on_runnable is not None:
            self.on_runnable()

    def _grammar_compiled(self, seq: Sequence) -> None:
        """On the compiling thread: the sequence may be scheduled at the next step (a compile that
        failed faults it at its first sample); wakes whoever steps the engine (`on_runnable`)."""
        seq.grammar_pending = False
        if self.on_runnable is not None:
            self.on_runnable()

    def _release_held(self) -> None:
        """Held sequences whose grammars compiled and whose fetches arrived join the scheduler's queue."""
        for seq in [s for s in self._held if not (s.grammar_pending or s.fetch_pending)]:
            self._held.remove(seq)
            if seq.status is not Status.FINISHED:
                self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends a request and frees what it holds; returns its final output (None if unknown)."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        if seq in self._held:
            self._held.remove(seq)
            self.fetches.drop(request_id)
        self.scheduler.finish(seq, "abort")
        return RequestOutput.of(seq, [], [], self.worker_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._held) or self._flight is not None

    def has_runnable(self) -> bool:
        """A step would compute something now (every unfinished request may be paused, or held
        while its grammar compiles or its fetch is under way)."""
        return self._flight is not None or self.scheduler.has_runnable_work() or self.fetches.has_deliveries or \
            any(not (s.grammar_pending or s.fetch_pending) for s in self._held)

    def pause(self, request_id: str, paused: bool = True) -> None:
        """Stops (or, with `paused` False, resumes) computing a request whose reader is behind:
        it keeps its slot and pages meanwhile. Unknown ids are ignored (it may have finished)."""
        seq = self._requests.get(request_id)
        if seq is not None:
            seq.paused = paused

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules, runs the model once, samples, applies the step; returns an output for every
        request that produced a token, finished or failed. A fault of one sequence fails that
        request alone (finish_reason "error", `error` says why); a failed forward pass fails the
        requests of that step, never those waiting. `EngineBroken` (a tensor-parallel rank lost)
        is raised: the engine is done, and `broken` says why.

        With `async_scheduling` (one device), a decode-only step's tokens are drawn on the device
        and read by the next call, which first plans and launches its own step when the scheduler
        can plan it without them (`Scheduler.plans_ahead`: nothing to admit, new pages from free
        blocks alone). That step's decodes take their input ids from the drawn ones on the
        device (a placeholder stands in the sequences' tokens while it is planned); then the last
        step's tokens are read and applied, and a sequence that stopped there gets nothing from
        the new step (its row is computed and dropped: it wrote only its own unregistered page
        and its own state slot, both given back); the checkpoints at page boundaries its decodes
        reach are planned for those that go on, their copies queued after it. The new step is
        sampled after that, so penalties, grammars and `min_tokens` see every token before it.
        Such a call returns the last step's outputs: outputs come one call late. Any other step
        runs as without it."""
        step_began = time.perf_counter()
        if self._proposal:
            self._propose()
        if self.fetches.has_deliveries:
            self.fetches.adopt(self._requests)
        if self._held:
            self._release_held()
        outputs: list[RequestOutput] = []
        flight, self._flight = self._flight, None
        ahead = None  # the sequences whose tokens in `flight` the step planned now decodes
        if flight is not None:
            self.scheduler.advance(flight.plan)
            pending = [seq for seq in flight.sampling if not seq.finished]
            if self.scheduler.plans_ahead(pending):
                ahead = pending
            else:
                outputs = self._land(flight)
        if ahead is not None:
            for seq in ahead:
                seq.token_ids.append(PENDING)
            try:
                plan = self.scheduler.schedule(ahead=True)
                rows = plan.sampling_sequences()
                fed = (flight.draw.ids, {id(seq): i for i, seq in enumerate(flight.sampling)})
                logits, failure, seconds = self._forward(plan, fed) if plan else (None, None, 0.0)
            finally:
                for seq in ahead:
                    seq.token_ids.pop()
            outputs = self._land(flight)
            self.overlapped_steps += bool(plan)
            if (plan.deferred or plan.lookahead) and failure is None:  # next pages, boundary checkpoints
                self.scheduler.plan_deferred(plan)
                self._snapshot_after(plan)
        else:
            plan = self.scheduler.schedule()
            rows = plan.sampling_sequences()
            logits, failure, seconds = self._forward(plan, None) if plan else (None, None, 0.0)
        if failure is not None:  # the model ran for the whole step: its requests share the fault
            for seg in plan.segments:
                self.scheduler.fail(seg.seq, SequenceFault(f"the forward pass failed: {type(failure).__name__}"))
            self.scheduler.abandon(plan)
        elif logits is not None:
            began = time.perf_counter()
            live = [i for i, seq in enumerate(rows) if not seq.finished]  # those that stopped in `flight` leave
            if len(live) < len(rows):
                self.dropped_rows += len(rows) - len(live)
                logits = logits.index_select(0, torch.tensor(live, dtype=torch.long, device=logits.device))
                rows = [rows[i] for i in live]
            if self._async and not plan.prefills:  # read by the next call (every row may have stopped)
                self._flight = _Flight(plan, rows, self.sampler.draw(logits, rows)) if rows else None
                self._count(plan, 0)
            elif self.drafter is not None:
                applied = self._verify(plan, logits)
                outputs += self._outputs(applied)
                self._count(plan, len(applied))
                if self.gate is not None and not plan.prefilling:  # decode-only
                    self.gate.observe(len(plan.segments), any(seg.drafts for seg in plan.segments), len(applied),
                                      time.perf_counter() - step_began)
            else:
                applied = self._outputs(self.scheduler.postprocess(plan, rows, self.sampler.sample(logits, rows)))
                outputs += applied
                self._count(plan, len(applied))
            self._observe_rates(plan, seconds + time.perf_counter() - began)
        if plan and self._compiles_seen is not None:
            self._check_compiles()
        for seq in self.scheduler.take_failed():
            self._requests.pop(seq.request_id, None)
            outputs.append(RequestOutput.of(seq, [], [], self.worker_id))
        return outputs

    def _forward(self, plan: StepPlan, fed) -> tuple[torch.Tensor | None, Exception | None, float]:
        """Runs the plan's forward: (its logits, or the exception that failed it; the seconds it
        took). `EngineBroken` (nothing can run any more: the caller fails everything) is raised."""
        began = time.perf_counter()
        try:  # (a tensor-parallel runner takes no `fed`: it never runs ahead)
            return self.runner.execute(plan, fed=fed) if fed else self.runner.execute(plan), None, \
                time.perf_counter() - began
        except EngineBroken as e:
            self.broken = str(e)
            raise
        except Exception as e:
            log.exception("the forward pass failed; failing the %d request(s) of this step", len(plan.segments))
            return None, e, 0.0
        finally:
            self.cache.end_pass()

    def _verify(self, plan: StepPlan, logits: torch.Tensor) -> list:
        """A speculating engine's second half of a step (cairn.workers.speculation): every row
        sampled (a verify segment's at each drafted position), the tokens that stand kept, the
        states rolled back and the checkpoints they reach planned and copied
        (`Scheduler.settle`), the step applied, and the next drafts proposed. Returns what
        `Scheduler.apply_tokens` applied, a verify segment's kept tokens in order."""
        sampling = plan.sampling_rows()
        results = self.sampler.sample(logits, [seq for seq, _ in sampling], [j for _, j in sampling])
        segments = plan.decodes + plan.prefills
        first_row, row = {}, 0  # each segment's first row of the step's hidden states
        for seg in segments:
            first_row[id(seg)] = row
            row += seg.num_tokens
        rows, i = [], 0  # each sampling segment's results
        for seg in segments:
            if seg.samples:
                rows.append((seg, results[i:i + seg.drafts + 1]))
                i += seg.drafts + 1
        verified = [(seg, mine) for seg, mine in rows if seg.verify]
        verdicts = dict(zip((id(seg) for seg, _ in verified),
                            kept_tokens([seg for seg, _ in verified], [mine for _, mine in verified],
                                        self.scheduler.stop_reason)))
        kept, seqs, tokens = {}, [], []
        drafted_seqs, drafted_tokens = [], []  # the kept drafted tokens, which the step computed
        for seg, mine in rows:
            if seg.verify:
                n, accepted = verdicts[id(seg)]
                self.speculation.count(seg.drafts, accepted)
                self.sampler.count_kept(seg.seq, [result[0] for result in mine[1:n]])  # penalties' counts
                if n:
                    kept[id(seg.seq)] = n
                drafted_seqs += [seg.seq] * (n - 1)
                drafted_tokens += mine[:n - 1]
                mine = mine[max(n - 1, 0):max(n, 1)]  # the token after them (none kept: the first row's fault)
            seqs.append(seg.seq)
            tokens += mine
        self.runner.copy_states(self.scheduler.settle(plan, kept))  # the rollbacks, before the snapshots
        self._snapshot_after(plan)
        for seq in seqs:
            seq.draft = []
        # the computed drafted tokens join the sequences first (none of them stops one:
        # `kept_tokens` ends at the first that does), so the pages and checkpoints the step
        # completes are hashed over them; then the step advances, and the last tokens apply
        early = self.scheduler.apply_tokens(drafted_seqs, drafted_tokens)
        self.scheduler.advance(plan)
        applied = self._in_order(early, self.scheduler.apply_tokens(seqs, tokens))
        k = self.options.num_speculative_tokens
        if self.gate is not None and not self.gate.drafting(len(self.scheduler.running)):
            if not plan.prefilling:  # decode-only: no head pass either (`SpeculationGate`)
                return applied
            k = 0  # a prefill: the head runs over it for its K/V there, drafting nothing
        runs = []
        for seg in segments:
            seq = seg.seq
            if seq.finished or seg.num_tokens == 0:
                continue
            want = 0
            if seq.num_computed == len(seq.token_ids) - 1:
                want = max(0, min(k, seq.max_total_tokens - len(seq.token_ids) - 1))
            runs.append(DraftRun(seg, first_row[id(seg)], want))
        self._proposal = runs
        return applied

    def _propose(self, flush: bool = False) -> None:
        """The drafts of the last step's sequences (`Drafter.propose` over its kept positions), at
        the start of the next step or of any other forward pass (which replaces the runner's kept
        hidden states), so that the last step's tokens go out before the head runs: a prompt's
        first token waits for the target's prefill alone, not for the head's pass over it too,
        however many steps it takes (`held_back`; `flush`: none waits). Sequences that ended in
        between (aborted) are left out. Drafts are only ever proposals:
        a head pass that fails costs its sequences their drafts for one step, nothing else (a
        tensor-parallel rank lost breaks the engine, as in a step)."""
        runs, self._proposal = self._proposal, []
        if self.options.tensor_parallel_size == 1:  # (a rank's hidden states stay on it: none held back there)
            runs, self._waiting = held_back(runs, self._waiting, self.runner.hidden,
                                            WAITING_STEPS * self.options.max_num_batched_tokens, flush)
        try:
            self.drafter.propose([run for run in runs if not run.segment.seq.finished])
        except EngineBroken as e:
            self.broken = str(e)
            raise
        except Exception:
            log.exception("the MTP head's pass failed; %d sequence(s) decode this step without drafts", len(runs))
            for run in runs:
                run.segment.seq.draft = []

    def _snapshot_after(self, plan: StepPlan) -> None:
        """The snapshots of checkpoints planned after the plan's step ran, behind the block copies
        that taking their slots queued (a group emptied: its pages moved)."""
        if plan.snapshots or plan.host_snapshots:
            self.flush_block_copies()
            self.runner.snapshot(plan)

    @staticmethod
    def _in_order(early: list, last: list) -> list:
        """`Scheduler.apply_tokens`' results of a verify step, each sequence's kept drafted
        tokens (`early`) before its last token (`last`), sequence by sequence."""
        before: dict[int, list] = {}
        for entry in early:
            before.setdefault(id(entry[0]), []).append(entry)
        out = []
        for entry in last:
            out += before.pop(id(entry[0]), [])
            out.append(entry)
        for rest in before.values():  # (a sequence whose last token failed to apply)
            out += rest
        return out

    def _land(self, flight: _Flight) -> list[RequestOutput]:
        """Reads the tokens of a step launched by the last call (async scheduling) and applies them
        (its plan was `advance`d already)."""
        live = [(seq, r) for seq, r in zip(flight.sampling, flight.draw.read()) if not seq.finished]  # (aborts)
        outputs = self._outputs(self.scheduler.apply_tokens([seq for seq, _ in live], [r for _, r in live]))
        self.stats.generated_tokens += len(outputs)
        return outputs

    def _observe_rates(self, plan: StepPlan, seconds: float) -> None:
        """Feeds the host tier's cost rule: the step's prefill rate (steps mostly prefill), and
        the host copies' rate."""
        if not self.layout.host_blocks:
            return
        cost = self.cache.tier_cost
        copied, copy_seconds = self.runner.take_copy_timing()
        cost.observe_copy(copied, copy_seconds)
        tokens = plan.num_tokens
        if 2 * sum(s.num_tokens for s in plan.prefills) >= tokens:
            cost.observe_prefill(tokens, seconds - copy_seconds)

    def _outputs(self, applied) -> list[RequestOutput]:
        """The outputs of the sequences `Scheduler.apply_tokens` gave tokens: one a sequence, with
        its tokens of the step in order (a verify step gives several)."""
        outputs, worker = [], self.worker_id
        i = 0
        while i < len(applied):
            seq, token, logprob = applied[i]
            i += 1
            new, logprobs = [token], [logprob] if logprob else []
            while i < len(applied) and applied[i][0] is seq:
                new.append(applied[i][1])
                if applied[i][2]:
                    logprobs.append(applied[i][2])
                i += 1
            if seq.finish_reason is not None:
                self._requests.pop(seq.request_id, None)
                outputs.append(RequestOutput.of(seq, new, logprobs, worker))
            else:  # the common case, inline: one small object per request and step
                n_out = len(seq.token_ids) - len(seq.prompt_token_ids)
                outputs.append(RequestOutput(
                    seq.request_id, new, None if seq.params.logprobs is None else logprobs,
                    n_out, seq.cached_tokens, None, seq.num_preemptions, worker,
                    queue_s=seq.queue_s if n_out == len(new) else None))
        return outputs

    def _count(self, plan: StepPlan, generated: int) -> None:
        stats = self.stats
        stats.steps += 1
        stats.computed_tokens += plan.num_tokens
        stats.generated_tokens += generated
        stats.preemptions = self.scheduler.num_preemptions
        stats.cached_tokens = self.scheduler.hit_tokens

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs a batch to completion; outputs in prompt order."""
        per = params if isinstance(params, list) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"expected one SamplingParams per prompt ({len(prompts)}), got {len(per)}")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            if not self.has_runnable():
                if any(s.grammar_pending for s in self._held):  # a grammar still compiles
                    time.sleep(0.001)
                    continue
                lost = [i for i in ids if i not in final]
                raise EngineError(f"requests {lost} can never finish: the engine has nothing to run")
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """fp32 logits [n, vocab] at every prompt position, from one prefill that holds pages and
        a slot only while it runs (nothing cached). For scoring and tests; refuses when the cache
        cannot make room now."""
        prompt = list(prompt_token_ids)
        if self._proposal:  # before this pass replaces the hidden states it reads
            self._propose()
        seq = Sequence("prompt-logits", prompt, SamplingParams(max_tokens=1), hash_root=self.spec.hash_root())
        cold = Match(0, 0, 0, None)  # compute everything: the logits of every position are wanted
        if not prompt or not self.cache.can_admit(seq, cold, len(prompt)):
            raise ValueError(f"cannot score {len(prompt)} tokens now: the cache has no room for their pages "
                             f"and a state slot")
        self.cache.admit(seq, cold, len(prompt))
        try:
            segment = Segment(seq, 0, len(prompt))
            plan = StepPlan(decodes=[segment] if len(prompt) == 1 else [],
                            prefills=[] if len(prompt) == 1 else [segment],
                            fresh_state_slots=[seq.cache.state_slot],
                            page_table_writes=self.cache.take_page_table_writes(),
                            block_copies=self.cache.take_block_copies())
            return self.runner.execute(plan, all_logits=True)
        finally:
            self.cache.end_pass()
            self.cache.release(seq)

    # ---- cache events ------------------------------------------------------------------------
    def drain_events(self) -> EventBatch | None:
        """What changed in the cache since the last drain, as the next numbered batch. The first
        batch is a snapshot: a (re)started worker introduces itself with its full contents."""
        if self.events.next_seq == 0 or self.cache.events_dropped:  # first, or what was queued is lost
            return self.snapshot_events()
        events = self.cache.drain_events()
        return self.events.batch(events) if events else None

    def snapshot_events(self) -> EventBatch:
        """Everything resident now, as a self-contained batch (the answer to a resync request)."""
        self.cache.forget_events()  # superseded by the snapshot
        pages, states = self.cache.snapshot()
        host_pages, host_states = self.cache.host_snapshot()
        return self.events.snapshot(pages, states, host_pages, host_states)

    def cache_contents(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(page hashes, checkpoint page hashes) resident now on either tier: what the cache
        index should hold for this engine once its events are in."""
        pages, states = self.cache.snapshot()
        host_pages, host_states = self.cache.host_snapshot()
        held = frozenset(h for h, _ in pages + host_pages)
        return held, frozenset(states + host_states) & held

    def host_contents(self) -> tuple[frozenset[bytes], frozenset[bytes]]:
        """(page hashes, checkpoint page hashes) the host tier holds now."""
        host_pages, host_states = self.cache.host_snapshot()
        return frozenset(h for h, _ in host_pages), frozenset(host_states)

    def flush_block_copies(self, extra: list[BlockCopy] = (), staging=None, row_staging=()) -> None:
        """Makes the block copies the cache queued (then `extra`, reading `staging`, and
        `row_staging` for the rows beside the arena: `ModelRunner.apply_copies`) now, between
        steps, instead of before the next step."""
        copies = self.cache.take_block_copies() + list(extra)
        if copies:
            self.runner.apply_copies(copies, staging, row_staging)

    def clear_cache(self) -> None:
        """Drops every cached page and checkpoint no running request holds."""
        self.cache.clear()

    def metrics(self) -> EngineMetrics:
        """Counters and gauges for /metrics and routing (`cairn.workers.engine_metrics`): tokens (prompt,
        cached, computed, generated), pages and checkpoint state in use, the cache's bytes and
        tiers, fetches, checkpoints by kind, and the measured host-copy and prefill rates."""
        return EngineMetrics.of(self)

    def check(self) -> None:
        """Integrity check for idle moments and tests: the cache's pools, arena and LRU agree."""
        self.cache.check()
