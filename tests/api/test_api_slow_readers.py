"""A client that stops reading its stream costs a bounded buffer and, after the stall timeout,
nothing: each engine stream of a request buffers at most `Fanout.BUFFERED` outputs for its reader,
an engine request whose reader is behind is paused (tests/workers/test_engine_front.py), and a stream
whose client took no output for `HTTPLimits.stream_stall_timeout_s` is ended, its sequences freed
and its connection closed, while other clients are served. The memory this returns is measured by
the soak (tests/api/test_soak.py)."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.fanout import Fanout
from cairn.cluster.api.http_limits import HTTPLimits
from cairn.cluster.api.server import BackgroundServer
from tests.support.fake_clients import OneTokenClient
from cairn.workers import EngineFront, RequestOutput

MODEL = "tiny"


def test_an_engine_stream_stops_being_read_once_its_reader_is_a_buffer_behind():
    class Endless(OneTokenClient):
        produced = 0

        async def generate(self, request):
            while True:
                Endless.produced += 1
                yield RequestOutput(request.request_id, [5], None, Endless.produced, 0)
                await asyncio.sleep(0)

    async def main():
        fan = Fanout(Endless(), [_request("r")])
        first = await fan.__anext__()
        await asyncio.sleep(0.2)  # the reader takes nothing
        held = Endless.produced
        for _ in range(40):
            await fan.__anext__()
        await asyncio.sleep(0.05)
        read_on = Endless.produced
        await fan.close()
        return first, held, read_on

    first, held, read_on = asyncio.run(main())
    assert first[1].num_output_tokens == 1
    assert held <= Fanout.BUFFERED + 2, f"{held} outputs pulled for a reader that took one"
    assert read_on >= 41, "reading again, the stream goes on"


def _request(request_id: str):
    from cairn.workers.request import GenerateRequest
    from cairn.workers import SamplingParams

    return GenerateRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4))


def stalled_stream(url: str, body: dict) -> socket.socket:
    """A streamed request over a socket with a tiny receive window that is never read."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    raw = json.dumps(body).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return s


def closed_by_server(s: socket.socket, timeout_s: float) -> bool:
    """Drains what the server sent; True once it closed the connection."""
    s.settimeout(timeout_s)
    try:
        while s.recv(1 << 16):
            pass
        return True
    except (socket.timeout, ConnectionResetError):
        return False


@pytest.mark.slow
def test_streams_whose_clients_stop_reading_end_after_the_stall_timeout_and_free_their_sequences(tiny_model_dir):
    engine = EngineFront.from_pretrained(tiny_model_dir, max_num_seqs=64)
    limits = HTTPLimits(stream_stall_timeout_s=2.0)
    app = build_app(LocalEngineClient(engine), tiny_model_dir, APIOptions(served_model_name=MODEL, http_limits=limits))
    body = {"model": MODEL, "stream": True, "n": 16, "max_tokens": 2000, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 20, "messages": [{"role": "user", "content": "Which stones hold best when wet?"}]}
    core = engine.engine
    with BackgroundServer(app, limits=limits) as server:
        sockets = [stalled_stream(server.url, body) for _ in range(3)]
        deadline = time.monotonic() + 30
        while len(core.scheduler.running) < 48:  # all 48 sequences run
            assert time.monotonic() < deadline, len(core.scheduler.running)
            time.sleep(0.05)
        other = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
        assert other.status_code == 200, "another client is served meanwhile"
        stalled_at = time.monotonic()
        while core.has_unfinished() or core.cache.pages.num_held:
            assert time.monotonic() - stalled_at < 30, f"still running: {len(core.scheduler.running)}"
            time.sleep(0.1)
        generated = core.stats.generated_tokens
        assert generated < 48 * 2000 / 4, f"{generated} tokens computed for clients that read none of them"
        assert all(closed_by_server(s, 10) for s in sockets), "the server closed each stalled connection"
        for s in sockets:
            s.close()
        core.check()
    asyncio.run(engine.close())
