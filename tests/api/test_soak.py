"""A soak: rounds of 64 concurrent streamed chats against the HTTP API, a third of them hanging up
mid-stream. Every round must leave the engine as it found it: no page held, no request running
or waiting, no state slot taken; and what cairn's own code allocates must not grow from round to
round (a leak of a few objects per request would show over 64 x rounds requests). Memory is
measured with tracemalloc, counting the allocations made with cairn's code on the stack. Then slow
readers: three clients that never read streams of 16 choices x 4,000 tokens with 20 top logprobs
each hold 48 sequences; the process's RSS may rise by a bounded buffer while they stall, and is
back near where it was once the stall timeout has ended them. The soak runs in a process of its
own (spawned), so nothing else of the test run (a Ray session, other tests' servers and routers
still winding down) allocates beside it."""

import asyncio
import gc
import json
import multiprocessing
import random
import socket
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.http_limits import HTTPLimits
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront
from tests.support.paths import REPO

MODEL = "tiny"
STREAMS, ROUNDS = 64, 6
STALL_S = 2.0  # the stall timeout of the slow-reader phase
PACKAGES = ("cairn",)


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


def settled(engine: EngineFront, timeout_s: float = 20) -> None:
    """Waits until the engine holds nothing for any request (aborts land a step or two late)."""
    core, deadline = engine.engine, time.monotonic() + timeout_s
    while core.has_unfinished() or core.cache.pages.num_held or core.cache.running_slots:
        assert time.monotonic() < deadline, (f"never settled: running {len(core.scheduler.running)}, waiting "
                                             f"{len(core.scheduler.waiting)}, pages held {core.cache.pages.num_held}")
        time.sleep(0.05)


def connections_closed(timeout_s: float = 10) -> None:
    """Waits until the server has let go of the round's connections: the client has closed them,
    and the server drops each one (its protocol, h11 state and caller) when its loop sees the close,
    which can take a keep-alive interval. Counting before that counts them as if leaked."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gc.collect()
        if not any(type(o).__name__ == "GuardedH11Protocol" for o in gc.get_objects()):
            return
        time.sleep(0.25)


def our_objects() -> int:
    """Live objects of cairn's own classes (a leaked output, sequence, event or choice counts).
    The soak subtracts the cache's stored checkpoints: how many a full arena holds varies from
    round to round with where states fall (whole-page and sub-page ones compete for its slots),
    and the cache's own check bounds them."""
    return sum(1 for o in gc.get_objects() if str(getattr(type(o), "__module__", "")).split(".")[0] in PACKAGES)


def ours(snapshot: tracemalloc.Snapshot) -> int:
    """Bytes alive in `snapshot` that were allocated with cairn's code on the stack."""
    root = str(REPO)
    keep = [tracemalloc.Filter(True, f"{root}/{package}/*", all_frames=True) for package in PACKAGES]
    return sum(stat.size for stat in snapshot.filter_traces(keep).statistics("filename"))


def stalled_reader(url: str) -> socket.socket:
    """A client that asks for 16 x 4,000 tokens with 20 top logprobs each and never reads them."""
    body = json.dumps({"model": MODEL, "stream": True, "n": 16, "max_tokens": 4000, "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 20,
                       "messages": [{"role": "user", "content": "Tell me about every stone."}]}).encode()
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def slow_readers(url: str, engine: EngineFront) -> tuple[int, int, int]:
    """RSS before three stalled readers, at its highest while they stall, and after they ended."""
    gc.collect()
    before = peak = rss_bytes()
    sockets = [stalled_reader(url) for _ in range(3)]
    core, deadline = engine.engine, time.monotonic() + 60
    while len(core.scheduler.running) < 48 and time.monotonic() < deadline:  # every choice runs
        time.sleep(0.02)
    while core.has_unfinished():  # until the stall timeout ends them
        peak = max(peak, rss_bytes())
        assert time.monotonic() < deadline, "the stalled streams were never ended"
        time.sleep(0.05)
    for s in sockets:
        s.close()
    settled(engine)
    gc.collect()
    return before, peak, rss_bytes()


def soak(model_dir: Path, results) -> None:
    """The soak itself, in its own process: puts (allocated, objects, rss) per round and the slow
    readers' RSS (before, peak, after) on `results`, or the failure's text."""
    import torch

    torch.set_num_threads(1)  # as conftest sets it for the test process
    try:
        # a small arena, full from the first round on: what the cache keeps is at its steady state
        engine = EngineFront.from_pretrained(model_dir, max_num_seqs=64, cache_memory_bytes=4 << 20)
        limits = HTTPLimits(stream_stall_timeout_s=STALL_S, keep_alive_timeout_s=0.5)  # idle ones close at once
        app = build_app(LocalEngineClient(engine), model_dir,
                        APIOptions(served_model_name=MODEL, max_waiting=STREAMS, http_limits=limits))
        allocated, objects, rss = [], [], []
        tracemalloc.start(4)  # frames kept per allocation: enough to see cairn's code, cheap enough to soak
        try:
            with BackgroundServer(app, limits=limits) as server:
                for _ in range(ROUNDS):  # the same chats each round: the cache's contents settle after the first
                    outcomes = asyncio.run(asyncio.wait_for(soak_round(server.url, seed=0), 300))
                    assert outcomes.count("hung up") >= STREAMS // 3 - 2 and outcomes.count("done") >= STREAMS // 2
                    settled(engine)
                    connections_closed()
                    engine.engine.check()
                    gc.collect()
                    allocated.append(ours(tracemalloc.take_snapshot()))
                    cache = engine.engine.cache  # its checkpoints are entries it holds, bounded by the arena:
                    objects.append(our_objects() - cache.checkpoints.num_stored - len(cache.host.checkpoints))
                    rss.append(rss_bytes())
                tracemalloc.stop()  # its own bookkeeping would count in the RSS
                stalled = slow_readers(server.url, engine)
                engine.engine.check()
        finally:
            tracemalloc.stop()
        asyncio.run(engine.close())
        results.put((allocated, objects, rss, stalled))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        results.put(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


@pytest.mark.slow
def test_rounds_of_64_streams_with_a_third_hanging_up_leave_nothing_behind(tiny_model_dir):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=soak, args=(tiny_model_dir, results))
    child.start()
    try:
        got = results.get(timeout=1500)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert not isinstance(got, str), got
    allocated, objects, rss, (before, peak, after) = got
    # Round 1 warms caches (the tokenizer's; the prefix cache fills). From then on what cairn holds
    # moves within lazily compacted structures (heaps, the LRU's queue, closing connections) but
    # must not climb: a leak of 1 KiB per request would add 64 KiB a round, 192 KiB over the last 3.
    early, late = max(allocated[1:3]), max(allocated[3:])
    assert late - early < 128 << 10, f"bytes cairn's code holds after each round: {allocated}"
    assert max(objects[3:]) - max(objects[1:3]) < 32, f"objects of cairn's classes after each round: {objects}"
    print(f"soak: {ROUNDS} rounds x {STREAMS} streams; cairn-allocated KiB {[b >> 10 for b in allocated]}; "
          f"objects of cairn's classes {objects}; process RSS MiB {[b >> 20 for b in rss]}; slow readers: RSS "
          f"MiB before {before >> 20}, at most {peak >> 20} while they stalled, {after >> 20} after")
    # what three stalled readers may hold: the streams' buffers (Fanout.BUFFERED and the engine's
    # MAX_BUFFERED outputs per choice) and the sockets', not the 192,000 outputs they asked for
    assert peak - before < 96 << 20, (before, peak, after)
    assert after - before < 32 << 20, (before, peak, after)
