"""What one engine step would cost on a GPU, counted on CPU through the real engine path, projected
onto a named GPU, and (--measure) timed on a device beside the projection.

    python3 benchmarks/step_cost.py [--shapes qwen3-next-80b,...] [--steps NAMES] [--gpu h200] [--quick]
        [--json] [--sites] [--calibrate KERNEL_SPEED.json] [--measure [--measure-device cpu] [--repeats N]
        [--profile]]

For each model shape (real layer count, layer pattern, head counts, experts and top-k; tiny widths,
so it runs on CPU) and each step of step_limit.STEPS, an engine is brought to the step with real
CPU steps, and the step itself runs under `cairn.workers.execution.step_census.Census`: the
scheduler, the runner, the model with every kernel's Triton launcher (launch stubbed) and the
sampler, exactly as on CUDA. It prints kernel launches, host syncs, uploads and aten ops per step,
by phase and per layer kind, the busiest call sites (--sites), and the projection:

    projected = max(device, launches x launch cost) + syncs x sync cost

where device is the step's limit at full size (step_limit.py; uncalibrated: every kernel at its
limit) or, with --calibrate, each kernel class's limit over the efficiency kernel_speed.py measured
for it (the rows say which classes were measured, which assumed). Decode rows also project decode
graphs (cairn.workers.execution.decode_graphs): the forward's launches become one replay and a
microsecond each on the device, the step's other launches stay eager. A tensor-parallel shape
counts one rank (`shard_config`, collectives as launches) against one GPU's limit for its share
(tensor-parallel engines run eager today: the graph column is for comparison).

--measure builds the shape at full size with random bf16 weights (step_timing.py), prints what
`Engine.warm_up` took, then for every step the median, min and max of warm runs, the first run's
time (what the first such request after start pays) and first / warm (goal <= FIRST_GOAL), beside
the projection and limit at the context its decoding sequences hold. `--measure-device cpu` proves
that path at tiny widths. --profile (with --measure on CUDA) prints the kernels of one warm 4k
prefill by GPU time. gpu_check.sh runs it all on a GPU. --json prints one JSON line per row (a
measured row has "measured": true, the profile "profiled").

This file asserts nothing about time; tests/workers/test_step_syncs.py asserts the sync counts,
tests/test_step_cost.py the calibration and the measuring path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the census needs compiled triton's host code
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cairn.workers.engine import Engine  # noqa: E402
from cairn.workers.engine_options import EngineOptions  # noqa: E402
from cairn.workers.sampling_params import SamplingParams  # noqa: E402
from cairn.workers.execution.step_census import Census, CensusGroup, Tally  # noqa: E402
from cairn.workers.model.family_registry import family_named  # noqa: E402
from cairn.workers.model.model_config import FULL, LINEAR, ModelConfig  # noqa: E402
from cairn.workers.model.sharding import Shard, shard_config  # noqa: E402
from step_limit import (ASSUMED, CONTEXT, DEFAULT_EFFICIENCY, QUICK_STEPS, STEPS, Calibration, Step,  # noqa: E402
                        calibrated_s, limit_s, step_work)
from step_timing import (DECODE_PROMPT, WARM_REPEATS, StepDriver, StepTimes, full_engine, measure,  # noqa: E402
                         profile, random_head)


def _layers(n: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))


def _shape(model_type: str, layers: int, hidden: int, heads: int, experts: int, top_k: int, inter: int,
           value_heads: int, vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=2, head_dim=256, layer_types=_layers(layers),
                       model_type=model_type, partial_rotary_factor=0.25, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=value_heads,
                       num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                       shared_expert_intermediate_size=inter, torch_dtype="bfloat16")


# The published config.json sizes of each model (text part), as far as the step's cost goes.
SHAPES = {
    "qwen3-next-80b": (_shape("qwen3_next", 48, 2048, 16, 512, 10, 512, 32, 151936), 1),
    "qwen3.5-35b-a3b": (_shape("qwen3_5_moe", 40, 2048, 16, 256, 8, 512, 32, 248320), 1),
    "qwen3.5-397b-a17b-tp8": (_shape("qwen3_5_moe", 60, 4096, 32, 512, 10, 1024, 64, 248320), 8),
}
GPUS = {"h200": dict(bandwidth=4.8e12, flops=989e12, launch_us=5.0, sync_us=(10.0, 20.0), graph_node_us=1.0),
        "h100": dict(bandwidth=3.35e12, flops=989e12, launch_us=5.0, sync_us=(10.0, 20.0), graph_node_us=1.0),
        "a100": dict(bandwidth=2.0e12, flops=312e12, launch_us=5.0, sync_us=(10.0, 20.0), graph_node_us=1.5)}
GRAPH_LAUNCH_US = 10.0  # one graph replay's own launch
FIRST_GOAL = 1.2  # the goal: a shape's first run after start <= 1.2 x its warm time
PROFILED = next(s for s in STEPS if s.name == "prefill 4k")


def tiny(cfg: ModelConfig) -> ModelConfig:
    """The same model with tiny widths: every count the census makes is kept, the memory is not."""
    return replace(cfg, hidden_size=64, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                   intermediate_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                   vocab_size=1024, torch_dtype="bfloat16")


def build_engine(cfg: ModelConfig, tp: int, running: int, census: Census | None = None, **options: object) -> Engine:
    """An engine over random bf16 weights of `cfg` (rank 0 of `tp`), room for `running` sequences;
    `options`: other EngineOptions fields."""
    torch.manual_seed(0)
    rank_cfg = shard_config(cfg, tp)
    group = CensusGroup(tp, census) if tp > 1 else None
    model = family_named(cfg.model_type).model_class(rank_cfg, Shard(0, tp), group)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model = model.to(torch.bfloat16).eval()
    engine_options = EngineOptions(max_num_seqs=max(running, 1) + 1, max_num_batched_tokens=4096 + 512,
                                   cache_memory_bytes=1536 * 2**20, device="cpu", dtype="bfloat16", **options)
    return Engine(model, engine_options, mtp=random_head(rank_cfg, "cpu") if engine_options.num_speculative_tokens
                  else None)


def recorded_works(engine: Engine) -> list:
    """From now on, every `StepWork` the engine's runner prepares is appended to the list returned
    (a plan's checkpoints planned after its step are in its work too: they share its lists)."""
    prepared, works = engine.runner.prepare, []

    def prepare(*args, **kwargs):
        works.append(prepared(*args, **kwargs))
        return works[-1]
    engine.runner.prepare = prepare
    return works


def census_series(cfg: ModelConfig, running: int, steps: int, async_scheduling: bool) -> dict:
    """`steps` warm decode steps of `running` sequences over the decode graphs' fixed buffers
    (`enforce_eager=False`: what CUDA replays), each counted alone: per step its syncs, uploads
    and launches, whether it copied a checkpoint (a page boundary's capture: its cost is that
    step's), and whether any input buffer was made after the first warm steps."""
    engine = build_engine(tiny(cfg), 1, running, enforce_eager=False, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(running):
        engine.add_request(torch.randint(0, 1024, (24,), generator=g).tolist(), params)
    scheduler, graphs = engine.scheduler, engine.runner.graphs
    while scheduler.waiting or any(seq.num_uncomputed > 1 for seq in scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    buffers = {size: entry[0].data_ptr() for size, entry in graphs._static.items()}
    works = recorded_works(engine)
    rows = []
    for _ in range(steps):
        works.clear()
        with Census() as census:
            outputs = engine.step()
        t = census.total()
        rows.append(dict(syncs=t.syncs, uploads=t.uploads, launches=t.launches, outputs=len(outputs),
                         forward_syncs=census.phases.get("forward", Tally()).syncs,
                         captures=sum(len(w.snapshots) for w in works)))
    after = {size: entry[0].data_ptr() for size, entry in graphs._static.items()}
    return dict(series=steps, running=running, async_scheduling=async_scheduling, steps=rows,
                new_input_buffers=sum(1 for size, ptr in after.items() if buffers.get(size) != ptr),
                overlapped_steps=engine.async_steps.overlapped_steps)


def count_step(cfg: ModelConfig, tp: int, step: Step) -> tuple[Census, int]:
    """Brings a fresh engine to `step` with real CPU steps, then counts that step; returns the
    census and the number of recurrent-state checkpoints the step saved."""
    census = Census()
    engine = build_engine(tiny(cfg), tp, step.decodes + len(step.prefills), census,
                          **({"num_speculative_tokens": step.drafts, "speculative_adaptive": False,
                              "speculative_exact": step.exact} if step.drafts else {}))
    driver = StepDriver(engine)
    driver.enter(step)
    works = recorded_works(engine)
    driver.run(step, around=census)
    return census, len(works[-1].checkpoint_targets)


# ---------------------------------------------------------------- the projection


def project(census: Census, limit: float, device_s: float, gpu: dict, graphed: bool) -> dict:
    """`device_s`: what the kernels take. Eager: every launch costs the host `launch_us`; with a decode
    graph (`graphed`), the forward's launches are one replay plus `graph_node_us` each on the device,
    the rest of the step eager. Ratios are to the `limit`."""
    t = census.total()
    launch_s = t.launches * gpu["launch_us"] * 1e-6
    lo, hi = (max(device_s, launch_s) + t.syncs * s * 1e-6 for s in gpu["sync_us"])
    out = dict(projected_s=(lo, hi), ratio=(lo / limit, hi / limit))
    if graphed:
        inside = census.phases.get("forward", Tally()).launches
        graph_s = (GRAPH_LAUNCH_US + inside * gpu["graph_node_us"] + (t.launches - inside) * gpu["launch_us"]) * 1e-6
        g = max(device_s, graph_s) + t.syncs * gpu["sync_us"][1] * 1e-6
        out.update(graph_s=g, graph_ratio=g / limit)
    return out


def projection(cfg: ModelConfig, tp: int, step: Step, census: Census, gpu: dict, calibration: Calibration | None,
               context: int = CONTEXT) -> dict:
    """The step's work by class, its limit and its projection (calibrated when `calibration` is given)."""
    work = step_work(cfg, tp, step, context)
    limit = limit_s(work, gpu)
    device_s, taken = calibrated_s(work, gpu, calibration) if calibration else (limit, {})
    out = dict(bytes=sum(w.bytes for w in work.values()), flops=sum(w.flops for w in work.values()), limit_s=limit,
               device_s=device_s, calibrated=calibration is not None,
               work={kind: dict(bytes=w.bytes, flops=w.flops, tokens=w.tokens, limit_s=w.limit_s(gpu))
                     for kind, w in work.items()},
               efficiency={kind: dict(fraction=e.fraction, measured_at=e.measured_at) for kind, e in taken.items()})
    graphed = not step.prefills and (not step.drafts or step.exact)  # what decode graphs capture
    return {**out, **project(census, limit, device_s, gpu, graphed=graphed)}


def report(name: str, cfg: ModelConfig, tp: int, step: Step, census: Census, checkpoints: int, gpu_name: str,
           gpu: dict, calibration: Calibration | None) -> dict:
    t = census.total()
    layers = {kind: dict(layers=n, launches=tally.launches / n, syncs=tally.syncs / n)
              for kind, (n, tally) in census.per_layer_kind().items()}
    return dict(shape=name, step=step.name, tp=tp, checkpoints=checkpoints, launches=t.launches, syncs=t.syncs,
                uploads=t.uploads, aten_ops=t.ops, phases={p: vars(x) for p, x in census.phases.items()},
                per_layer=layers, busiest_launches=census.busiest("launch"), busiest_syncs=census.busiest("sync"),
                gpu=gpu_name, **projection(cfg, tp, step, census, gpu, calibration))


# ---------------------------------------------------------------- output


def print_header(gpu_name: str, gpu: dict, calibration: Calibration | None) -> None:
    print(f"GPU {gpu_name}: {gpu['bandwidth'] / 1e12:.2f} TB/s, {gpu['flops'] / 1e12:.0f} TFLOP/s bf16, "
          f"{gpu['launch_us']} us a launch, {gpu['sync_us'][0]}-{gpu['sync_us'][1]} us a host sync; "
          f"{CONTEXT} tokens of context per decoding sequence; bf16 weights and K/V, fp32 states.")
    print("Counted at tiny widths, real layers, heads, experts and top-k. limit = max(bytes / bandwidth, "
          "FLOPs / peak), at full size.")
    if calibration is None:
        print("projected (uncalibrated: assumes every kernel at its limit) = max(limit, launches x launch cost) "
              "+ syncs x sync cost.")
    else:
        assumed = ", ".join(f"{kind} {f:.0%}" for kind, f in ASSUMED.items())
        print(f"projected (calibrated by {calibration.source}, measured on {calibration.gpu}) = max(sum over kernel "
              f"classes of class limit / efficiency, launches x launch cost) + syncs x sync cost; assumed "
              f"efficiencies: {assumed}, {DEFAULT_EFFICIENCY:.0%} for a kernel class the file does not measure.")
        if gpu_name.lower() not in calibration.gpu.lower():
            print(f"NOTE: the calibration was measured on {calibration.gpu}, the projection is onto {gpu_name}.")
    print(f"graph (decode steps): max(device, {GRAPH_LAUNCH_US} us + forward launches x {gpu['graph_node_us']} us "
          f"+ the step's other launches x {gpu['launch_us']} us) + syncs x {gpu['sync_us'][1]} us.")
    print(f"{'shape':<24}{'step':<21}{'launches':>9}{'syncs':>7}{'in fwd':>9}{'uploads':>8}{'aten ops':>9}"
          f"{'limit ms':>10}{'projected ms':>19}{'ratio':>13}{'graph ms':>10}{'ratio':>8}")


def print_row(r: dict) -> None:
    lo, hi = r["ratio"]
    forward = r["phases"].get("forward", {})
    per = ", ".join(f"{k} {v['launches']:.0f} launches/{v['syncs']:.0f} syncs per layer"
                    for k, v in sorted(r["per_layer"].items()))
    print(f"{r['shape']:<24}{r['step']:<21}{r['launches']:>9}{r['syncs']:>7}{forward.get('syncs', 0):>9}"
          f"{r['uploads']:>8}{r['aten_ops']:>9}{r['limit_s'] * 1e3:>10.3f}"
          f"{r['projected_s'][0] * 1e3:>10.2f}-{r['projected_s'][1] * 1e3:<8.2f}{lo:>6.1f}-{hi:<5.1f}x"
          + (f"{r['graph_s'] * 1e3:>10.2f}{r['graph_ratio']:>7.1f}x" if "graph_s" in r else ""))
    print(f"{'':<40}{per}")
    if r["calibrated"]:
        print(f"{'':<40}{efficiencies(r['efficiency'])}")


def efficiencies(taken: dict) -> str:
    measured = [f"{k} {e['fraction']:.0%} ({e['measured_at']})" for k, e in taken.items() if e["measured_at"]]
    assumed = [f"{k} {e['fraction']:.0%}" for k, e in taken.items() if not e["measured_at"]]
    return f"measured: {', '.join(measured) or 'none'}; assumed: {', '.join(assumed) or 'none'}"


def measured_row(name: str, cfg: ModelConfig, step: Step, census: Census, times: StepTimes, gpu: dict,
                 calibration: Calibration | None) -> dict:
    """A step's times beside its projection at the context the measured engine's sequences hold: the
    decode graph's where there is one (the engine captures them on CUDA), else eager at the lower sync cost."""
    proj = projection(cfg, 1, step, census, gpu, calibration, context=DECODE_PROMPT)
    projected = proj.get("graph_s", proj["projected_s"][0])
    return dict(shape=name, step=step.name, first_s=times.first_s, warm_median_s=times.median_s,
                warm_min_s=min(times.warm_s), warm_max_s=max(times.warm_s), warm_runs=len(times.warm_s),
                first_over_warm=times.first_s / times.median_s, projected_s=projected, calibrated=proj["calibrated"],
                limit_s=proj["limit_s"], warm_over_limit=times.median_s / proj["limit_s"],
                warm_over_projected=times.median_s / projected)


def print_measured(name: str, device: str, warm_up_s: float, rows: list[dict]) -> None:
    label = "calibrated" if rows[0]["calibrated"] else "uncalibrated"
    print(f"measured {name} on {torch.cuda.get_device_name() if device == 'cuda' else 'cpu at tiny widths'}, random "
          f"bf16 weights: engine.warm_up() took {warm_up_s:.2f} s")
    print(f"first: the shape's first run in this engine, after warm-up and the steps above it (compiles included); "
          f"warm: median (min-max) of {rows[0]['warm_runs']} runs after two; goal first / warm <= "
          f"{FIRST_GOAL}. Decoding sequences hold {DECODE_PROMPT}-token prompts: limits and projections here are "
          f"at that context.")
    if device == "cpu":
        print("(CPU at tiny widths: this proves the measuring path; its times are not the projection's)")
    print(f"{'step':<21}{'warm ms':>10}{'min-max ms':>19}{'first ms':>10}{'first/warm':>11}"
          f"{'projected ms (' + label + ')':>30}{'warm/proj':>10}{'limit ms':>10}{'warm/limit':>11}")
    for r in rows:
        spread = f"{r['warm_min_s'] * 1e3:.2f}-{r['warm_max_s'] * 1e3:.2f}"
        over = " over goal" if r["first_over_warm"] > FIRST_GOAL else ""
        print(f"{r['step']:<21}{r['warm_median_s'] * 1e3:>10.2f}{spread:>19}{r['first_s'] * 1e3:>10.2f}"
              f"{r['first_over_warm']:>10.2f}x{r['projected_s'] * 1e3:>30.2f}{r['warm_over_projected']:>9.2f}x"
              f"{r['limit_s'] * 1e3:>10.2f}{r['warm_over_limit']:>10.1f}x{over}")
    decode64 = next((r for r in rows if r["step"] == "decode x64"), None)
    if decode64:
        print(f"measured {name}: {64 / decode64['warm_median_s']:.0f} output tokens/s at 64 running (warm)")


def print_profile(step: Step, wall_s: float, kernels_s: float, top: list) -> None:
    print(f"profile of one warm {step.name} (torch.profiler, CUDA activity): the step {wall_s * 1e3:.2f} ms wall, "
          f"its kernels {kernels_s * 1e3:.2f} ms on the GPU ({kernels_s / wall_s:.0%} of the step)")
    print(f"{'kernel':<72}{'total ms':>10}{'count':>7}{'% of step':>11}")
    for k in top:
        name = k.name if len(k.name) <= 70 else k.name[:67] + "..."
        print(f"{name:<72}{k.total_s * 1e3:>10.3f}{k.count:>7}{k.total_s / wall_s:>11.1%}")


def measure_shape(name: str, cfg: ModelConfig, steps: list[Step], censuses: dict[str, Census], gpu: dict,
                  calibration: Calibration | None, args: argparse.Namespace) -> None:
    """--measure: `steps` timed on an engine of `cfg` at full size (tiny widths on CPU), printed beside
    their projections; --profile: then a warm 4k prefill's kernels."""
    full = cfg if args.measure_device == "cuda" else tiny(cfg)
    seqs = max(s.decodes + len(s.prefills) for s in steps) + 1
    engine = full_engine(full, args.measure_device, seqs)
    warm_up_s = engine.warm_up()
    driver = StepDriver(engine)
    times = measure(driver, [s for s in steps if not s.drafts], args.repeats)
    if args.profile:
        wall_s, kernels_s, top = profile(driver, PROFILED)
    for k, exact in sorted({(s.drafts, s.exact) for s in steps if s.drafts}):  # verify steps: an engine a mode
        del engine, driver  # (one full-size engine at a time)
        if args.measure_device == "cuda":
            torch.cuda.empty_cache()
        engine = full_engine(full, args.measure_device, seqs, num_speculative_tokens=k, speculative_adaptive=False,
                             speculative_exact=exact)
        driver = StepDriver(engine)
        times.update(measure(driver, [s for s in steps if (s.drafts, s.exact) == (k, exact)], args.repeats))
    rows = [measured_row(name, cfg, s, censuses[s.name], times[s.name], gpu, calibration) for s in steps]
    if args.json:
        for r in rows:
            print(json.dumps(dict(measured=True, warm_up_s=warm_up_s, **r)), flush=True)
    else:
        print_measured(name, args.measure_device, warm_up_s, rows)
    if args.profile:
        if args.json:
            print(json.dumps(dict(profiled=PROFILED.name, wall_s=wall_s, kernels_s=kernels_s,
                                  top=[vars(k) for k in top])), flush=True)
        else:
            print_profile(PROFILED, wall_s, kernels_s, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--steps", default=None, help="comma-separated step names (default: all)")
    parser.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_STEPS)}")
    parser.add_argument("--json", action="store_true", help="one JSON line per row, nothing else")
    parser.add_argument("--sites", action="store_true", help="print the ten busiest call sites of each row")
    parser.add_argument("--calibrate", metavar="FILE", default=None,
                        help="a benchmarks/kernel_speed.py --json-out file: project each kernel class at the "
                             "efficiency it measured instead of at its limit")
    parser.add_argument("--measure", action="store_true",
                        help="also time each step on a full-size engine with random bf16 weights (CUDA; on CPU "
                             "it needs --measure-device cpu and only proves the path at small shapes)")
    parser.add_argument("--measure-device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--repeats", type=int, default=WARM_REPEATS, help="warm runs of each step with --measure")
    parser.add_argument("--profile", action="store_true",
                        help="with --measure on CUDA: the kernels of one warm 4k prefill by GPU time")
    parser.add_argument("--series", type=int, default=0, metavar="N",
                        help="instead: N warm decode steps at --series-running sequences, each counted alone, "
                             "async scheduling off then on (syncs, uploads, launches, checkpoint captures per step)")
    parser.add_argument("--series-running", type=int, default=64)
    args = parser.parse_args()
    if args.series:
        for name in args.shapes.split(","):
            for on in (False, True):
                row = dict(shape=name, **census_series(SHAPES[name][0], args.series_running, args.series, on))
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                per = row["steps"]
                spread = lambda key: f"{min(r[key] for r in per)}-{max(r[key] for r in per)}"  # noqa: E731
                print(f"{name}, {row['running']} running, async scheduling {'on' if on else 'off'}: {len(per)} "
                      f"warm decode steps; per step syncs {spread('syncs')} (in the forward {spread('forward_syncs')}),"
                      f" uploads {spread('uploads')}, launches {spread('launches')}; steps copying a checkpoint "
                      f"{sum(1 for r in per if r['captures'])}; input buffers made {row['new_input_buffers']}; "
                      f"planned ahead {row['overlapped_steps']}")
        return
    if args.profile and not (args.measure and args.measure_device == "cuda"):
        parser.error("--profile profiles the CUDA kernels of a measured engine: it needs --measure on CUDA")
    if args.measure and args.measure_device == "cuda" and not torch.cuda.is_available():
        sys.exit("--measure times a full-size engine on a CUDA device; none is here")
    gpu = GPUS[args.gpu]
    calibration = Calibration.read(args.calibrate) if args.calibrate else None
    wanted = args.steps.split(",") if args.steps else (QUICK_STEPS if args.quick else [s.name for s in STEPS])
    unknown = set(wanted) - {s.name for s in STEPS}
    if unknown:
        parser.error(f"--steps: unknown {sorted(unknown)}; the steps are {[s.name for s in STEPS]}")
    steps = [s for s in STEPS if s.name in wanted]
    if not args.json:
        print_header(args.gpu, gpu, calibration)
    for name in args.shapes.split(","):
        cfg, tp = SHAPES[name]
        censuses = {}
        for step in steps:
            if step.drafts and tp > 1:
                if not args.json:
                    print(f"{name:<24}{step.name:<21}(verify steps are counted at tensor_parallel_size 1)")
                continue
            census, checkpoints = count_step(cfg, tp, step)
            censuses[step.name] = census
            row = report(name, cfg, tp, step, census, checkpoints, args.gpu, gpu, calibration)
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            print_row(row)
            if args.sites:
                for what in ("launches", "syncs"):
                    for site, n in row[f"busiest_{what}"]:
                        print(f"{'':<44}{n:>8} {what:<9}{site}")
        if args.measure and tp == 1:
            measure_shape(name, cfg, [s for s in steps if s.name in censuses], censuses, gpu, calibration, args)
        elif args.measure and not args.json:
            print(f"measured {name}: not measured (a tensor-parallel shape needs {tp} GPUs)")


if __name__ == "__main__":
    main()
