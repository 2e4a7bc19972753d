"""Tensor parallelism: what the ranks exchange per step, and tokens/s at TP 1 and TP 2.

Workload: the `bench` demo model of `--arch` (8 query heads over 2 K/V heads, 4 key heads, so it
splits 1, 2 and 4 ways), `--seqs` concurrent requests of `--prompt-len` random tokens, greedy,
`--new-tokens` each.

Printed, for TP 1, 2 and 4 (from rank 0's collective counters, `cairn.workers.execution.tp_group.Counters`):
- collectives per decode step and the bytes each rank puts into its all-reduces per decode
  token, against the goal the design sets: one all-reduce of the hidden state after every
  mixer and every MLP, i.e. 2 x layers x hidden x dtype bytes per token, which a ring all-reduce
  moves as 2 x (N-1)/N of it per rank. cairn adds one all-reduce for the vocab-parallel embedding
  and one all-gather of the sampled rows' logits (vocab / N x 4 bytes per rank): both printed.
- decode tokens/s at TP 1 and TP 2, the baseline being TP 1 in the same run. On this CPU the
  ranks share 2 cores, so TP 2 cannot be faster here; the number checks the machinery's cost,
  not the speed-up a GPU pair gives.
The same table at Qwen3-Next-80B shapes needs a machine with 4 GPUs; it is not written yet (the
GPU machine this project borrows has one GPU).

Usage: python3 benchmarks/tensor_parallel.py [--arch qwen3_next] [--seqs 8] [--quick]
  --quick: the tiny demo model (TP 1 and 2 only), 2 requests, 8 new tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages

import torch  # noqa: E402

from cairn.workers import Engine, SamplingParams  # noqa: E402
from cairn.workers.demo import demo_model_dir  # noqa: E402


def run(model_dir: Path, tp: int, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    engine = Engine.from_pretrained(model_dir, tensor_parallel_size=tp, max_num_seqs=len(prompts),
                                    max_num_batched_tokens=4096)
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        waiting = {engine.add_request(p, params) for p in prompts}
        while waiting:  # prefill until every request has its first token: decode is what is measured
            waiting -= {o.request_id for o in engine.step()}
        group = engine.model.group
        before = (group.counters.all_reduces, group.counters.all_reduce_bytes, group.counters.all_gathers,
                  group.counters.all_gather_bytes) if group else (0, 0, 0, 0)
        steps, tokens, start = 0, 0, time.perf_counter()
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            steps += 1
        seconds = time.perf_counter() - start
        after = (group.counters.all_reduces, group.counters.all_reduce_bytes, group.counters.all_gathers,
                 group.counters.all_gather_bytes) if group else (0, 0, 0, 0)
        d = [a - b for a, b in zip(after, before)]
        cfg = engine.config
        return dict(steps=steps, tokens=tokens, seconds=seconds, reduces_per_step=d[0] / steps,
                    reduce_bytes_per_token=d[1] / tokens, gathers_per_step=d[2] / steps,
                    gather_bytes_per_token=d[3] / tokens, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
                    dtype_bytes=next(engine.model.parameters()).element_size())
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen3_next", choices=("qwen3_next", "qwen3_5", "qwen3_5_moe"))
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="tiny model, TP 1 and 2, 2 requests, 8 new tokens")
    args = parser.parse_args()
    size, sizes = "bench", (1, 2, 4)
    if args.quick:
        size, sizes, args.seqs, args.prompt_len, args.new_tokens = "tiny", (1, 2), 2, 32, 8
    torch.set_num_threads(1)
    model_dir = demo_model_dir(size, args.arch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 400, (args.prompt_len,), generator=g).tolist() for _ in range(args.seqs)]
    rows = {tp: run(model_dir, tp, prompts, args.new_tokens) for tp in sizes}
    print(f"model: {size} {args.arch} demo; {args.seqs} sequences decoding, {args.new_tokens} new tokens each; "
          f"ranks on 2 shared CPU cores (gloo)")
    print(f"{'TP':>3} {'all-reduces/step':>17} {'bytes/token/rank':>17} {'goal bytes':>11} {'ratio':>6} "
          f"{'ring traffic':>13} {'logit gathers/step':>19} {'gather B/token':>15} {'tok/s':>8}")
    base = rows[1]["tokens"] / rows[1]["seconds"]
    for tp, r in rows.items():
        goal = 2 * r["layers"] * r["hidden"] * r["dtype_bytes"]
        ours = r["reduce_bytes_per_token"]
        ring = ours * 2 * (tp - 1) / tp
        print(f"{tp:>3} {r['reduces_per_step']:>17.1f} {ours:>17.0f} {goal if tp > 1 else 0:>11.0f} "
              f"{(ours / goal if tp > 1 else 0):>6.3f} {ring:>13.0f} {r['gathers_per_step']:>19.1f} "
              f"{r['gather_bytes_per_token']:>15.0f} {r['tokens'] / r['seconds']:>8.1f}")
    for tp, r in rows.items():
        if tp > 1:
            print(f"ratio decode tokens/s TP {tp} / TP 1: {r['tokens'] / r['seconds'] / base:.2f}x "
                  f"(2 shared cores: not a speed-up measurement)")


if __name__ == "__main__":
    main()
