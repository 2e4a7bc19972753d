"""The cache under memory pressure: the host tier on and off, beside an unbounded device cache.

Many conversations advance turn by turn, all open at once (multiturn.py's traces, the model's own
outputs fed back: thinking-drop, each turn dropping the last reply's reasoning, and agent, tool
rounds), on the demo model of `--arch`. The device budget is a multiple (1x, 1.5x and 2x by
default) of the smallest that runs the trace: the arena that holds its longest sequence, pages
and running state, and nothing more, so conversations run few at a time and evict one another
(tests/workers/cache/test_tier_pressure.py runs the same at 1x). At each budget
the same trace runs three times:
- host tier off: what the device alone keeps;
- host tier on (cairn.workers.cache.host_tier), `--host-budget` times what the oracle below
  kept (default 1.5: a tier that can hold the whole working set, as host memory usually can);
- the oracle: an unbounded device cache (memory to spare: nothing is ever evicted), the most
  this engine could reuse.
Printed per run: cached tokens and their ratio to the oracle's, later turns' cached tokens over
the previous prompt's length (what a conversation keeps between its turns), how many requests
resume more than 2 tokens short of where the oracle resumed them, tokens computed, and what
moved between the tiers. Goal: the tier at >= 0.9 of the oracle where the device alone keeps
under a third. Not a test (nothing is asserted; tests/workers/cache/test_tier_pressure.py is).

Usage: python3 benchmarks/tiers.py [--arch qwen3_5] [--convs 16] [--turns 4] [--budgets 1,1.5,2]
                                   [--host-budget 1.5] [--workloads thinking-drop,agent] [--quick]
  --quick: the tiny demo model, 6 conversations, 3 turns, one budget: checks that the script runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages

import torch  # noqa: E402

from multiturn import Client, Request, Result, record_trace, replay  # noqa: E402  (benchmarks/multiturn.py)
from cairn.workers import Engine  # noqa: E402
from cairn.workers.demo import demo_model_dir  # noqa: E402

SPARE = 2**30  # bytes: an arena where nothing is ever evicted (the oracle)


def smallest_budget(engine: Engine, rounds: list[list[Request]]) -> int:
    """Arena bytes that hold the trace's longest sequence (prompt and output pages, a running
    state) and nothing more: the least that runs it."""
    ps, layout = engine.spec.page_size, engine.layout
    longest = max(-(-(len(r.prompt) + r.output_len) // ps) for reqs in rounds for r in reqs)
    return (longest + layout.slot_blocks) * layout.block_bytes


def kept_between_turns(rounds: list[list[Request]], res: Result) -> float:
    """Turns 2+: cached tokens / the previous turn's prompt length, summed over requests."""
    previous = {(r.conv, r.turn): len(r.prompt) for reqs in rounds for r in reqs}
    later = [(res.cached[(r.conv, r.turn)], previous[(r.conv, r.turn - 1)]) for reqs in rounds[1:] for r in reqs]
    return sum(c for c, _ in later) / max(sum(p for _, p in later), 1)


def short_of(oracle: Result, res: Result, tokens: int = 2) -> int:
    """Requests that resumed more than `tokens` tokens short of where the oracle resumed them."""
    return sum(1 for key, hit in oracle.cached.items() if res.cached[key] < hit - tokens)


def run(model_dir: Path, rounds: list[list[Request]], opts: dict, device: int, host: int) -> tuple[Result, Engine]:
    engine = Engine.from_pretrained(model_dir, cache_policy="cairn", cache_memory_bytes=device,
                                    host_cache_bytes=host, **opts)
    return replay(engine, rounds, "cairn"), engine


def report(workload: str, rounds: list[list[Request]], runs: list[tuple[str, Result]]) -> None:
    oracle = runs[-1][1]
    total = sum(oracle.cached.values())
    print(f"{'run':34s} {'cached':>7s} {'/oracle':>7s} {'kept':>5s} {'short>2':>7s} {'computed':>8s} "
          f"{'MiB->host':>9s} {'MiB<-host':>9s} {'promoted':>8s} {'from host':>9s}")
    for name, r in runs:
        m = r.metrics
        print(f"{name:34s} {sum(r.cached.values()):7d} {sum(r.cached.values()) / max(total, 1):7.3f} "
              f"{kept_between_turns(rounds, r):5.2f} {short_of(oracle, r):7d} {r.computed:8d} "
              f"{m.bytes_to_host_total / 2**20:9.2f} {m.bytes_to_device_total / 2**20:9.2f} "
              f"{m.pages_promoted_total:8d} {m.checkpoints_from_host_total:9d}")
    (_, off), (_, on) = runs[0], runs[1]
    kept, alone = sum(on.cached.values()), sum(off.cached.values())
    versus = f"{kept / alone:.1f}x the device alone" if alone else "the device alone kept nothing"
    print(f"{workload}: the tier keeps {kept / max(total, 1):.3f} of the oracle's cached tokens, {versus} "
          f"({alone / max(total, 1):.3f} of the oracle)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen3_5", choices=("qwen3_next", "qwen3_5", "qwen3_5_moe"))
    parser.add_argument("--convs", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--budgets", default="1,1.5,2", help="device budgets, as multiples of the smallest that runs")
    parser.add_argument("--host-budget", type=float, default=1.5,
                        help="the host tier, as a multiple of what the unbounded device cache kept")
    parser.add_argument("--workloads", default="thinking-drop,agent")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 conversations, 3 turns, one budget")
    args = parser.parse_args()
    size = "bench"
    if args.quick:
        size, args.convs, args.turns, args.budgets, args.threads = "tiny", 6, 3, "1", 1
    torch.set_num_threads(args.threads)
    model_dir = demo_model_dir(size, args.arch)
    client = Client(model_dir)
    opts = dict(max_num_seqs=args.convs, max_num_batched_tokens=2048)
    for workload in args.workloads.split(","):
        recorder = Engine.from_pretrained(model_dir, cache_policy="all", cache_memory_bytes=SPARE, **opts)
        rounds = record_trace(recorder, client, workload, args.convs, args.turns, system_words=60,
                              user_words=30, answer_tokens=args.answer_tokens)
        smallest = smallest_budget(recorder, rounds)
        oracle, unbounded = run(model_dir, rounds, opts, SPARE, 0)
        working_set = unbounded.cache.used_bytes  # all it kept: nothing was evicted
        host = int(args.host_budget * working_set)
        for share in map(float, args.budgets.split(",")):
            device = int(share * smallest)
            print(f"\n== {workload}, {size} {args.arch} demo, {args.convs} conversations x {args.turns} turns: "
                  f"device {device / 2**20:.2f} MiB ({share:g}x the smallest that runs, "
                  f"{smallest / 2**20:.2f} MiB); the working set {working_set / 2**20:.1f} MiB ==")
            runs = [("host tier off", run(model_dir, rounds, opts, device, 0)[0]),
                    (f"host tier on ({host / 2**20:.1f} MiB)", run(model_dir, rounds, opts, device, host)[0]),
                    ("oracle: unbounded device cache", oracle)]
            report(workload, rounds, runs)


if __name__ == "__main__":
    main()
