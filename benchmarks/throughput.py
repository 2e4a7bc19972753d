"""Output tokens/s of cairn's engine against transformers' `generate`, measured in one run.

Workload: the `bench` demo model, prompts of 512 random tokens, 128 new tokens each (greedy,
EOS ignored so every request runs to length), measured for 1 request and for 32 concurrent
requests.

Baselines, both measured here, on the same machine, same model, same threads:
- transformers serving requests one at a time (`generate` per request: what a server without
  continuous batching does with 32 concurrent clients), and
- transformers' static batch (`generate` over all 32 prompts at once, equal lengths, no
  padding): its best case, which a server only gets when requests arrive together and are the
  same length.

Batched prefill: `--short` concurrent prompts of 32 tokens (default 64), one new token each, so
the steps are prefill: prompt tokens/s with every prefill segment of a step in one varlen call per
op (how the engine runs), against the same engine calling the varlen ops once per segment (how it
ran before: the baseline, patched in for this part of the run only). On CPU the torch references
loop over segments inside either way, so the ratio there is the Python and launch overhead saved;
on a GPU each varlen op is one Triton launch instead of one per segment.

Prints a table and the ratios; writes benchmarks/out/throughput.png. Not a test: nothing here
asserts timings.

Usage: python3 benchmarks/throughput.py [--concurrency 32] [--short 64] [--quick]
  --quick: the tiny demo model, 4 requests of 64 tokens, 16 new tokens each, one thread: checks
  that the script runs (its ratios say little about the bench model).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages

import torch  # noqa: E402

from cairn.workers import Engine, SamplingParams  # noqa: E402
from plotting import pyplot, save  # noqa: E402  (benchmarks/plotting.py)
from cairn.workers.demo import demo_model_dir  # noqa: E402


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # Stay clear of the special tokens at the top of the vocabulary.
    return [torch.randint(0, vocab - 16, (length,), generator=g).tolist() for _ in range(n)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cairn_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    outs: list = []
    seconds = timed(lambda: outs.extend(engine.generate(prompts, params)))
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return len(prompts) * new_tokens / seconds


@contextlib.contextmanager
def per_segment_prefill():
    """The engine's varlen prefill ops, called once per segment (the pre-batching launch pattern)."""
    from cairn import kernels
    originals = {name: getattr(kernels, name) for name in ("causal_conv1d_varlen", "chunk_gated_delta_rule_varlen")}

    def split(name):
        op = originals[name]

        def one_by_one(*args, **kwargs):
            x = args[0]
            cu, pool, slots = (args[2], args[3], args[4]) if name == "causal_conv1d_varlen" else args[5:8]
            plan = kwargs.pop("plan", None)  # the step's plan: its positions, not its tiles (each call makes its own)
            bounds, positions = cu.tolist(), kwargs.pop("state_positions", ()) or (plan.positions if plan else ())
            outs, states = [], []
            for b in range(len(bounds) - 1):
                rows = slice(bounds[b], bounds[b + 1])
                one_cu = torch.tensor([0, bounds[b + 1] - bounds[b]], dtype=cu.dtype, device=cu.device)
                if name == "causal_conv1d_varlen":
                    outs.append(op(x[rows], args[1], one_cu, pool, slots[b:b + 1]))
                else:
                    q, k, v, g, beta = (t[rows] for t in args[:5])
                    out, st = op(q, k, v, g, beta, one_cu, pool, slots[b:b + 1], **kwargs,
                                 state_positions=[positions[b]] if b < len(positions) else [])
                    outs.append(out)
                    states.append(st)
            if name == "causal_conv1d_varlen":
                return torch.cat(outs)
            return torch.cat(outs), torch.cat(states)
        return one_by_one

    for name in originals:
        setattr(kernels, name, split(name))
    try:
        yield
    finally:
        for name, op in originals.items():
            setattr(kernels, name, op)


def prefill_rate(engine: Engine, prompts: list[list[int]]) -> float:
    """Prompt tokens/s for `prompts` sent together, one output token each (nothing cached)."""
    engine.clear_cache()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    seconds = timed(lambda: engine.generate(prompts, params))
    return sum(len(p) for p in prompts) / seconds


def hf_generate(model, batch: torch.Tensor, new_tokens: int) -> None:
    with torch.no_grad():
        out = model.generate(batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    assert out.shape[1] == batch.shape[1] + new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--short", type=int, default=64, help="concurrent 32-token prompts for the prefill part")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--arch", default="qwen3_next", choices=("qwen3_next", "qwen3_5", "qwen3_5_moe"),
                        help="the demo model's architecture")
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 short requests, one thread")
    args = parser.parse_args()
    size = "bench"
    if args.quick:
        size, args.concurrency, args.prompt_len, args.new_tokens, args.threads = "tiny", 4, 64, 16, 1
        args.short = 8
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model_dir = demo_model_dir(size, args.arch)
    engine = Engine.from_pretrained(model_dir, max_num_seqs=max(args.concurrency, args.short, 1),
                                    max_num_batched_tokens=2048, warm_up=True)  # as a server's: compiled at load
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = make_prompts(args.concurrency, args.prompt_len, engine.spec.vocab_size)
    n, new = args.concurrency, args.new_tokens

    cairn_run(engine, prompts[:1], 4)  # warm-up (allocator, first-call costs) for both
    hf_generate(hf, torch.tensor(prompts[:1]), 4)

    rows = {}
    rows["cairn, 1 request"] = cairn_run(engine, prompts[:1], new)
    rows[f"cairn, {n} concurrent"] = cairn_run(engine, prompts, new)
    rows["transformers, 1 request"] = new / timed(lambda: hf_generate(hf, torch.tensor(prompts[:1]), new))
    seq_seconds = sum(timed(lambda p=p: hf_generate(hf, torch.tensor([p]), new)) for p in prompts)
    rows[f"transformers, {n} one at a time"] = n * new / seq_seconds
    rows[f"transformers, {n} static batch"] = n * new / timed(lambda: hf_generate(hf, torch.tensor(prompts), new))

    print(f"{size} demo model ({sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M params), "
          f"prompts {args.prompt_len} tokens, {new} new tokens, {args.threads} threads")
    for name, tps in rows.items():
        print(f"  {name:40s} {tps:8.1f} output tokens/s")
    short = make_prompts(args.short, 32, engine.spec.vocab_size)
    prefill_rate(engine, short[:2])  # warm-up
    batched = prefill_rate(engine, short)
    with per_segment_prefill():
        one_by_one = prefill_rate(engine, short)
    print(f"prefill of {args.short} concurrent 32-token prompts: batched {batched:8.1f} prompt tokens/s, "
          f"one call per segment {one_by_one:8.1f}")
    print(f"ratio batched prefill / one call per segment:          {batched / one_by_one:.2f}x")
    c1, cn = rows["cairn, 1 request"], rows[f"cairn, {n} concurrent"]
    print(f"ratio cairn/transformers, 1 request:                  {c1 / rows['transformers, 1 request']:.2f}x")
    print(f"ratio cairn {n} concurrent / transformers one at a time: "
          f"{cn / rows[f'transformers, {n} one at a time']:.2f}x")
    print(f"ratio cairn {n} concurrent / transformers static batch:  "
          f"{cn / rows[f'transformers, {n} static batch']:.2f}x")
    plot(rows)


def plot(rows: dict[str, float]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(rows)
    ax.barh(names, [rows[k] for k in names], color=["#2a7" if k.startswith("cairn") else "#888" for k in names])
    ax.set_xlabel("output tokens / s (higher is better)")
    ax.invert_yaxis()
    save(fig, "throughput.png", dpi=120)


if __name__ == "__main__":
    main()
