"""Speculative decoding with the MTP head against none, in the same run (CPU).

The model: the `bench` demo model trained for it (`cairn demo-model --size bench --mtp trained`:
the target trained a little on the demo corpus, the head on its greedy continuations; written
once under $CAIRN_HOME, minutes), or `--model DIR` (a checkpoint with `mtp.*` tensors). Prompts
are demo-corpus lines the head never saw (past the training lines).

1. Decode throughput: `--running` sequences (1, 4, 16) decode `--tokens` tokens each after a
   short prompt, greedy, with k = 0 (the baseline, this run), 1, 2, 3: output tokens per second
   of the decode phase (from the step after every prompt's prefill to the end; the engine's
   warm-up and one warm-up run of the same prompts first, in which the gate makes its first
   tries at this load; the median of REPEATS runs on the same engine, the engines of one load
   run in turn, round after round: `interleaved`), the ratio to k = 0, the
   share of steps that verified drafts, the acceptance rate (accepted / drafted), the mean
   acceptance length (1 + accepted / drafts) and the acceptance by position. Each k drafting
   every step ("always") and as the engine does by default ("adaptive": only while its measured
   tokens/s with drafts beat those without); for the best k, the exact mode (decode rows) too.
   Goals (issue 41): >= 1.6x at 1 running for the best k; no slowdown at 16 running with k = 1.
2. Sampled rows (at temperature 0.6 and 1.0, 4 running, k = 2 every step, exact mode): tokens/s
   against k = 0 and the acceptance, with the engine's drafts (drawn from the head's
   distribution by the row's rules: a seeded row's with the uniforms its verify rows draw with,
   an unseeded row's apart, kept by rejection sampling) and with the head's argmax instead;
   beside them, sum(min(p, q)) at the first drafts (what rejection sampling keeps), and how many
   seeded outputs equal k = 0's (all, by construction).
3. Divergence of the default mode from k = 0 in the served dtype (bf16 on a CPU with native
   bf16): how many sequences differ, where each first differs, and the k = 0 run's margin there
   (top-1 minus top-2 logprob: a near-tie flips); the exact mode's count beside it.
4. Multi-turn (benchmarks/multiturn.py's thinking-drop trace, recorded once, replayed with
   k = 0 and k = 2 in the exact mode, REPEATS times each, alternating, on fresh engines): every
   request's cached_tokens and output compared, and the median TTFT of each turn over the
   replays, k = 2 over k = 0 (the head's pass over a step's prompt positions runs when the next
   step begins: a first token waits for it only where a prompt's prefill took several steps).

Not a test: nothing is asserted. One run's numbers; CPU only (the GPU's verify-step cost is
benchmarks/step_cost.py's verify row).

    python3 benchmarks/speculative.py                 # bench, trained (the first run trains it)
    python3 benchmarks/speculative.py --quick         # tiny, trained: proves the path
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from cairn.workers import Engine, SamplingParams  # noqa: E402
from cairn.workers.demo import demo_model_dir  # noqa: E402
from cairn.workers.demo.corpus import training_corpus  # noqa: E402

REPEATS = 3  # decode runs per row (the median is printed); replays of the multi-turn trace per k
HELD_OUT = 4000  # corpus lines from here on: the training (cairn.workers.demo.speculative_training) read fewer
PROMPT = 16  # tokens of each prompt


def corpus_prompts(model_dir: Path, n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lines = training_corpus(HELD_OUT + 4 * n)[HELD_OUT:]
    prompts = [tokenizer.encode(line).ids[:PROMPT] for line in lines]
    return [p for p in prompts if len(p) == PROMPT][:n]


def decode_run(engine: Engine, prompts: list[list[int]], tokens: int, temperature: float = 0.0,
               outputs: dict | None = None, seeded: bool = True) -> tuple[float, int]:
    """(seconds of the decode phase, output tokens in it): from the first step after every
    prompt has its first token to the last. A sampled run (`temperature`) seeds prompt i with i
    (`seeded`); `outputs` gets each prompt's tokens."""
    ids = {engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=temperature, ignore_eos=True,
                                                seed=i if temperature and seeded else None)): i
           for i, p in enumerate(prompts)}
    seen: dict[str, int] = {}
    began, before = None, 0
    while engine.has_unfinished():
        if began is None and len(seen) == len(ids):
            began, before = time.perf_counter(), sum(seen.values())
        for out in engine.step():
            seen[out.request_id] = out.num_output_tokens
            if out.finished and outputs is not None:
                outputs[ids[out.request_id]] = out.token_ids
    return time.perf_counter() - began, sum(seen.values()) - before


def interleaved(engines: dict, prompts: list[list[int]], tokens: int, temperature: float = 0.0,
                outputs: dict | None = None, unseeded: tuple = ()) -> dict:
    """Each engine's decode runs, REPEATS rounds of one run each in turn (so a slow stretch of
    this shared machine falls on every engine alike): label -> (tokens/s of each run, output
    tokens in all). Each engine is warmed first (`Engine.warm_up`, as `cairn serve` does, and one
    run of the same prompts: the kernels at these shapes, and the gate's first tries at this
    load, made once per bucket of running sequences on a server), its counts then reset. A
    sampled run: `decode_run`'s `temperature` (the engines labelled in `unseeded` without
    seeds); `outputs` gets label -> each prompt's tokens."""
    for engine in engines.values():
        engine.warm_up()
        decode_run(engine, prompts, 32)
        engine.speculation.__init__()
    runs = {label: ([], 0) for label in engines}
    for _ in range(REPEATS):
        for label, engine in engines.items():  # the same engine each round (its gate keeps what it learned)
            seconds, made = decode_run(engine, prompts, tokens, temperature,
                                       None if outputs is None else outputs.setdefault(label, {}),
                                       seeded=label not in unseeded)
            rates, out = runs[label]
            runs[label] = (rates + [made / seconds], out + made)
    return runs


def throughput(model_dir: Path, running: list[int], ks: list[int], tokens: int) -> None:
    print(f"\n== decode throughput: {tokens} tokens a sequence after {PROMPT}-token prompts, greedy ==")
    print("modes: always = drafts every step; adaptive = the engine's default (drafts only while its measured "
          "tokens/s with them beat those without); exact = adaptive, verified as decode rows (its ratio against "
          "k = 0 measured again beside it)")
    print(f"{'running':>7} {'k':>2} {'mode':>8} {'tok/s':>9} {'x k=0':>6} {'drafted':>8} {'accept':>7} {'mean len':>8}"
          f"  by position")

    def engine(n: int, k: int, mode: str) -> Engine:
        return Engine.from_pretrained(model_dir, max_num_seqs=max(n, 1), num_pages=4096, num_speculative_tokens=k,
                                      speculative_exact=mode == "exact", speculative_adaptive=mode != "always")

    def row(n: int, k: int, mode: str, e: Engine, rates: list[float], out: int, base: float) -> None:
        rate, s = statistics.median(rates), e.speculation
        # a sequence's step gives 1 + its accepted tokens: steps = tokens - accepted
        drafted = f"{s.drafts / max(1, out - s.accepted_tokens):.2f}" if k else "-"
        accept = f"{s.accepted_tokens / s.draft_tokens:.2f}" if s.draft_tokens else "-"
        mean = f"{s.mean_acceptance_length:.2f}" if s.drafts else "-"
        positions = " ".join(f"{a / s.drafts:.2f}" for a in s.accepted_by_position[:k]) if s.drafts else ""
        print(f"{n:>7} {k:>2} {mode:>8} {rate:>9.1f} {rate / base:>6.2f} {drafted:>8} {accept:>7} {mean:>8}"
              f"  {positions}")

    for n in running:
        prompts = corpus_prompts(model_dir, n)
        rows = [(0, "always")] + [(k, mode) for k in ks if k for mode in ("always", "adaptive")]
        engines = {(k, mode): engine(n, k, mode) for k, mode in rows}
        runs = interleaved(engines, prompts, tokens)
        base = statistics.median(runs[0, "always"][0])
        for (k, mode), (rates, out) in runs.items():
            row(n, k, mode, engines[k, mode], rates, out, base)
        best = max((k for k, mode in rows if k and mode == "always"),
                   key=lambda k: statistics.median(runs[k, "always"][0]), default=0)
        if best:
            pair = {(0, "always"): engine(n, 0, "always"), (best, "exact"): engine(n, best, "exact")}
            again = interleaved(pair, prompts, tokens)
            row(n, best, "exact", pair[best, "exact"], *again[best, "exact"], statistics.median(again[0, "always"][0]))


def overlap_probe(engine: Engine, temperature: float) -> list[float]:
    """Fills a list, for each first draft the engine verifies, with sum(min(p, q)) there: p the
    target's distribution, q the head's, both at `temperature` (no other rule applies in these
    runs): the rate at which rejection sampling with drafts drawn from q would keep it."""
    heads, overlaps = {}, []
    draft_tokens, sample = engine.sampler.draft_tokens, engine.sampler.sample

    def drafting(logits, seqs, drafts):
        for row, (seq, drafted) in enumerate(zip(seqs, drafts)):
            if not drafted:
                heads[seq.request_id, len(seq.output_token_ids)] = torch.softmax(logits[row].float() / temperature, -1)
        return draft_tokens(logits, seqs, drafts)

    def sampling(logits, seqs, offsets=None):
        for row, (seq, offset) in enumerate(zip(seqs, offsets or [0] * len(seqs))):
            q = heads.pop((seq.request_id, len(seq.output_token_ids)), None) if offset == 0 else None
            if q is not None and seq.draft:
                overlaps.append(float(torch.minimum(torch.softmax(logits[row].float() / temperature, -1), q).sum()))
        return sample(logits, seqs, offsets)
    engine.sampler.draft_tokens, engine.sampler.sample = drafting, sampling
    return overlaps


def sampled(model_dir: Path, n: int, k: int, temperatures: list[float], tokens: int) -> None:
    print(f"\n== sampled rows: {n} running, k = {k} drafting every step (exact mode) ==")
    print("drafts drawn from the head's distribution by the row's rules: shared = seeded rows, with the uniforms "
          "their verify rows draw with (outputs k = 0's); rejection = unseeded rows, drawn apart and kept by "
          "rejection sampling; argmax = seeded rows, the head's most likely token")
    print("(sum min) = the mean of sum(min(p, q)) at the first drafts: what rejection sampling keeps there")
    print(f"{'temp':>5} {'drafts':>9} {'tok/s':>9} {'x k=0':>6} {'accept':>7} {'mean len':>8}  by position "
          f"(sum min); outputs equal to k = 0's")
    prompts = corpus_prompts(model_dir, n)
    for temperature in temperatures:
        names = ("k=0", "shared", "rejection", "argmax")
        engines = {name: Engine.from_pretrained(model_dir, max_num_seqs=n, num_pages=4096, speculative_exact=True,
                                                num_speculative_tokens=0 if name == "k=0" else k,
                                                speculative_adaptive=False) for name in names}
        engines["argmax"].drafter.pick = None
        overlaps = {name: overlap_probe(engines[name], temperature) for name in ("shared", "rejection")}
        outputs: dict = {}
        runs = interleaved(engines, prompts, tokens, temperature, outputs, unseeded=("rejection",))
        base = statistics.median(runs["k=0"][0])
        for name, (rates, _) in runs.items():
            rate, s = statistics.median(rates), engines[name].speculation
            accept = f"{s.accepted_tokens / s.draft_tokens:.2f}" if s.draft_tokens else "-"
            mean = f"{s.mean_acceptance_length:.2f}" if s.drafts else "-"
            positions = " ".join(f"{a / s.drafts:.2f}" for a in s.accepted_by_position[:k]) if s.drafts else ""
            same = "-" if name == "rejection" else \
                f"{sum(outputs[name][i] == outputs['k=0'][i] for i in outputs['k=0'])}/{len(outputs['k=0'])}"
            overlap = f" ({statistics.mean(overlaps[name]):.2f})" if overlaps.get(name) else ""
            print(f"{temperature:>5} {name:>9} {rate:>9.1f} {rate / base:>6.2f} {accept:>7} {mean:>8}  {positions}"
                  f"{overlap}; {same}")


def divergence(model_dir: Path, n: int, tokens: int) -> None:
    print(f"\n== default mode against k = 0, served dtype: {n} sequences x {tokens} tokens, greedy, k = 2 ==")
    prompts = corpus_prompts(model_dir, n)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=2)
    runs = {}
    for name, options in (("k=0", dict()), ("default", dict(num_speculative_tokens=2)),
                          ("exact", dict(num_speculative_tokens=2, speculative_exact=True))):
        engine = Engine.from_pretrained(model_dir, max_num_seqs=16, num_pages=4096, **options)
        runs[name] = engine.generate(prompts, params)
        dtype = engine.options.dtype
    print(f"dtype {dtype}")
    for name in ("default", "exact"):
        firsts, margins, largest = [], [], 0.0
        for ref, got in zip(runs["k=0"], runs[name]):
            same = [a == b for a, b in zip(ref.token_ids, got.token_ids)]
            agreed = same.index(False) if False in same else len(same)
            for a, b in zip(ref.logprobs[:agreed], got.logprobs[:agreed]):
                largest = max(largest, abs(a.logprob - b.logprob))
            if agreed < len(same):
                firsts.append(agreed)
                top = ref.logprobs[agreed].top
                margins.append(top[0][1] - top[1][1] if len(top) > 1 else float("nan"))
        print(f"{name:>7}: {len(firsts)} of {n} sequences differ; largest logprob difference before any "
              f"difference {largest:.2e}" + (f"; first differing token at {sorted(firsts)}; k = 0's top-2 margin "
                                              f"there {[round(m, 4) for m in margins]}" if firsts else ""))


def multiturn(model_dir: Path, convs: int, turns: int, tokens: int) -> None:
    from multiturn import Client, record_trace

    print(f"\n== multi-turn (thinking-drop), {convs} conversations x {turns} turns: k = 2 (exact) against k = 0 ==")
    client = Client(model_dir)
    options = dict(max_num_seqs=convs, num_pages=4096)
    rounds = record_trace(Engine.from_pretrained(model_dir, **options), client, "thinking-drop", convs, turns,
                          system_words=60, user_words=30, answer_tokens=tokens)
    runs = {0: [], 2: []}  # per k, each replay's (cached_tokens, outputs) by (conversation, turn)
    ttft = {0: {}, 2: {}}  # per k, per turn, every replay's TTFTs
    for k in (0, 2) * REPEATS:  # alternating, a fresh engine each time: one step's time is noisy here
        engine = Engine.from_pretrained(model_dir, num_speculative_tokens=k, speculative_exact=True, **options)
        engine.warm_up()
        cached, outputs = {}, {}
        for reqs in rounds:
            sent = time.perf_counter()
            ids = {engine.add_request(r.prompt, SamplingParams(max_tokens=r.output_len, temperature=0,
                                                               ignore_eos=True), checkpoint_hints=r.hints): r
                   for r in reqs}
            first = {}
            while engine.has_unfinished():
                for out in engine.step():
                    first.setdefault(out.request_id, time.perf_counter() - sent)
                    if out.finished:
                        r = ids[out.request_id]
                        cached[(r.conv, r.turn)], outputs[(r.conv, r.turn)] = out.cached_tokens, out.token_ids
            for rid, r in ids.items():
                ttft[k].setdefault(r.turn, []).append(first[rid])
        runs[k].append((cached, outputs))
    (c0, o0) = runs[0][0]
    print(f"identical with k = 0: cached_tokens {all(c == c0 for c, _ in runs[0] + runs[2])}, outputs "
          f"{all(o == o0 for _, o in runs[0] + runs[2])} ({len(c0)} requests x {REPEATS} replays, "
          f"{sum(c0.values())} cached tokens in each)")
    t0, t2 = ttft[0], ttft[2]
    print("median TTFT per turn, k = 2 / k = 0: " +
          ", ".join(f"{turn}: {statistics.median(t2[turn]) / statistics.median(t0[turn]):.2f}" for turn in sorted(t0)))

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint with an MTP head (default: the "
                                                                 "trained bench demo model)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="the tiny trained demo model, fewer of everything")
    args = parser.parse_args()
    if args.quick:
        model = args.model or demo_model_dir("tiny", trained_mtp=True)
        throughput(model, [1, 4], [0, 2], 24)
        sampled(model, 4, 2, [1.0], 16)
        divergence(model, 4, 16)
        multiturn(model, 2, 2, 12)
        return
    model = args.model or demo_model_dir("bench", trained_mtp=True)
    print(f"model: {model}")
    throughput(model, [1, 4, 16], [0, 1, 2, 3], args.tokens)
    sampled(model, 4, 2, [0.6, 1.0], args.tokens)
    divergence(model, 16, args.tokens)
    multiturn(model, 8, 4, 48)


if __name__ == "__main__":
    main()
