"""The engine's own CPU time per step: what cairn's Python costs beside the model.

On a GPU a decode step of a small or MoE model takes a few milliseconds, so the scheduler's,
the cache's and the runner's Python time decides the throughput. Here the model is a stub that
returns zero logits at once, so only cairn's code is timed (CPU time of the engine's thread,
`time.thread_time`). Its shapes are a tiny hybrid (one linear, one attention layer; a small
vocabulary, so the sampler's argmax is not what is measured).

Measured:
1. Steps with 64, 256 and 1024 running sequences (page size 16, policy cairn):
   - decode only: every sequence past its prompt, one token a step;
   - mixed: the same decodes plus a 512-token chunk of a long prompt's prefill every step.
   CPU ms per step, split into schedule, cache (the prefix cache's calls), runner tensors
   (building the step's tensors), sampler, post-process (the step applied, outputs built) and
   the rest of the engine's step.
2. Admitting a 32k-token prompt against a cache holding 100k pages: `match` + `can_admit` +
   `admit`, its page hashes given (as the ingress computes them): a prompt whose first 31k tokens
   are cached (a long conversation's next turn) and one that shares nothing (it evicts its 2,048
   pages from the full cache).
Goals (issue 10): <= 1 ms per decode step at 256 running; <= 2 ms to admit a 32k-token prompt.
Each number prints its ratio to the goal. Not a test: nothing is asserted.

Usage: python3 benchmarks/overhead.py [--quick] [--steps 64]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from cairn.workers import Engine, EngineOptions, SamplingParams  # noqa: E402
from cairn.workers.cache.arena import page_bytes  # noqa: E402
from cairn.workers.model.model_config import ModelConfig  # noqa: E402
from cairn.workers.cache.prefix_cache import PrefixCache  # noqa: E402
from cairn.workers.execution.runner import ModelRunner  # noqa: E402
from cairn.workers.sampler import Sampler  # noqa: E402
from cairn.workers.scheduler import Scheduler  # noqa: E402

CONFIG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                     layer_types=("linear_attention", "full_attention"), linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
                     max_position_embeddings=1 << 20)
SECTIONS = ("schedule", "cache", "runner tensors", "sampler", "post-process", "engine")
PAGE = 16


class StubModel(nn.Module):
    """Returns zero logits for the rows asked, at once: no model time."""

    def __init__(self) -> None:
        super().__init__()
        self.config = CONFIG
        self.anchor = nn.Parameter(torch.zeros(1))
        self._logits = torch.zeros(8192, CONFIG.vocab_size)

    def forward(self, batch, caches) -> torch.Tensor:
        return self._logits[:batch.logits_indices.shape[0]]


class Clock:
    """Exclusive CPU time per section: a call's time goes to its section minus the time of the
    sections called inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []

    def wrap(self, obj: object, name: str, section: str) -> None:
        fn = getattr(obj, name)
        clock = self

        def timed(*args, **kwargs):
            clock._stack.append([section, time.thread_time(), 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                sec, start, inner = clock._stack.pop()
                spent = time.thread_time() - start
                clock.totals[sec] += spent - inner
                if clock._stack:
                    clock._stack[-1][2] += spent
        setattr(obj, name, timed)

    def instrument(self, engine: Engine) -> None:
        self.wrap(engine, "step", "engine")
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.scheduler, "postprocess", "post-process")
        self.wrap(engine.runner, "prepare", "runner tensors")
        self.wrap(engine.runner, "execute", "runner tensors")
        self.wrap(engine.sampler, "sample", "sampler")
        for name in ("match", "can_admit", "admit", "can_grow", "grow", "take_checkpoint_slot", "finish_capture",
                     "commit_checkpoint", "register_pages", "finish", "release", "end_pass", "extend_hashes"):
            self.wrap(engine.cache, name, "cache")


def stub_engine(max_num_seqs: int, max_num_batched_tokens: int, cache_bytes: int) -> Engine:
    options = EngineOptions(page_size=PAGE, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            cache_memory_bytes=cache_bytes)
    return Engine(StubModel(), options)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, CONFIG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step_cost(running: int, mixed: bool, steps: int) -> dict[str, float]:
    """CPU ms per step by section, with `running` sequences decoding (and, if `mixed`, a 512-token
    prefill chunk of a long prompt in every step); `total` is timed apart, without the
    per-section timers (which cost a little themselves)."""
    chunk = 512 if mixed else 0
    engine = stub_engine(running + (1 if mixed else 0), running + chunk, 1 << 30)
    forever = SamplingParams(max_tokens=1 << 19, temperature=0, ignore_eos=True)
    for i in range(running):
        engine.add_request(prompt(100, i), forever)
    while len(engine.scheduler.running) < running or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    if mixed:  # long prompts queue behind the decodes; each step computes 512 tokens of one
        for i in range(4):
            engine.add_request(prompt(steps * chunk, 10_000 + i), SamplingParams(max_tokens=1))
    gc.collect()
    gc.freeze()  # as an engine replica does once it is built: the model's objects are never scanned
    start = time.thread_time()
    for _ in range(steps):
        engine.step()
    total = (time.thread_time() - start) / steps * 1e3
    clock = Clock()
    clock.instrument(engine)
    for _ in range(steps):
        engine.step()
    gc.unfreeze()
    return {**{s: clock.totals[s] / steps * 1e3 for s in SECTIONS}, "total": total}


def admission_cost(cached_pages: int, prompt_tokens: int, runs: int) -> dict[str, list[float]]:
    """ms for match, can_admit and admit of a `prompt_tokens` prompt against a full cache of
    `cached_pages` pages: a prompt whose head is cached (`hit`) and one that shares nothing."""
    pages = cached_pages + 4 * prompt_tokens // PAGE  # the filler, the conversation, the two prompts, spare
    engine = stub_engine(8, 8192, pages * page_bytes(CONFIG, PAGE, 4) + (64 << 20))  # + room for states
    cache, spec = engine.cache, engine.spec
    long = prompt(prompt_tokens, 1)
    seed = 2
    while cache.pages.num_cached < cached_pages:  # fill the cache with other prompts' pages
        engine.generate([prompt(prompt_tokens, seed)], SamplingParams(max_tokens=1))
        seed += 1
    engine.generate([long], SamplingParams(max_tokens=1))  # the conversation so far: 2,048 pages, last used
    times: dict[str, list[float]] = defaultdict(list)
    for run in range(runs):
        for case, tokens in (("hit", long[:prompt_tokens - 1024] + prompt(1024, 10**6 + run)),
                             ("miss", prompt(prompt_tokens, 2 * 10**6 + run))):
            root = spec.hash_root()
            rid = engine.add_request(tokens, SamplingParams(max_tokens=1), page_hashes=spec.page_hashes(tokens, root))
            seq = engine._requests[rid]
            n = seq.num_tokens
            t0 = time.thread_time()
            m = cache.match(seq)
            t1 = time.thread_time()
            ok = cache.can_admit(seq, m, min(n - m.resume_token, 8192))
            t2 = time.thread_time()
            if not ok:
                raise SystemExit(f"{case}: the prompt does not fit; raise the cache size")
            cache.admit(seq, m, min(n - m.resume_token, 8192))
            t3 = time.thread_time()
            cache.end_pass()
            times[f"{case} match"].append((t1 - t0) * 1e3)
            times[f"{case} can_admit"].append((t2 - t1) * 1e3)
            times[f"{case} admit"].append((t3 - t2) * 1e3)
            times[f"{case} total"].append((t3 - t0) * 1e3)
            times[f"{case} resume"].append(m.resume_token)
            engine.scheduler.waiting.remove(seq)  # hand it back: it was admitted by hand
            engine.scheduler.running.append(seq)
            seq.status = seq.status.RUNNING
            engine.abort(rid)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, 16k pages, one admission run")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps, pages, runs = (8, 16_000, 1) if args.quick else (args.steps, 100_000, 5)
    print(f"CPU ms per engine step (stub model, page size {PAGE}, {steps} steps, thread CPU time)")
    print(f"{'running':>8} {'kind':>7} " + " ".join(f"{s:>14}" for s in SECTIONS) + f" {'total':>8} {'/goal':>6}")
    for running in (64, 256, 1024):
        for mixed in (False, True):
            cost = step_cost(running, mixed, steps)
            total = cost["total"]
            goal = f"{total / 1.0:6.2f}" if running == 256 and not mixed else "     -"
            print(f"{running:>8} {'mixed' if mixed else 'decode':>7} " + " ".join(f"{cost[s]:>14.3f}" for s in SECTIONS)
                  + f" {total:>8.3f} {goal}")
    print("(sections: exclusive CPU time, timed in a second run with a timer around each call; total: the "
          "first run, untimed inside)")
    print(f"\nadmitting a 32k-token prompt, page hashes given, against {pages:,} cached pages "
          f"(ms, median of {runs}; goal 2 ms)")
    times = admission_cost(pages, 32768, runs)
    for case in ("hit", "miss"):
        med = {k: statistics.median(times[f"{case} {k}"]) for k in ("match", "can_admit", "admit", "total")}
        print(f"  {case:>4}: resume at {int(times[f'{case} resume'][0]):>6} tokens; match {med['match']:.3f}, "
              f"can_admit {med['can_admit']:.3f}, admit {med['admit']:.3f}; total {med['total']:.3f} "
              f"= {med['total'] / 2.0:.2f} x goal")
    print(f"\nmachine: {os.cpu_count()} CPUs, torch {torch.__version__}; timed classes: "
          f"{', '.join(c.__name__ for c in (Scheduler, PrefixCache, ModelRunner, Sampler))}")


if __name__ == "__main__":
    main()
