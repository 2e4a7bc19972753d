"""What one engine step would cost on a GPU, counted on CPU through the real engine path, and
projected onto a named GPU against that step's bandwidth and FLOP limit.

    python3 benchmarks/step_cost.py [--shapes qwen3-next-80b,...] [--gpu h200] [--quick] [--json]

For each model shape (real layer count, layer pattern, head counts, experts and top-k; tiny widths,
so it runs on CPU) and each step (decode at 1, 64 and 256 running sequences, one 4k-token prefill,
16 x 256-token prefills, a mixed step of 64 decodes and a 512-token prefill), an engine is brought to
the step with real CPU steps, and the step itself runs under `cairn.workers.execution.step_census.Census`: the
scheduler, the runner, the model with every kernel's Triton launcher (launch stubbed) and the
sampler, exactly as on CUDA. It prints kernel launches, host syncs, uploads and aten ops per
step, by phase and per layer kind, the ten busiest call sites, and the projection:

    limit     = max(bytes / bandwidth, FLOPs / peak)   (full-size shapes, bf16 weights and K/V,
                                                         fp32 states, 4k of context per sequence)
    projected = max(limit, launches x launch cost) + syncs x sync cost

Decode rows also print the projection with decode graphs (cairn.workers.execution.decode_graphs): the forward's
launches become one replay and a microsecond each on the device, the step's other launches stay
eager. A tensor-parallel shape counts one rank (its `shard_config`, collectives as launches) against
one GPU's limit for that rank's share (tensor-parallel engines run eager today: no graph column is
meant for them, it is printed for comparison). On a CUDA machine, `--measure` also times the step of a
full-size engine with random weights beside the projection (see gpu_check.sh).

This file computes no timing assertion; tests/workers/test_step_syncs.py asserts the sync counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the census needs compiled triton's host code
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from cairn.workers.engine import Engine  # noqa: E402
from cairn.workers.model.model_config import FULL, LINEAR, ModelConfig  # noqa: E402
from cairn.workers.model.family_registry import family_named  # noqa: E402
from cairn.workers.model.sharding import Shard, shard_config  # noqa: E402
from cairn.workers.engine_options import EngineOptions  # noqa: E402
from cairn.workers.sampling_params import SamplingParams  # noqa: E402
from cairn.workers.execution.step_census import Census, CensusGroup, Tally  # noqa: E402

CONTEXT = 4096  # tokens of context each decoding sequence is assumed to hold (the limit's K/V reads)


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


@dataclass(frozen=True)
class Step:
    name: str
    decodes: int  # sequences already running (one token each in the step)
    prefills: tuple[int, ...]  # prompt lengths prefilled in the step


STEPS = (Step("decode x1", 1, ()), Step("decode x64", 64, ()), Step("decode x256", 256, ()),
         Step("prefill 4k", 0, (4096,)), Step("prefill 16x256", 0, (256,) * 16),
         Step("mixed 64+512", 64, (512,)))
QUICK_STEPS = ("decode x64", "prefill 4k", "mixed 64+512")


def tiny(cfg: ModelConfig) -> ModelConfig:
    """The same model with tiny widths: every count the census makes is kept, the memory is not."""
    return replace(cfg, hidden_size=64, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                   intermediate_size=64, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                   vocab_size=1024, torch_dtype="bfloat16")


def build_engine(cfg: ModelConfig, tp: int, running: int, census: Census | None = None) -> Engine:
    """An engine over random bf16 weights of `cfg` (rank 0 of `tp`), room for `running` sequences."""
    torch.manual_seed(0)
    rank_cfg = shard_config(cfg, tp)
    group = CensusGroup(tp, census) if tp > 1 else None
    model = family_named(cfg.model_type).model_class(rank_cfg, Shard(0, tp), group)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model = model.to(torch.bfloat16).eval()
    options = EngineOptions(max_num_seqs=max(running, 1) + 1, max_num_batched_tokens=4096 + 512,
                            cache_memory_bytes=1536 * 2**20, device="cpu", dtype="bfloat16")
    return Engine(model, options)


def count_step(cfg: ModelConfig, tp: int, step: Step) -> tuple[Census, int]:
    """Brings a fresh engine to `step` with real CPU steps, then counts that step; returns the
    census and the number of recurrent-state checkpoints the step saved."""
    census = Census()
    engine = build_engine(tiny(cfg), tp, step.decodes + len(step.prefills), census)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    vocab = engine.config.vocab_size
    for _ in range(step.decodes):
        engine.add_request(torch.randint(0, vocab, (8,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()  # prefills, until every running sequence decodes
    for n in step.prefills:
        engine.add_request(torch.randint(0, vocab, (n,), generator=g).tolist(), params)
    prepared = engine.runner.prepare
    works = []
    engine.runner.prepare = lambda plan, all_logits=False: works.append(prepared(plan, all_logits)) or works[-1]
    with census:
        engine.step()
    return census, len(works[-1].checkpoint_targets)


# ---------------------------------------------------------------- the limit


def step_limit(cfg: ModelConfig, tp: int, step: Step, gpu: dict) -> dict:
    """Bytes, FLOPs and the limit of one rank's step at full size (bf16 weights and K/V, fp32 states)."""
    c = shard_config(cfg, tp)
    H, E, k = c.hidden_size, c.num_experts, c.num_experts_per_tok
    tokens = step.decodes + sum(step.prefills)
    seqs = step.decodes + len(step.prefills)
    attn = H * c.num_attention_heads * c.head_dim * 2 + 2 * H * c.num_key_value_heads * c.head_dim + \
        c.num_attention_heads * c.head_dim * H
    delta = H * (2 * c.key_dim + 2 * c.value_dim + 2 * c.linear_num_value_heads) + c.value_dim * H + \
        c.conv_dim * c.linear_conv_kernel_dim
    expert = 3 * H * c.moe_intermediate_size
    shared = 3 * H * c.shared_expert_intermediate_size + H + H * E  # shared expert, its gate, the router
    vocab_rows = -(-c.vocab_size // tp)
    n_att, n_lin = len(c.attention_layers), len(c.linear_layers)
    touched = E * (1 - (1 - k / E) ** tokens)  # distinct experts a layer's tokens reach
    weights = 2 * (n_att * attn + n_lin * delta + c.num_hidden_layers * (shared + touched * expert) + vocab_rows * H)
    kv_token = 2 * c.num_key_value_heads * c.head_dim * 2 * n_att  # K and V, all attention layers
    context = step.decodes * CONTEXT + sum(step.prefills)  # tokens of K/V read (prefill: once)
    kv = kv_token * (context + tokens)  # read, and the new tokens written
    state = n_lin * seqs * 2 * (c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4 +
                                c.conv_dim * (c.linear_conv_kernel_dim - 1) * 2)
    activations = tokens * c.num_hidden_layers * H * 2 * 16  # ~16 reads/writes of a row per layer
    moved = weights + kv + state + activations
    active = n_att * attn + n_lin * delta + c.num_hidden_layers * (shared + k * expert)
    flops = 2 * tokens * active + 2 * seqs * vocab_rows * H
    flops += 4 * n_att * c.num_attention_heads * c.head_dim * (
        step.decodes * CONTEXT + sum(n * n / 2 for n in step.prefills))
    flops += 4 * n_lin * tokens * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 2
    limit = max(moved / gpu["bandwidth"], flops / gpu["flops"])
    return dict(bytes=moved, flops=flops, limit_s=limit)


def project(census: Census, limit: dict, gpu: dict, graphed: bool) -> dict:
    """Eager: every launch costs the host `launch_us`; with a decode graph (`graphed`), the forward's
    launches are one replay plus `graph_node_us` each on the device, the rest of the step eager."""
    t = census.total()
    launch_s = t.launches * gpu["launch_us"] * 1e-6
    lo, hi = (max(limit["limit_s"], launch_s) + t.syncs * s * 1e-6 for s in gpu["sync_us"])
    out = dict(projected_s=(lo, hi), ratio=(lo / limit["limit_s"], hi / limit["limit_s"]))
    if graphed:
        inside = census.phases.get("forward", Tally()).launches
        graph_s = (GRAPH_LAUNCH_US + inside * gpu["graph_node_us"] + (t.launches - inside) * gpu["launch_us"]) * 1e-6
        g = max(limit["limit_s"], graph_s) + t.syncs * gpu["sync_us"][1] * 1e-6
        out.update(graph_s=g, graph_ratio=g / limit["limit_s"])
    return out


# ---------------------------------------------------------------- measured, on a GPU


def full_engine(cfg: ModelConfig, device: str, max_seqs: int) -> Engine:
    """An engine over random bf16 weights of `cfg` at full size on `device` (Qwen3.5-35B-A3B: about
    70 GB), decode graphs on where the device has them."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = family_named(cfg.model_type).model_class(cfg)
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for module in model.modules():  # the rotary frequencies are a buffer, not a weight
            if hasattr(module, "inv_freq"):
                module.inv_freq = type(module)(cfg).inv_freq.to(device)
    options = EngineOptions(max_num_seqs=max_seqs, max_num_batched_tokens=4096 + 512, max_model_len=8192,
                            cache_memory_bytes=24 * 2**30 if device == "cuda" else 2**30, device=device,
                            dtype="bfloat16")
    return Engine(model.eval(), options)


def measure(cfg: ModelConfig, device: str, steps: list[Step], repeat: int = 8) -> dict[str, float]:
    """Seconds per step of each `step` on a full-size engine, and decode tokens/s at 64 running."""
    engine = full_engine(cfg, device, max(s.decodes + len(s.prefills) for s in steps) + 1)
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    out = {}
    for step in steps:
        for request_id in list(engine._requests):  # the last step's sequences
            engine.abort(request_id)
        for _ in range(step.decodes):
            engine.add_request(torch.randint(0, cfg.vocab_size, (8,), generator=g).tolist(), params)
        while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
            engine.step()
        for _ in range(2):  # warm: the decode graph of this size, the allocator
            if not step.prefills:
                engine.step()
        times = []
        for _ in range(1 if step.prefills else repeat):
            for n in step.prefills:
                engine.add_request(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), params)
            began = time.perf_counter()
            engine.step()  # its sampled ids read back: the step is done
            times.append(time.perf_counter() - began)
        out[step.name] = sorted(times)[len(times) // 2]
    if "decode x64" in out:
        out["decode tokens/s at 64"] = 64 / out["decode x64"]
    return out


# ---------------------------------------------------------------- output


def report(name: str, cfg: ModelConfig, tp: int, step: Step, census: Census, checkpoints: int, gpu_name: str,
           gpu: dict) -> dict:
    t = census.total()
    limit = step_limit(cfg, tp, step, gpu)
    proj = project(census, limit, gpu, graphed=not step.prefills)
    layers = {kind: dict(layers=n, launches=tally.launches / n, syncs=tally.syncs / n)
              for kind, (n, tally) in census.per_layer_kind().items()}
    return dict(shape=name, step=step.name, tp=tp, checkpoints=checkpoints, launches=t.launches, syncs=t.syncs, uploads=t.uploads,
                aten_ops=t.ops, phases={p: vars(x) for p, x in census.phases.items()}, per_layer=layers,
                busiest_launches=census.busiest("launch"), busiest_syncs=census.busiest("sync"),
                gpu=gpu_name, **limit, **proj)


def print_row(r: dict) -> None:
    lo, hi = r["ratio"]
    forward = r["phases"].get("forward", {})
    per = ", ".join(f"{k} {v['launches']:.0f} launches/{v['syncs']:.0f} syncs per layer"
                    for k, v in sorted(r["per_layer"].items()))
    print(f"{r['shape']:<24}{r['step']:<16}{r['launches']:>9}{r['syncs']:>7}{forward.get('syncs', 0):>9}"
          f"{r['uploads']:>8}{r['aten_ops']:>9}{r['limit_s'] * 1e3:>10.3f}"
          f"{r['projected_s'][0] * 1e3:>10.2f}-{r['projected_s'][1] * 1e3:<8.2f}{lo:>6.1f}-{hi:<5.1f}x"
          + (f"{r['graph_s'] * 1e3:>10.2f}{r['graph_ratio']:>7.1f}x" if "graph_s" in r else ""))
    print(f"{'':<40}{per}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--steps", default=None, help="comma-separated step names (default: all)")
    parser.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_STEPS)}")
    parser.add_argument("--json", action="store_true", help="one JSON line per row, nothing else")
    parser.add_argument("--sites", action="store_true", help="print the ten busiest call sites of each row")
    parser.add_argument("--measure", action="store_true",
                        help="also time each step on a full-size engine with random bf16 weights (CUDA; on CPU "
                             "it needs --measure-device cpu and only proves the path at small shapes)")
    parser.add_argument("--measure-device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()
    gpu = GPUS[args.gpu]
    wanted = args.steps.split(",") if args.steps else (QUICK_STEPS if args.quick else [s.name for s in STEPS])
    steps = [s for s in STEPS if s.name in wanted]
    if not args.json:
        print(f"GPU {args.gpu}: {gpu['bandwidth'] / 1e12:.2f} TB/s, {gpu['flops'] / 1e12:.0f} TFLOP/s bf16, "
              f"{gpu['launch_us']} us a launch, {gpu['sync_us'][0]}-{gpu['sync_us'][1]} us a host sync; "
              f"{CONTEXT} tokens of context per decoding sequence; bf16 weights and K/V, fp32 states.")
        print("limit = max(bytes / bandwidth, FLOPs / peak); projected = max(limit, launches x launch cost) "
              "+ syncs x sync cost. Counted at tiny widths, real layers, heads, experts and top-k.")
        print(f"graph (decode steps): max(limit, {GRAPH_LAUNCH_US} us + forward launches x {gpu['graph_node_us']} us "
              f"+ the step's other launches x {gpu['launch_us']} us) + syncs x {gpu['sync_us'][1]} us.")
        print(f"{'shape':<24}{'step':<16}{'launches':>9}{'syncs':>7}{'in fwd':>9}{'uploads':>8}{'aten ops':>9}"
              f"{'limit ms':>10}{'projected ms':>19}{'ratio':>13}{'graph ms':>10}{'ratio':>8}")
    for name in args.shapes.split(","):
        cfg, tp = SHAPES[name]
        rows = []
        for step in steps:
            row = report(name, cfg, tp, step, *count_step(cfg, tp, step), args.gpu, gpu)
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            print_row(row)
            if args.sites:
                for what in ("launches", "syncs"):
                    for site, n in row[f"busiest_{what}"]:
                        print(f"{'':<44}{n:>8} {what:<9}{site}")
        if args.measure and tp == 1:
            if args.measure_device == "cuda" and not torch.cuda.is_available():
                sys.exit("--measure times a full-size engine on a CUDA device; none is here")
            full = cfg if args.measure_device == "cuda" else tiny(cfg)
            measured = measure(full, args.measure_device, steps)
            if args.measure_device == "cpu":
                print("(CPU at tiny widths: this proves the measuring path; its times are not the projection's)")
            for row in rows:
                took = measured[row["step"]]
                best = row.get("graph_s", row["projected_s"][0])
                print(f"measured {name:<22}{row['step']:<16}{took * 1e3:>9.2f} ms   projected {best * 1e3:.2f} ms   "
                      f"limit {row['limit_s'] * 1e3:.2f} ms   measured / limit {took / row['limit_s']:.1f}x")
            if "decode tokens/s at 64" in measured:
                print(f"measured {name}: {measured['decode tokens/s at 64']:.0f} output tokens/s at 64 running")


if __name__ == "__main__":
    main()
