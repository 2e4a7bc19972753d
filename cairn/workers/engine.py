"""The engine: requests in, tokens out, one step at a time. No Ray, no asyncio.

`Engine.from_pretrained(dir, options)` (an `EngineOptions`, or its fields as keyword arguments)
loads a checkpoint (cairn.workers.loading) and lays out the cache's arena from the options
(cairn.workers.cache.arena). Requests come in through `add` (cairn.workers.engine_intake: checked,
queued, or held while a grammar compiles or a peer fetch is under way). `step` is the loop's body:
plan (the scheduler), forward (the runner), then verify the drafts (cairn.workers.speculative) or
sample (the sampler), apply, and a `RequestOutput` (cairn.workers.output) for every request that
produced a token or finished; with async scheduling a decode step's tokens land one call later
(cairn.workers.async_scheduling). `generate` runs a batch to completion, and says at once which
requests can never finish if the engine has nothing left to run. What the cache tells the
cluster (events, contents) is cairn.workers.engine_cache.

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
from dataclasses import replace
from pathlib import Path

import torch

from cairn.cache_service.events import EventStream
from cairn.kernels.common import compile_watch
from cairn.kernels.common.dispatch import runs_triton
from cairn.workers.cache import transfer
from cairn.workers.cache.arena import ArenaLayout
from cairn.workers.cache.checkpoint_policy import CheckpointPolicy
from cairn.workers.cache.device_budget import graph_reserve_bytes
from cairn.workers.cache.prefix_cache import Match, PrefixCache
from cairn.workers.engine_cache import EngineCache
from cairn.workers.engine_intake import EngineIntake
from cairn.workers.engine_errors import EngineBroken, EngineError, SequenceFault
from cairn.workers.output import RequestOutput, outputs_of
from cairn.workers.engine_peer_fetch import EnginePeerFetch
from cairn.workers.grammar import Grammars
from cairn.workers.kernel_warm_up import check_late_compiles, warm_kernels
from cairn.workers.engine_metrics import EngineMetrics, EngineTotals
from cairn.workers.model import HybridForCausalLM, ModelConfig
from cairn.workers.model.mtp import MultiTokenPredictor
from cairn.workers.engine_options import EngineOptions
from cairn.workers.plan import Segment, StepPlan
from cairn.workers.execution.runner import ModelRunner
from cairn.workers.async_scheduling import AsyncScheduling, Launched
from cairn.workers.sampler import Sampler
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.scheduler import Scheduler
from cairn.workers.sequence import Sequence
from cairn.workers.sizing import graph_depth, graph_rows, require_head
from cairn.workers.spec import EngineSpec
from cairn.workers.speculative.mtp_drafter import MtpDrafter
from cairn.workers.speculative.drafts import Drafter
from cairn.workers.speculative.totals import SpeculationTotals
from cairn.workers.speculative.verifier import Verifier
from cairn.workers.execution.tp_runner import TensorParallelRunner

log = logging.getLogger(__name__)



class Engine(EngineIntake, EngineCache):
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
        drafter: Drafter | None = None  # speculative decoding (cairn.workers.speculative)
        require_head(options, mtp)
        if options.num_speculative_tokens:
            drafter = MtpDrafter(self.runner, mtp)
            log.info("speculative decoding: %d drafted tokens a step (%s mode); the MTP head's K/V %.1f MiB "
                     "(%.1f MiB more on the host tier), %d spare state slots %.1f MiB", options.num_speculative_tokens,
                     "exact" if options.speculative_exact else "default", drafter.memory_bytes / 2**20,
                     drafter.host_bytes / 2**20, layout.spare_slots, layout.spare_bytes / 2**20)
        eager = not on_cuda if options.enforce_eager is None else options.enforce_eager
        if rank_workers is None and not eager:
            # decode steps at fixed batch sizes over fixed buffers; graphs captured on CUDA (a
            # tensor-parallel engine stays eager: its collectives are not captured). In the exact
            # mode verify steps too: k + 1 levels of rows a bucket (the default mode's verify is a
            # prefill chunk, eager); their padding rows' state saves go to the last spare slot
            depth = graph_depth(options, drafter is not None)
            self.runner.use_decode_graphs(options.max_num_seqs, -(-self.spec.max_model_len // options.page_size),
                                          capture=on_cuda, depth=depth, padding_slot=layout.padding_slot)
            if on_cuda:
                estimate = graph_reserve_bytes(cfg, graph_rows(options, drafter is not None))
                (log.warning if self.runner.graphs.memory_bytes > estimate else log.info)(
                    "decode graphs hold %.1f MiB (the arena was sized leaving %.1f MiB for them under "
                    "memory_utilization); capture took %.1f s", self.runner.graphs.memory_bytes / 2**20,
                    estimate / 2**20, self.runner.graphs.capture_s)
        if rank_workers is not None:
            rank_workers.wait_ready(layout.num_blocks, timeout_s=max(120.0, options.collective_timeout_s))
            self.runner = TensorParallelRunner(self.runner, rank_workers)
            if drafter is not None:  # every rank runs the head's share
                drafter.dispatch = self.runner.dispatch
        self.sampler = Sampler(options.seed, self._eos)
        self.speculation = SpeculationTotals()  # what speculative decoding counted (zeros: it is off)
        self.verifier = None if drafter is None else Verifier(options, self.runner, drafter, self.speculation)
        if drafter is not None:  # drafts drawn as the sampler would draw them (its current one)
            drafter.pick = lambda logits, seqs, drafts: self.sampler.draft_tokens(logits, seqs, drafts)
        self.events = EventStream(worker_id)
        self.stats = EngineTotals()
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.broken: str | None = None  # why the engine can run nothing more (EngineBroken)
        self.vision = self.images_refused = None  # a vision-language checkpoint's (`use_vision`)
        self.fetches = EnginePeerFetch(self.cache, lambda: transfer.BlockIO(
            self.runner.read_blocks, self.flush_block_copies, self.runner.read_block_rows, self.runner.block_row_bytes),
            options.tensor_parallel_size > 1)
        if drafter is not None:  # an export's pages carry the head's K/V at every position they hold
            self.fetches.before_export = lambda: self.verifier.holding and self._propose(flush=True)
        self.on_runnable: Callable[[], None] | None = None  # called from other threads when held work may run
        self._held: list[Sequence] = []  # held back until their grammars compile and their fetches arrive
        self._compiles_seen: int | None = None  # kernel compiles at warm-up's end (None: not warmed up)
        # async scheduling (cairn.workers.async_scheduling): one device only (a rank's inputs travel from the host)
        self.async_steps = AsyncScheduling(options.async_scheduling and rank_workers is None and drafter is None)
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
        if self._requests or self._held or self.scheduler.has_work() or self.async_steps.flight is not None:
            raise EngineError("scratch bookkeeping needs an engine without requests")
        saved = self.policy, self.cache, self.scheduler, self.stats, self.sampler
        self.policy, self.cache, self.scheduler = self._bookkeeping()
        self.stats, self.sampler = EngineTotals(), Sampler(self.options.seed, self._eos)
        try:
            yield
        finally:
            for request_id in list(self._requests):
                self.abort(request_id)
            self.async_steps.flight = None
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

    def close(self) -> None:
        """Stops a tensor-parallel engine's other ranks (nothing to do on one device)."""
        if isinstance(self.runner, TensorParallelRunner):
            self.runner.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._held) or self.async_steps.flight is not None

    def has_runnable(self) -> bool:
        """A step would compute something now (every unfinished request may be paused, or held
        while its grammar compiles or its fetch is under way)."""
        return self.async_steps.flight is not None or self.scheduler.has_runnable_work() or self.fetches.has_deliveries or \
            any(not (s.grammar_pending or s.fetch_pending) for s in self._held)

    # ---- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules, runs the model once, samples (or verifies drafts), applies the step; returns
        an output for every request that produced a token, finished or failed. A fault of one
        sequence fails that request alone (finish_reason "error", `error` says why); a failed
        forward pass fails the requests of that step, never those waiting. `EngineBroken` (a
        tensor-parallel rank lost) is raised: the engine is done, and `broken` says why. With
        `async_scheduling` a decode-only step's tokens are read by the next call, which first
        plans and launches its own step when it can (cairn.workers.async_scheduling): outputs
        then come one call late."""
        began = time.perf_counter()
        self._between_steps()
        landed, step = self.async_steps.resume(self.scheduler, self._launch, self._snapshot_after)
        outputs = outputs_of(landed, self._requests, self.worker_id)
        self.stats.generated_tokens += len(outputs)
        if step is None:
            step = self._launch(self.scheduler.schedule())
        plan = step.plan
        if step.failure is not None:  # the model ran for the whole step: its requests share the fault
            for seg in plan.segments:
                self.scheduler.fail(seg.seq, SequenceFault(f"the forward pass failed: {type(step.failure).__name__}"))
            self.scheduler.abandon(plan)
        elif step.logits is not None:
            sampled_at = time.perf_counter()
            self.async_steps.drop_stopped(step)  # rows of sequences that stopped in the flight landed
            if self.async_steps.takes(plan):  # read by the next call (every row may have stopped)
                self.async_steps.launch(step, self.sampler.draw(step.logits, step.rows))
                self._count(plan, 0)
            else:
                if self.verifier is not None:
                    applied = self.verifier.verify(plan, step.logits, self.scheduler, self.sampler,
                                                   self._snapshot_after)
                else:
                    applied = self.scheduler.postprocess(plan, step.rows, self.sampler.sample(step.logits, step.rows))
                outputs += outputs_of(applied, self._requests, self.worker_id)
                self._count(plan, len(applied))
                if self.verifier is not None:
                    self.verifier.observe(plan, len(applied), time.perf_counter() - began)
            self._observe_rates(plan, step.seconds + time.perf_counter() - sampled_at)
        if plan and self._compiles_seen is not None:
            check_late_compiles(self)
        for seq in self.scheduler.take_failed():
            self._requests.pop(seq.request_id, None)
            outputs.append(RequestOutput.of(seq, [], [], self.worker_id))
        return outputs

    def _between_steps(self) -> None:
        """What waits for the next step: the drafter's pass over the last step, fetched resume
        points adopted, held requests released."""
        if self.verifier is not None and self.verifier.proposing:
            self._propose()
        if self.fetches.has_deliveries:
            self.fetches.adopt(self._requests)
        if self._held:
            self._release_held()

    def _launch(self, plan: StepPlan, fed=None) -> Launched:
        """Runs the plan's forward (`fed`: async scheduling's drawn ids on the device): its
        logits, or the exception that failed it, and the seconds it took. `EngineBroken`
        (nothing can run any more: the caller fails everything) is raised."""
        step = Launched(plan, plan.sampling_sequences())
        if not plan:
            return step
        began = time.perf_counter()
        try:  # (a tensor-parallel runner takes no `fed`: it never runs ahead)
            step.logits = self.runner.execute(plan, fed=fed) if fed else self.runner.execute(plan)
            step.seconds = time.perf_counter() - began
        except EngineBroken as e:
            self.broken = str(e)
            raise
        except Exception as e:
            log.exception("the forward pass failed; failing the %d request(s) of this step", len(plan.segments))
            step.failure = e
        finally:
            self.cache.end_pass()
        return step

    def _propose(self, flush: bool = False) -> None:
        """The drafter's pass over the last step (`Verifier.propose`); a lost rank breaks the engine."""
        try:
            self.verifier.propose(flush)
        except EngineBroken as e:
            self.broken = str(e)
            raise

    @property
    def drafter(self) -> Drafter | None:
        """Who drafts (speculative decoding; None: the engine does not speculate)."""
        return None if self.verifier is None else self.verifier.drafter

    @drafter.setter
    def drafter(self, drafter: Drafter) -> None:
        self.verifier.drafter = drafter

    def _snapshot_after(self, plan: StepPlan) -> None:
        """The snapshots of checkpoints planned after the plan's step ran, behind the block copies
        that taking their slots queued (a group emptied: its pages moved)."""
        if plan.snapshots or plan.host_snapshots:
            self.flush_block_copies()
            self.runner.snapshot(plan)

    def _observe_rates(self, plan: StepPlan, seconds: float) -> None:
        """Feeds the host tier's cost rule (the step's prefill rate, steps mostly prefill, and
        the host copies' rate) and the step time the router prices a peer's fetch with."""
        cost = self.cache.tier_cost
        cost.observe_step(seconds)
        copied, copy_seconds = self.runner.take_copy_timing() if self.layout.host_blocks else (0, 0.0)
        cost.observe_copy(copied, copy_seconds)
        tokens = plan.num_tokens
        if 2 * sum(s.num_tokens for s in plan.prefills) >= tokens:
            cost.observe_prefill(tokens, seconds - copy_seconds)

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
        if self.verifier is not None and self.verifier.proposing:  # before this pass replaces the hidden states
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

    def metrics(self) -> EngineMetrics:
        """Counters and gauges for /metrics and routing (`cairn.workers.engine_metrics`): tokens (prompt,
        cached, computed, generated), pages and checkpoint state in use, the cache's bytes and
        tiers, fetches, checkpoints by kind, and the measured host-copy and prefill rates."""
        return EngineMetrics.of(self)

    def check(self) -> None:
        """Integrity check for idle moments and tests: the cache's pools, arena and LRU agree."""
        self.cache.check()
