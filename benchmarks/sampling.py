"""Per-step sampling time: the batched sampler (cairn/workers/sampler.py) against a per-row sampler,
measured in the same run, at 1, 64 and 256 rows and vocabularies of 151,936 (Qwen3-Next) and
248,320 (Qwen3.5).

The per-row baseline is the sampler cairn had before the batched one: the logits go to the host,
and a Python loop draws each row (temperature, then top-k by `topk`, top-p by a full sort, then
`multinomial`); for the settings it did not have (min-p, penalties) the same loop applies them
row by row, plainly. It is timed on at most 8 rows and scaled to the batch (it is linear in
rows; printed as such). The batched sampler is timed on every row, the minimum of 3 runs.

Logits: a Zipf-like head, logit = -1.2 ln(rank) plus N(0, 0.5) noise, in a random order per row
(a trained model's distributions are peaked like this; top-p 0.95 keeps a few thousand tokens).
Penalised rows carry 64 output tokens. The JSON-schema setting (temperature 0.7 with a grammar,
cairn.workers.grammar) needs a tokenizer of the vocabulary: the peer model's (Qwen2's, 151,936; written by
benchmarks/peers_setup.sh under $CAIRN_PEERS), else it is skipped with the reason; both paths
compute the mask with the same llguidance matcher (the per-row one unpacks and applies it row by
row). Goal on CPU: the batched sampler at 256 rows >= 10x
faster than the per-row path for every setting, except where that path is already under 1 ms.
Not a test: nothing here asserts.

Usage: python3 benchmarks/sampling.py [--quick]   (--quick: 256 rows, the smaller vocabulary)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cairn.workers import SamplingParams  # noqa: E402
from cairn.workers.grammar import Grammar, Grammars, LLGuidance  # noqa: E402
from cairn.kernels.sample.torch_ops import unpack_bitmask  # noqa: E402
from cairn.workers.sampler import Sampler  # noqa: E402
from cairn.workers.sequence import Sequence  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "top-k 20": dict(temperature=0.7, top_k=20),
    "top-p 0.95": dict(temperature=0.7, top_p=0.95),
    "top-k 20 + top-p 0.8": dict(temperature=0.7, top_k=20, top_p=0.8),
    "min-p 0.05": dict(temperature=0.7, min_p=0.05),
    "penalties": dict(temperature=0.7, presence_penalty=1.5, frequency_penalty=0.3, repetition_penalty=1.1),
}
BASELINE_ROWS = 8
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age"]}


def json_grammars(vocab: int) -> tuple[Grammars | None, str]:
    """Grammars over a tokenizer of `vocab` tokens, or None and why."""
    path = Path(os.environ.get("CAIRN_PEERS") or Path.home() / ".cache" / "cairn-peers") / "peer-bench" / "tokenizer.json"
    if vocab != 151936 or not path.exists():
        return None, f"no tokenizer of {vocab} tokens here" + ("" if vocab != 151936 else " (peers_setup.sh)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return Grammars(LLGuidance(tok.to_str(), vocab, (tok.token_to_id("<|im_end|>"),)), vocab), ""


def zipf_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    head = -1.2 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    noise = torch.randn(rows, vocab, generator=g) * 0.5
    order = torch.argsort(torch.rand(rows, vocab, generator=g), dim=-1)
    return head[order] + noise


def sequences(rows: int, params: SamplingParams, vocab: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(rows):
        s = Sequence(f"r{i}", torch.randint(0, vocab, (256,), generator=g).tolist(), params)
        if params.penalised:
            s.token_ids.extend(torch.randint(0, vocab, (64,), generator=g).tolist())
        out.append(s)
    return out


def per_row(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The per-row path: to the host, then one row at a time."""
    if all(s.params.greedy and not s.params.penalised for s in seqs):  # it took one argmax for these
        return torch.argmax(logits, dim=-1).tolist()
    logits = logits.float().cpu()
    out = []
    for row, seq in zip(logits, seqs):
        p = seq.params
        if p.penalised:
            row = row.clone()
            outputs = torch.tensor(seq.output_token_ids, dtype=torch.long)
            counts = torch.bincount(outputs, minlength=row.numel()).float()
            seen = counts > 0
            seen_any = seen.clone()
            seen_any[torch.tensor(seq.prompt_token_ids)] = True
            row = torch.where(seen_any, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty),
                              row) - p.frequency_penalty * counts - p.presence_penalty * seen
        if p.grammar is not None:
            words = torch.from_numpy(seq.grammar_words)[None]
            row = row.masked_fill(~unpack_bitmask(words, row.numel())[0], float("-inf"))
        if p.greedy:
            out.append(int(torch.argmax(row)))
            continue
        scaled = row / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            drop = torch.cumsum(sorted_probs, dim=0) - sorted_probs >= p.top_p * sorted_probs.sum()
            drop[0] = False
            probs = probs.scatter(0, order[drop], 0.0)
        out.append(int(torch.multinomial(probs, 1)))
    return out


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    vocabs, row_counts = ([151936], [256]) if args.quick else ([151936, 248320], [1, 64, 256])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; per-row path timed on "
          f"<= {BASELINE_ROWS} rows and scaled linearly; batched: min of 3 runs")
    print(f"{'vocab':>7} {'rows':>5} {'setting':<22} {'per-row ms':>11} {'batched ms':>11} {'speed-up':>9}")
    for vocab in vocabs:
        for rows in row_counts:
            logits = zipf_logits(rows, vocab)
            for name, kw in SETTINGS.items():
                params = SamplingParams(max_tokens=512, **kw)
                seqs = sequences(rows, params, vocab)
                sampler = Sampler(0)
                sampler.sample(logits.clone(), seqs)  # fills the penalty rows once, as the first step does
                batched = timed(lambda: sampler.sample(logits.clone(), seqs), 3)
                batched -= timed(lambda: logits.clone(), 3)  # the copy is the benchmark's, not the sampler's
                few = min(rows, BASELINE_ROWS)
                baseline = timed(lambda: per_row(logits[:few], seqs[:few]), 1) * rows / few
                print(f"{vocab:>7} {rows:>5} {name:<22} {baseline * 1e3:>11.1f} {batched * 1e3:>11.1f} "
                      f"{baseline / max(batched, 1e-9):>8.1f}x", flush=True)
            json_bitmask(vocab, rows, logits)


def json_bitmask(vocab: int, rows: int, logits: torch.Tensor) -> None:
    import llguidance

    grammars, why = json_grammars(vocab)
    if grammars is None:
        print(f"{vocab:>7} {rows:>5} {'json-schema bitmask':<22} skipped: {why}")
        return
    grammar = Grammar(llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    grammars.prepare(grammar).result()
    seqs = sequences(rows, SamplingParams(max_tokens=512, temperature=0.7, grammar=grammar), vocab)
    sampler = Sampler(0)
    sampler.grammars = grammars
    sampler.sample(logits.clone(), seqs)
    batched = timed(lambda: sampler.sample(logits.clone(), seqs), 3) - timed(lambda: logits.clone(), 3)
    few = min(rows, BASELINE_ROWS)

    def baseline() -> None:
        for s in seqs[:few]:  # the same matcher fills the mask; the loop applies it row by row
            s.grammar_words = grammars.mask(s)
        per_row(logits[:few], seqs[:few])

    base = timed(baseline, 1) * rows / few
    print(f"{vocab:>7} {rows:>5} {'json-schema bitmask':<22} {base * 1e3:>11.1f} {batched * 1e3:>11.1f} "
          f"{base / max(batched, 1e-9):>8.1f}x", flush=True)


if __name__ == "__main__":
    main()
