"""Multi-turn chats with images: cached tokens against the oracle, TTFT, and the vision tower's runs.

The workload, on `cairn demo-model --arch qwen3_5 --vision` (size bench, 64 tokens an image; tiny
with --quick): `--convs` conversations share a system prompt; each sends an image in turn 1 and a
new one every `--image-every` turns after it, with a question; the model's answers are fed back
as a client would (the demo template drops earlier turns' thinking, so each prompt parts from the
previous one inside its generation prompt). All conversations are open at once and advance turn
by turn. Each image is a random PNG, preprocessed as the server does; two conversations never
send the same image, and every image has as many tokens as every other (the same size), so a
cache keyed by token ids alone would hit across images.

The oracle hit of a request is its longest common prefix, to the token, with everything seen
before it, with image tokens keyed by content (cairn.workers.vision.image_input): what a cache
with unlimited memory and a state at every token could resume. Printed per run: hit tokens /
oracle, requests more than 2 tokens short, the last turn's median TTFT, and how many images the
tower encoded of those sent. Runs, in one process, on the same recorded trace: `cold` (each
request under its own cache salt: the baseline every ratio is against), `cairn` with memory to
spare, and under a device budget of `--device-budget` times what the spare run's cache used,
without the host tier and with one of `--host-budget` times the device budget.
Then the trace again with image hashes in the page hashes and left out of them (image tokens keyed
by their ids alone): how many requests resume past a picture they did not send, and how many
answer otherwise than a cold run. Last, the tower's time on one 448x448 and one 1344x1344 image at
the published pixel bounds (the demo tower: tiny, so these time cairn's tower code at those
shapes, not a published checkpoint's).
Not a test: nothing is asserted. vLLM is not run: its CPU wheel does not load this demo model's
vision-language layout here; its figure on hybrid models, for the record: 0 prefix hits once a
conversation carries an image (vllm#43587).

Usage: python3 benchmarks/multimodal.py [--convs 6] [--turns 5] [--image-every 2]
                                       [--device-budget 0.25 --host-budget 2] [--quick]
  --quick: the tiny vision demo, 2 conversations, 3 turns: checks that the script runs.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from cairn.cluster.api.chat_template import ChatTemplate  # noqa: E402
from cairn.workers import Engine, SamplingParams  # noqa: E402
from cairn.workers.demo import write_demo_model  # noqa: E402
from cairn.workers.request import GenerateRequest  # noqa: E402
from cairn.cluster.api.image_sources import ImageSources  # noqa: E402
from cairn.cluster.api.prompt_images import PromptImages  # noqa: E402
from cairn.workers.vision.image_input import ImageInput, image_input  # noqa: E402
from cairn.workers.vision.vision_config import load_vision_config  # noqa: E402
from cairn.workers.vision.image_processing import load_preprocessor_config, preprocess_image  # noqa: E402
from traces import MULTITURN_WORDS, Oracle, sentence  # noqa: E402  (benchmarks/traces.py)


@dataclass
class Request:
    conv: int
    turn: int
    prompt: list[int]
    images: list[ImageInput]
    hints: list[int]
    keys: list[int]
    oracle: int = 0


def vision_demo(size: str) -> Path:
    home = Path(os.environ.get("CAIRN_HOME") or Path.home() / ".cache" / "cairn")
    out = home / f"demo-qwen3_5-{size}-vision"
    if not (out / "model.safetensors").exists():
        write_demo_model(out, size=size, arch="qwen3_5", vision=True)
    return out


def png(rng: np.random.Generator, side: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray((rng.random((side, side, 3)) * 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


class Client:
    """Renders a chat as the ingress does: the template, then each image's pad token expanded and
    the hints past it moved (the ingress's own `PromptImages.place` and `keys`)."""

    def __init__(self, model_dir: Path):
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.template = ChatTemplate.from_dir(model_dir)
        self.preprocessor = load_preprocessor_config(model_dir)
        self.images = PromptImages(load_vision_config(model_dir), self.preprocessor, ImageSources(), 10**8)

    def encode(self, messages: list[dict], images: list) -> tuple[list[int], list[ImageInput], list[int], list[int]]:
        """(ids, their ImageInputs, hints, cache keys)."""
        text, starts = self.template.message_starts(messages)
        enc = self.tok.encode(text, add_special_tokens=False)
        ends = [e for _, e in enc.offsets]
        hints = [sum(1 for e in ends if e <= c) for c in starts]
        ids, hints, inputs = self.images.place(enc.ids, hints, [("", image) for image in images])
        return ids, inputs, hints, self.images.keys(ids, inputs)


def record(engine: Engine, client: Client, convs: int, turns: int, every: int, answer: int, side: int
           ) -> list[list[Request]]:
    rng, words = np.random.default_rng(0), torch.Generator().manual_seed(1)
    system = {"role": "system", "content": " ".join(sentence(words, 12, MULTITURN_WORDS) for _ in range(8))}
    messages, images = [[system] for _ in range(convs)], [[] for _ in range(convs)]
    oracle, rounds = Oracle(page_tokens=1), []
    params = SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
    for turn in range(1, turns + 1):
        reqs = []
        for c in range(convs):
            content = [{"type": "text", "text": sentence(words, 10, MULTITURN_WORDS)}]
            if (turn - 1) % every == 0:
                images[c].append(preprocess_image(png(rng, side), client.preprocessor, max_source_pixels=10**8))
                content.insert(0, {"type": "image"})
            messages[c].append({"role": "user", "content": content})
            ids, inputs, hints, keys = client.encode(messages[c], images[c])
            reqs.append(Request(c, turn, ids, inputs, hints, keys, oracle.hit_tokens(keys)))
        outs = run(engine, reqs, params, "record")[0]
        for r in reqs:
            out = outs[(r.conv, r.turn)]
            messages[r.conv].append({"role": "assistant", "content": client.tok.decode(out, skip_special_tokens=True)})
            oracle.insert(r.keys + out)
        rounds.append(reqs)
    return rounds


def run(engine: Engine, reqs: list[Request], params: SamplingParams, salt: str | None):
    """One round at once; (outputs by (conv, turn), cached by (conv, turn), TTFT by (conv, turn))."""
    ids, first, outs, cached = {}, {}, {}, {}
    if salt == "cold":  # nothing kept: not even the tower's outputs
        engine.runner.encoder.clear()
    sent = time.perf_counter()
    for r in reqs:
        rid = f"{salt}-{r.conv}-{r.turn}"
        root = engine.spec.hash_root(f"{salt}-{r.conv}-{r.turn}") if salt == "cold" else None
        engine.add(GenerateRequest(rid, r.prompt, params, images=r.images, checkpoint_hints=r.hints, hash_root=root))
        ids[rid] = (r.conv, r.turn)
    while engine.has_unfinished():
        for out in engine.step():
            key = ids[out.request_id]
            first.setdefault(key, time.perf_counter() - sent)
            if out.finished:
                outs[key], cached[key] = out.token_ids, out.cached_tokens
    return outs, cached, first


def replay(engine: Engine, rounds: list[list[Request]], answer: int, salt: str) -> dict:
    params = SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
    hit = oracle = short = 0
    ttft: list[float] = []
    short_turns: list[int] = []
    for reqs in rounds:
        _, cached, first = run(engine, reqs, params, salt)
        for r in reqs:
            got = cached[(r.conv, r.turn)]
            hit, oracle, short = hit + got, oracle + r.oracle, short + (r.oracle - got > 2)
            short_turns += [r.turn] * (r.oracle - got > 2)
        ttft = list(first.values())
    encoder = engine.runner.encoder
    sent = sum(len({i.content_hash for i in r.images}) for reqs in rounds for r in reqs)
    return dict(hit=hit, oracle=oracle, short=short, short_turns=short_turns, ttft=statistics.median(ttft),
                encoded=encoder.encoded,
                sent=sent, used=engine.cache.used_bytes)


def mismatches(engine: Engine, rounds: list[list[Request]], answer: int, right: dict, keyed: bool) -> dict:
    """The trace again, image tokens keyed by content or (not `keyed`) by their ids alone, what a
    cache that leaves image hashes out of its page hashes does: resumes past what a request shares
    with anything seen (a picture it did not send), and answers unlike a cold run's (`right`)."""
    import cairn.workers.engine_intake as intake

    by_content = intake.prompt_keys
    if not keyed:
        intake.prompt_keys = lambda prompt, images, merge: list(prompt)
    try:
        params = SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
        wrong = differ = 0
        for reqs in rounds:
            outs, cached, _ = run(engine, reqs, params, "keyless")
            for r in reqs:
                wrong += cached[(r.conv, r.turn)] > r.oracle  # resumed past what it shares with anything seen
                differ += outs[(r.conv, r.turn)] != right[(r.conv, r.turn)]
    finally:
        intake.prompt_keys = by_content
    return dict(wrong=wrong, differ=differ, requests=sum(len(reqs) for reqs in rounds))


def encoder_ms(engine: Engine, client: Client, sides: tuple[int, ...]) -> list[tuple[int, int, float]]:
    """(side, image tokens, ms) of the tower on one square image a side, at the published pixel
    bounds (up to 16384 image tokens), median of 3 warm runs."""
    from dataclasses import replace as changed

    published = changed(client.preprocessor, min_pixels=65536, max_pixels=16777216)
    rng, out = np.random.default_rng(9), []
    for side in sides:
        image = image_input(preprocess_image(png(rng, side), published, max_source_pixels=10**8), 0)
        times = []
        for _ in range(4):
            engine.runner.encoder.clear()
            began = time.perf_counter()
            engine.runner.encoder.embeddings([(image, 0, 1)])
            times.append(time.perf_counter() - began)
        out.append((side, image.num_tokens(2), statistics.median(times[1:]) * 1e3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--convs", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--image-every", type=int, default=2)
    parser.add_argument("--answer-tokens", type=int, default=16)
    parser.add_argument("--device-budget", type=float, default=0.25, metavar="F")
    parser.add_argument("--host-budget", type=float, default=2.0, metavar="H")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 conversations, 3 turns")
    args = parser.parse_args()
    size, side, spare = "bench", 256, 2**30
    if args.quick:
        size, side, spare, args.convs, args.turns = "tiny", 128, 2**26, 2, 3
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = vision_demo(size)
    client = Client(model_dir)
    opts = dict(max_num_seqs=max(4, args.convs), dtype="float32")
    rounds = record(Engine.from_pretrained(model_dir, cache_memory_bytes=spare, **opts), client, args.convs,
                    args.turns, args.image_every, args.answer_tokens, side)
    n = sum(len(reqs) for reqs in rounds)
    print(f"model: {size} qwen3_5 vision demo; {args.convs} conversations x {args.turns} turns = {n} requests, "
          f"an image every {args.image_every} turns ({rounds[0][0].images[0].num_tokens(2)} tokens each)")
    runs = {}
    runs["cold"] = replay(Engine.from_pretrained(model_dir, cache_memory_bytes=spare, **opts), rounds,
                          args.answer_tokens, "cold")
    runs["cairn, memory to spare"] = replay(Engine.from_pretrained(model_dir, cache_memory_bytes=spare, **opts),
                                           rounds, args.answer_tokens, "cairn")
    device = int(args.device_budget * runs["cairn, memory to spare"]["used"])
    for name, host in ((f"cairn, device {args.device_budget:g}x, no host tier", 0),
                       (f"cairn, device {args.device_budget:g}x, host {args.host_budget:g}x", int(args.host_budget * device))):
        try:
            engine = Engine.from_pretrained(model_dir, cache_memory_bytes=device, host_cache_bytes=host, **opts)
        except ValueError as e:  # a budget too small for one sequence
            print(f"{name}: not run ({e})")
            continue
        runs[name] = replay(engine, rounds, args.answer_tokens, "cairn")
    cold = runs["cold"]["ttft"]
    print(f"{'run':40s} {'cached':>7s} {'oracle':>7s} {'ratio':>6s} {'short>2':>7s} {'last TTFT':>10s} "
          f"{'vs cold':>7s} {'encoded/sent':>12s}")
    for name, r in runs.items():
        print(f"{name:40s} {r['hit']:7d} {r['oracle']:7d} {r['hit'] / max(r['oracle'], 1):6.3f} {r['short']:7d} "
              f"{r['ttft'] * 1e3:8.1f}ms {cold / r['ttft']:6.2f}x {r['encoded']:5d}/{r['sent']:<6d}")
    spare_run = runs["cairn, memory to spare"]
    why = " (turn 1's conversations start at once: the shared system prompt is not computed yet when the " \
        "others arrive)" if set(spare_run["short_turns"]) == {1} else ""
    print(f"cairn with memory to spare: {spare_run['hit'] / max(spare_run['oracle'], 1):.3f} of the oracle, "
          f"last-turn TTFT cold / cairn {cold / spare_run['ttft']:.2f}; short>2 in turns {spare_run['short_turns']}{why}")
    right = {}
    for reqs in rounds:  # each round as it ran, each request cold
        right.update(run(Engine.from_pretrained(model_dir, cache_memory_bytes=spare, **opts), reqs,
                         SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True), "cold")[0])
    for keyed in (True, False):
        engine = Engine.from_pretrained(model_dir, cache_memory_bytes=spare, **opts)
        bad = mismatches(engine, rounds, args.answer_tokens, right, keyed)
        print(f"image hashes {'in' if keyed else 'left out of'} the page hashes: {bad['wrong']} of {bad['requests']} "
              f"requests resume past a picture they did not send, {bad['differ']} answer otherwise than cold")
    for side, tokens, ms in encoder_ms(engine, client, (448, 1344)):
        print(f"the tower on one {side}x{side} image ({tokens} image tokens, published pixel bounds): {ms:.1f} ms")


if __name__ == "__main__":
    main()
