"""Every Triton kernel a step can launch, compiled and autotuned before the first request:
`warm_kernels(engine)`, run by `Engine.warm_up` where the engine's ops are Triton kernels.

A kernel compiles once per specialisation (cairn.kernels.common.compile_watch). Ours specialise on
nothing a step's size changes: token, pair, sequence and split counts are `do_not_specialize`;
index tables, which a step slices at offsets its sizes give, are not specialised on alignment;
the runner uploads every step array 16-byte aligned. What a step can still change is a few
constexprs and which paths run:
- the MoE's BLOCK_M, from the step's mean pairs per expert (cairn.kernels.moe.tuning.block_m):
  each of its ranges spans at least a factor of 4 in tokens, so prefills of every power of two
  up to the token budget reach every BLOCK_M a step can take;
- decode rows (in a mixed step, eager; alone, a decode graph's bucket, captured at start), prefill
  rows, both in one step; a resumed prompt (its state restored from a checkpoint).

The steps run on the engine's own step path (scheduler, runner, sampler: the shapes real steps
have) over scratch bookkeeping (`Engine.scratch_bookkeeping`: nothing is left behind, no totals,
no cache entries, no sampler state):
1. for T in 1, 2, 4, ... up to the token budget (`max_num_batched_tokens`, bounded by the model
   length), and the budget itself: a prompt of T tokens, prefilled in one step, then decoded;
2. a mixed step: a sequence decoding while another one's prompt is prefilled;
3. that prompt sent again with more after it: a resume from its checkpoint.
A speculating engine's steps need nothing more: a verify segment is a prefill chunk saving states
at its offsets (as a prompt's chunk saves checkpoints) or decode rows, and the MTP head's passes
run the target's kernels (held by tests/workers/test_kernel_warm_up.py).
Compiled, the autotune choices are read from disk first and written after
(cairn.kernels.common.tuning_cache), so a restarted replica benchmarks nothing again.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

from cairn.kernels.common import compile_watch
from cairn.workers.engine_errors import RequestRejected
from cairn.workers.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelWarmUp:
    steps: int  # engine steps the warm-up ran
    seconds: float
    compiles: int  # kernel compiles during it (compile_watch)
    tunings_loaded: int  # autotune choices read back from disk


def prefill_sizes(budget: int, longest: int) -> list[int]:
    """1, 2, 4, ... up to min(budget, longest), and that bound itself."""
    top = max(1, min(budget, longest))
    sizes = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    return sizes if sizes[-1] == top else sizes + [top]


def warm_kernels(engine) -> KernelWarmUp:
    """Runs the warm-up steps on `engine` (a `cairn.workers.engine.Engine` with no request)."""
    from cairn.kernels.common import triton_helpers, tuning_cache

    began, before = time.perf_counter(), compile_watch.compiles()
    compiled = not triton_helpers.INTERPRETED
    loaded = tuning_cache.load() if compiled else 0
    rng = random.Random(0)
    vocab = engine.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    once = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with engine.scratch_bookkeeping():
        for n in prefill_sizes(engine.options.max_num_batched_tokens, engine.spec.max_model_len - once.max_tokens):
            try:
                engine.generate([prompt(n)], once)
            except RequestRejected as e:  # more than the arena holds: the larger sizes cannot run either
                log.info("warm-up stops its prefills at %d tokens: %s", n, e)
                break
        engine.add_request(prompt(8), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        engine.step()  # its prefill; the next step decodes it beside the next prompt's prefill
        second = prompt(24)
        engine.add_request(second, once)
        while engine.has_unfinished():
            engine.step()
        engine.generate([second + prompt(20)], once)  # resumes where `second` left its state
        steps = engine.stats.steps
    if compiled:
        tuning_cache.save()
    return KernelWarmUp(steps, time.perf_counter() - began, compile_watch.compiles() - before, loaded)


def check_late_compiles(engine) -> None:
    """After warm-up, after each step: logs and counts (`Engine.late_compiles`) the kernels the
    step compiled, each a shape the warm-up missed."""
    now = compile_watch.compiles()
    if now != engine._compiles_seen:
        late = compile_watch.seen()[engine._compiles_seen:now]
        engine.late_compiles += len(late)
        engine._compiles_seen = now
        log.warning("a step compiled %d kernel(s) after warm-up (a shape it missed): %s", len(late),
                    "; ".join(f"{kernel}[{key}]" for kernel, key in late))
