"""A soak: rounds of 64 concurrent streamed chats against the HTTP API, a third of them hanging up
mid-stream. Every round must leave the engine as it found it: no page held, no request running
or waiting, no state slot taken; and the process must not grow from round to round (a leak of a
few objects per request would show over 64 x rounds requests)."""

import asyncio
import gc
import json
import random
import time

import httpx
import pytest

from cluster.api import build_app
from cluster.api.engine_client import LocalEngineClient
from cluster.api.server import BackgroundServer
from workers import AsyncEngine

MODEL = "tiny"
STREAMS, ROUNDS = 64, 5


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def one_stream(client: httpx.AsyncClient, i: int, rng: random.Random) -> str:
    """A streamed chat; hangs up after a few events when `i` is a multiple of 3."""
    body = {"model": MODEL, "stream": True, "max_tokens": 24, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You stack stones. " * (1 + i % 5)},
                         {"role": "user", "content": f"Question {i}: " + "how tall? " * rng.randint(1, 12)}]}
    hang_up_after = rng.randint(1, 6) if i % 3 == 0 else None
    events = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done"
            assert "error" not in json.loads(line[6:]), line
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                return "hung up"  # leaving the `async with` closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


async def soak_round(url: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(one_stream(client, i, rng) for i in range(STREAMS)))


def settled(engine: AsyncEngine, timeout_s: float = 20) -> None:
    """Waits until the engine holds nothing for any request (aborts land a step or two late)."""
    core, deadline = engine.engine, time.monotonic() + timeout_s
    while core.has_unfinished() or core.cache.pages.num_held or core.cache.num_running_slots:
        assert time.monotonic() < deadline, (f"never settled: running {len(core.scheduler.running)}, waiting "
                                             f"{len(core.scheduler.waiting)}, pages held {core.cache.pages.num_held}")
        time.sleep(0.05)


@pytest.mark.slow
def test_rounds_of_64_streams_with_a_third_hanging_up_leave_nothing_behind(tiny_model_dir):
    engine = AsyncEngine.from_pretrained(tiny_model_dir, max_num_seqs=32, cache_memory_bytes=24 << 20)
    app = build_app(LocalEngineClient(engine), tiny_model_dir, MODEL, max_waiting=STREAMS)
    footprint = []
    with BackgroundServer(app) as server:
        for _ in range(ROUNDS):
            outcomes = asyncio.run(asyncio.wait_for(soak_round(server.url, seed=0), 300))  # same chats: the cache's contents settle
            assert outcomes.count("hung up") >= STREAMS // 3 - 2 and outcomes.count("done") >= STREAMS // 2
            settled(engine)
            engine.engine.check()
            gc.collect()
            footprint.append((len(gc.get_objects()), rss_bytes()))
    asyncio.run(engine.close())
    objects = [n for n, _ in footprint]
    rss = [b for _, b in footprint]
    # Round 1 warms caches (the tokenizer's; the prefix cache fills with these chats' pages and
    # checkpoints); the same chats again must not grow anything.
    assert objects[-1] - objects[1] < 300, f"Python objects per round: {objects}"
    assert rss[-1] - rss[1] < 48 << 20, f"RSS per round (bytes): {rss}"
    print(f"soak: {ROUNDS} rounds x {STREAMS} streams; objects {objects}; RSS MiB {[b >> 20 for b in rss]}")
