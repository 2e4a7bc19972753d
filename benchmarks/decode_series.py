"""A series of warm decode steps, async scheduling off against on, in the same run.

For each running count, an engine with `async_scheduling` off and one with it on decode the same
sequences (greedy, random prompts) for `--steps` steps after a few warm ones; each `Engine.step`
call is timed on the host, whole. Prints per mode the median step, p99, p99/median, tokens/s and
the share of steps planned ahead, and the ratio on/off of the medians (the baseline is the same
engine with it off, measured in this run).

On CUDA (default when present) the engine is the `--shape` (step_cost.py's published shapes) over
random bf16 weights, decode graphs on: there the host's planning, preparing and reading overlaps
the device, and the ratio is the gain. On CPU the device is the host: every op runs as it is
called, so nothing overlaps and the ratio says only what the bookkeeping costs (there, the `bench`
demo model, Qwen3.5-MoE). Not a test, never a timing assertion.

    python3 benchmarks/decode_series.py                      # CUDA: 64 and 256 running, 200 steps
    python3 benchmarks/decode_series.py --running 16 --steps 50   # CPU
    python3 benchmarks/decode_series.py --quick                   # CPU, tiny: proves the path
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cairn.workers.engine import Engine  # noqa: E402
from cairn.workers.sampling_params import SamplingParams  # noqa: E402

WARM = 5
PROMPT = 100  # tokens of each decoding sequence's prompt


def cpu_engine(max_seqs: int, async_scheduling: bool, model_dir: Path) -> Engine:
    return Engine.from_pretrained(model_dir, max_num_seqs=max_seqs, num_pages=4096, async_scheduling=async_scheduling)


def series(engine: Engine, running: int, steps: int) -> tuple[list[float], float]:
    """Seconds of each of `steps` warm steps with `running` sequences decoding; the share planned ahead."""
    g = torch.Generator().manual_seed(running)
    params = SamplingParams(max_tokens=steps + 4 * WARM + PROMPT, temperature=0, ignore_eos=True)
    ids = [engine.add_request(torch.randint(0, engine.config.vocab_size, (PROMPT,), generator=g).tolist(), params)
           for _ in range(running)]
    scheduler = engine.scheduler
    while scheduler.waiting or any(s.num_uncomputed > 1 for s in scheduler.running):
        engine.step()
    for _ in range(WARM):
        engine.step()
    ahead, times = engine.async_steps.overlapped_steps, []
    for _ in range(steps):
        began = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - began)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    share = (engine.async_steps.overlapped_steps - ahead) / steps
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return times, share


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--running", default=None, help="comma-separated running counts (cuda: 64,256; cpu: 16)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--shape", default="qwen3.5-35b-a3b", help="CUDA: a shape of step_cost.py's SHAPES")
    parser.add_argument("--quick", action="store_true", help="CPU only: the tiny demo model, 4 running, 10 steps")
    args = parser.parse_args()
    if args.quick:
        args.device, args.running, args.steps = "cpu", args.running or "4", 10
    counts = [int(x) for x in (args.running or ("64,256" if args.device == "cuda" else "16")).split(",")]
    if args.device == "cuda":
        from step_cost import SHAPES
        from step_timing import full_engine

        cfg = SHAPES[args.shape][0]

        def make(on: bool) -> Engine:
            return full_engine(cfg, "cuda", max(counts), async_scheduling=on)
        what = f"{args.shape}, random bf16 weights, decode graphs, cuda"
    else:
        from cairn.workers.demo import write_demo_model

        size = "tiny" if args.quick else "bench"
        model_dir = write_demo_model(Path(tempfile.mkdtemp()), size=size, seed=0, arch="qwen3_5_moe")

        def make(on: bool) -> Engine:
            return cpu_engine(max(counts), on, model_dir)
        what = f"demo {size} qwen3_5_moe, cpu (the device is the host: nothing overlaps)"
    print(f"# decode series: {args.steps} warm steps a row; {what}; baseline: async scheduling off, this run")
    print(f"{'running':>8} {'mode':>6} {'median ms':>10} {'p99 ms':>8} {'p99/med':>8} {'tok/s':>9} {'ahead':>6}")
    for on in (False, True):  # one engine a mode, its rows in turn
        engine = make(on)
        for running in counts:
            times, share = series(engine, running, args.steps)
            med = statistics.median(times)
            row = (running, on, med, p99(times))
            print(f"{running:>8} {'on' if on else 'off':>6} {med * 1e3:>10.2f} {row[3] * 1e3:>8.2f} "
                  f"{row[3] / med:>8.2f} {running / med:>9.0f} {share:>6.0%}")
            results[(running, on)] = med
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for running in counts:
        print(f"# {running} running: median step on/off = {results[(running, True)] / results[(running, False)]:.3f}")
    return 0


results: dict[tuple[int, bool], float] = {}

if __name__ == "__main__":
    raise SystemExit(main())
