"""The cache index alone, without Serve: how fast it takes in cache events and scores a prompt.

`CacheIndex` in this process is fed `--pages` pages (1M by default) from 16 workers as
wire-format event batches, 64 events each (runs of 16 pages, a state stored every 4th run):
decode + apply, what the index actor does per batch. Printed: events/s and pages/s ingested, then
the time to score a 32k-token prompt (2,048 pages, held to 16 different depths by the 16 workers),
p50/p99 over 200 scores. Then the same batches and scores through the index actor on a local Ray
(a Ray RPC per batch and per score, up to 16 batches in flight), to set beside the in-process
numbers of the same run. Not a test: nothing is asserted beyond the score finding the prompt's
full depth.

Usage: python3 benchmarks/index_scoring.py [--pages 1000000] [--quick]
  --quick: 65,536 pages (4,096 per worker), to check that the script runs.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402

from percentiles import pct  # noqa: E402  (benchmarks/percentiles.py)

NAMESPACE = "cairn-bench"
WORKERS, PROMPT_PAGES, RUN_PAGES, BATCH_EVENTS, SCORES = 16, 2048, 16, 64, 200


def event_batches(total_pages: int) -> tuple[list[bytes], int, list[bytes]]:
    """(encoded batches, events in them, the prompt's page hashes): worker w holds the prompt's
    first (w + 1) / 16 of its pages, then chains of its own, total_pages / 16 pages in all."""
    from cairn.cache_service.events import EventStream, PagesStored, StateStored

    workers, prompt_pages = WORKERS, PROMPT_PAGES
    rng = random.Random(0)
    prompt = [rng.randbytes(16) for _ in range(prompt_pages)]
    per_worker, run_pages, batch_events = total_pages // workers, RUN_PAGES, BATCH_EVENTS
    batches: list[bytes] = []
    events = 0
    for w in range(workers):
        stream, pending = EventStream(f"worker-{w:02d}"), []
        depth = prompt_pages * (w + 1) // workers  # worker w holds the prompt's first `depth` pages
        chains = [prompt[:depth]]
        left = per_worker - depth
        while left > 0:
            chains.append([rng.randbytes(16) for _ in range(min(256, left))])
            left -= len(chains[-1])
        for chain in chains:
            for i in range(0, len(chain), run_pages):
                pending.append(PagesStored(tuple(chain[i:i + run_pages]), chain[i - 1] if i else None))
                if (i // run_pages) % 4 == 3:
                    pending.append(StateStored(chain[i + len(chain[i:i + run_pages]) - 1]))
                if len(pending) >= batch_events:
                    batches.append(stream.batch(pending).encode())
                    events, pending = events + len(pending), []
        if pending:
            batches.append(stream.batch(pending).encode())
            events += len(pending)
    return batches, events, prompt


def in_process(batches: list[bytes], events: int, prompt: list[bytes], max_pages: int) -> None:
    from cairn.cache_service.index import CacheIndex

    workers, prompt_pages, runs = WORKERS, len(prompt), SCORES
    index = CacheIndex(max_pages=max_pages)
    start = time.perf_counter()
    for data in batches:
        index.apply(data)
    took = time.perf_counter() - start
    stats = index.stats()
    print(f"\n== the cache index alone: {stats['pages']:,} pages from {workers} workers, "
          f"{len(batches):,} batches of {BATCH_EVENTS} events ({RUN_PAGES} pages each), "
          f"~{stats['approx_bytes'] / 2**20:.0f} MiB")
    print(f"CacheIndex in-process: {events / took:,.0f} events/s, {stats['pages'] / took:,.0f} pages/s ingested "
          f"(decode + apply, {took:.1f} s)")
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        scores = index.score(prompt)
        times.append(time.perf_counter() - t)
    assert max(s.hit_pages for s in scores.values()) == prompt_pages
    print(f"  score of a {prompt_pages * 16:,}-token prompt ({prompt_pages} pages) against {workers} workers: "
          f"p50 {1000 * pct(times, 0.5):.2f} ms, p99 {1000 * pct(times, 0.99):.2f} ms")


def through_actor(batches: list[bytes], events: int, prompt: list[bytes], total_pages: int, max_pages: int) -> None:
    from cairn.cache_service.actor import index_actor

    workers, prompt_pages, runs = WORKERS, len(prompt), SCORES
    handle = index_actor("cairn-bench-index-alone", NAMESPACE, max_pages=max_pages)
    try:
        ray.get(handle.stats.remote())
        start, inflight = time.perf_counter(), []
        for data in batches:  # up to 16 batches in flight, as 16 publishers would send
            inflight.append(handle.apply.remote(data))
            if len(inflight) >= workers:
                ray.get(inflight.pop(0))
        ray.get(inflight)
        took = time.perf_counter() - start
        print(f"index actor (Ray RPC per batch): {events / took:,.0f} events/s, "
              f"{total_pages / took:,.0f} pages/s ingested")
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            ray.get(handle.score.remote(prompt))
            times.append(time.perf_counter() - t)
        print(f"  score of the {prompt_pages * 16:,}-token prompt through the actor: "
              f"p50 {1000 * pct(times, 0.5):.2f} ms, "
              f"p99 {1000 * pct(times, 0.99):.2f} ms")
    finally:
        ray.kill(handle, no_restart=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=1_000_000, help="pages fed to the index, from 16 workers")
    parser.add_argument("--quick", action="store_true", help="65,536 pages")
    args = parser.parse_args()
    if args.quick:
        args.pages = 65_536
    started = time.perf_counter()
    batches, events, prompt = event_batches(args.pages)
    in_process(batches, events, prompt, max_pages=args.pages + PROMPT_PAGES)
    ray.init(include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)  # after: its start-up is not timed
    try:
        through_actor(batches, events, prompt, args.pages, max_pages=args.pages + PROMPT_PAGES)
    finally:
        ray.shutdown()
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
