"""A second tenant's latency while the first floods the server, against its latency alone, in one run.

One in-process server (`build_app` over one engine, real HTTP) with two tenants' keys: alice
floods, bob sends a short chat (16 tokens out, greedy) and times it end to end. Floods:
1. streams: alice holds `max_num_seqs` (64) long streams (`--long` tokens each, EOS ignored),
   every sequence slot;
2. batch: alice asks for 128 prompts x n 2 (now a 413: `max_engine_requests`), then sends two
   batches of 64 long prompts, as much as her quota lets her hold;
3. preparation: six of alice's loops send 3.9M-character messages (refused before tokenizing);
4. tools: six loops send 128 tools of 30,000 characters each.
Baseline: bob alone, in the same run. The streams and batch floods also run on a server without
keys, where both are one tenant (first come, first served): the scheduler as it was.

Prints bob's median latency under each flood, its ratio to his baseline, and what alice's requests
got. Not a test: nothing here asserts timings.

Usage: python3 benchmarks/tenant_fairness.py [--quick] [--long 1500] [--size bench] [--floods streams,batch,prep]
  --quick: the tiny demo model, 48-token streams, 2 tries: checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages

import httpx  # noqa: E402

from cairn.cluster.api import APIOptions, build_app  # noqa: E402
from cairn.cluster.api.engine_client import LocalEngineClient  # noqa: E402
from cairn.cluster.api.server import BackgroundServer  # noqa: E402
from cairn.cluster.api.tenants import Tenants  # noqa: E402
from cairn.workers import EngineFront  # noqa: E402
from cairn.workers.demo import demo_model_dir  # noqa: E402

MODEL = "demo"
ALICE, BOB = {"Authorization": "Bearer key-alice"}, {"Authorization": "Bearer key-bob"}


def bob_latency(url: str, headers: dict, tries: int) -> tuple[float, list[int]]:
    """Bob's median end-to-end seconds for a short chat, and the statuses he got."""
    seconds, statuses = [], []
    for i in range(tries):
        start = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=600, json={
            "model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Which stones hold best when wet? ({i})"}]})
        seconds.append(time.monotonic() - start)
        statuses.append(r.status_code)
    return statistics.median(seconds), statuses


def _alice(url: str, headers: dict, kind: str, arg, threads: int, stop, results) -> None:
    """Alice's load (in a process of her own, so her clients take none of the server's CPU or
    GIL): `threads` loops of `kind` until `stop`; puts her statuses, counted, on `results`."""
    statuses: Counter = Counter()
    lock = threading.Lock()

    def count(status: int) -> None:
        with lock:
            statuses[status] += 1

    def stream() -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": arg, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me about every stone on the ridge."}]}
        with httpx.Client(base_url=url, timeout=600, headers=headers) as http:
            while not stop.is_set():
                with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    count(r.status_code)
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break

    def post(path: str, raw: bytes) -> None:
        with httpx.Client(base_url=url, timeout=600, headers={**headers, "content-type": "application/json"}) as http:
            while not stop.is_set():
                count(http.post(path, content=raw).status_code)

    if kind == "stream":
        targets = [stream] * threads
    else:
        path, body = arg
        raw = json.dumps(body).encode()  # once: the client's own work is not what is measured
        targets = [lambda: post(path, raw)] * threads
    workers = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    results.put(dict(statuses))


class Flood:
    """Alice's load in a process of her own until `end`, which returns what her requests got."""

    def __init__(self, url: str, headers: dict, kind: str, arg, threads: int):
        ctx = multiprocessing.get_context("spawn")
        self.stop, self.results = ctx.Event(), ctx.Queue()
        self.process = ctx.Process(target=_alice, args=(url, headers, kind, arg, threads, self.stop, self.results),
                                   daemon=True)
        self.process.start()

    def end(self) -> dict:
        self.stop.set()
        got = self.results.get(timeout=900)
        self.process.join(timeout=60)
        return got


def wait_running(engine: EngineFront, n: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while len(engine.engine.scheduler.running) < n and time.monotonic() < deadline:
        time.sleep(0.05)


def settle(engine: EngineFront) -> None:
    while engine.engine.has_unfinished():
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--long", type=int, default=None, help="tokens of each of alice's long requests (1500)")
    parser.add_argument("--size", default=None, choices=("tiny", "bench"))
    parser.add_argument("--tries", type=int, default=None, help="bob's chats per flood (5; --quick 2)")
    parser.add_argument("--floods", default="streams,batch,prep", help="which floods: streams, batch, prep")
    args = parser.parse_args()
    long = args.long or (48 if args.quick else 1500)
    args.tries = args.tries or (2 if args.quick else 5)
    model_dir = demo_model_dir(args.size or ("tiny" if args.quick else "bench"))
    engine = EngineFront.from_pretrained(model_dir, max_num_seqs=64)
    keyed = build_app(LocalEngineClient(engine), model_dir, APIOptions(served_model_name=MODEL),
                      tenants=Tenants.load(["alice:key-alice", "bob:key-bob"]))
    open_app = build_app(LocalEngineClient(engine), model_dir, APIOptions(served_model_name=MODEL))
    rows = []
    with BackgroundServer(keyed) as two, BackgroundServer(open_app) as one:
        base, _ = bob_latency(two.url, BOB, args.tries)
        rows.append(("alone", "two tenants", base, {}, []))
        floods = set(args.floods.split(","))
        for server, label, alice, bob in ((two, "two tenants", ALICE, BOB), (one, "one tenant (no keys)", {}, {})):
            if "streams" not in floods:
                break
            flood = Flood(server.url, alice, "stream", long, 64)
            wait_running(engine, 64)
            seconds, got = bob_latency(server.url, bob, args.tries)
            rows.append(("64 long streams", label, seconds, flood.end(), got))
            settle(engine)
        for server, label, alice, bob in ((two, "two tenants", ALICE, BOB), (one, "one tenant (no keys)", {}, {})):
            if "batch" not in floods:
                break
            refused = httpx.post(server.url + "/v1/completions", headers=alice, timeout=60, json={
                "model": MODEL, "prompt": ["x"] * 128, "n": 2, "max_tokens": long}).status_code
            batch = {"model": MODEL, "prompt": ["Tell me about every stone on the ridge."] * 64, "max_tokens": long,
                     "ignore_eos": True}
            flood = Flood(server.url, alice, "post", ("/v1/completions", batch), 2)
            wait_running(engine, 64)
            seconds, got = bob_latency(server.url, bob, args.tries)
            alice_got = flood.end()
            alice_got[f"{refused} (128 x n 2)"] = 1
            rows.append(("batches of 64 long prompts", label, seconds, alice_got, got))
            settle(engine)
        huge = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "stone " * 650_000}]}
        tools = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}],
                 "tools": [{"type": "function", "function": {"name": f"t{i}", "description": "x" * 30_000}}
                           for i in range(128)]}
        for name, body in (("3.9M-character messages x 6 loops", huge), ("128 tools of 30k characters x 6", tools)):
            if "prep" not in floods:
                break
            flood = Flood(two.url, ALICE, "post", ("/v1/chat/completions", body), 6)
            time.sleep(3.0)  # her loops are under way
            seconds, got = bob_latency(two.url, BOB, args.tries + 2)
            rows.append((name, "two tenants", seconds, flood.end(), got))
    print(f"bob's short chat (16 tokens) while alice floods; model {model_dir.name}, alice's long requests "
          f"{long} tokens, {args.tries} tries each (medians)")
    print(f"{'flood':38} {'server':22} {'bob s':>8} {'x alone':>8}  bob's statuses / alice's")
    for flood_name, label, seconds, alice_got, bob_got in rows:
        print(f"{flood_name:38} {label:22} {seconds:8.3f} {seconds / base:8.1f}  "
              f"{dict(Counter(bob_got)) or '-'} / {json.dumps(alice_got) if alice_got else '-'}")
    import asyncio

    asyncio.run(engine.close())


if __name__ == "__main__":
    main()
