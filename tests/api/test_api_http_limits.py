"""What one connection may cost the server, over raw sockets against a real uvicorn
(`BackgroundServer`, `cairn.cluster.api.connection`): headers over the limit are a 431 and a closed
connection; a request whose headers or body stall is closed within its deadline (a 408 when part
of it had arrived); a connection that never speaks, or idles between requests, is closed after its
timeout; a normal request, and a second one on the same connection, still work. Every refusal is
in OpenAI's error shape. The app's own header limit (what stops headers behind Serve's proxy,
which reads any size) is tested with a server that lets them through."""

import json
import socket
import time

import httpx
import pytest

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.http_limits import HTTPLimits
from cairn.cluster.api.server import BackgroundServer
from tests.support.fake_clients import OneTokenClient

LIMITS = HTTPLimits(max_header_bytes=4096, header_timeout_s=1.0, body_timeout_s=1.0, keep_alive_timeout_s=1.0)
CHAT = b"/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with BackgroundServer(build_app(OneTokenClient(max_model_len=4096), tiny_model_dir,
                                    APIOptions(served_model_name="tiny", http_limits=LIMITS)), limits=LIMITS) as s:
        yield s


def connect(server) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, within_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took;
    fails if it is still open after `within_s`."""
    start, data = time.monotonic(), b""
    sock.settimeout(within_s)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        pytest.fail(f"the connection was still open after {within_s} s; got {data[:200]!r}")
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body, leaving the connection as it is."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def status_and_error(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return int(head.split()[1]), error


def get(path: bytes = b"/health", extra: bytes = b"") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n"


def test_a_normal_request_works_and_a_second_one_reuses_the_connection(server):
    with connect(server) as sock:
        for _ in range(2):
            sock.sendall(get())
            status, headers, body = read_response(sock)
            assert status == 200 and json.loads(body) == {"status": "ok"}
            assert headers.get("connection") != "close"
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        status, _, answer = read_response(sock)
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 1


def test_headers_over_the_limit_are_a_431_and_the_connection_is_closed(server):
    with connect(server) as sock:
        sock.sendall(get(extra=b"X-Big: " + b"a" * 8000 + b"\r\n"))
        data, _ = read_until_closed(sock, 5)
    status, error = status_and_error(data)
    assert status == 431 and error["code"] == "headers_too_large" and "4096" in error["message"]


def test_headers_that_never_end_are_refused_once_past_the_limit_without_waiting_for_the_rest(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(100):  # a stream of headers that would go on forever
            try:
                sock.sendall(b"X-More: " + b"b" * 200 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        data, _ = read_until_closed(sock, 5)
    assert status_and_error(data)[0] == 431


def test_a_request_whose_headers_stall_is_closed_within_the_header_timeout_with_a_408(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Half: ")
        data, waited = read_until_closed(sock, LIMITS.header_timeout_s + 3)
    status, error = status_and_error(data)
    assert status == 408 and error["code"] == "request_timeout"
    assert LIMITS.header_timeout_s * 0.8 <= waited <= LIMITS.header_timeout_s + 2


def test_headers_trickled_byte_by_byte_still_end_at_the_header_timeout(server):
    """A deadline for the whole header block, not an idle timer that each byte resets."""
    request, start = get(), time.monotonic()
    with connect(server) as sock:
        for byte in request[:-2]:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            if time.monotonic() - start > LIMITS.header_timeout_s + 3:
                pytest.fail("the server kept reading a trickled request past its header timeout")
            time.sleep(0.1)
        data, _ = read_until_closed(sock, 5)
    assert status_and_error(data)[0] == 408
    assert time.monotonic() - start <= LIMITS.header_timeout_s + 2.5


def test_a_connection_that_sends_nothing_is_closed_within_the_header_timeout(server):
    with connect(server) as sock:
        data, waited = read_until_closed(sock, LIMITS.header_timeout_s + 3)
    assert data == b"" and waited <= LIMITS.header_timeout_s + 2


def test_a_request_whose_body_stalls_is_closed_within_the_body_timeout_with_a_408(server):
    with connect(server) as sock:
        sock.sendall(b"POST " + CHAT + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        data, waited = read_until_closed(sock, LIMITS.body_timeout_s + 3)
    status, error = status_and_error(data)
    assert status == 408 and error["code"] == "request_timeout" and b"connection: close" in data.lower()
    assert LIMITS.body_timeout_s * 0.8 <= waited <= LIMITS.body_timeout_s + 2


def test_a_chunked_body_that_stalls_is_closed_too(server):
    with connect(server) as sock:
        sock.sendall(b"POST " + CHAT + b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n")
        data, _ = read_until_closed(sock, LIMITS.body_timeout_s + 3)
    assert status_and_error(data)[0] == 408


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    with connect(server) as sock:
        sock.sendall(get())
        assert read_response(sock)[0] == 200
        data, waited = read_until_closed(sock, LIMITS.keep_alive_timeout_s + 3)
    assert data == b"" and waited <= LIMITS.keep_alive_timeout_s + 2


def test_a_request_that_is_not_http_is_a_400_in_openai_shape(server):
    with connect(server) as sock:
        sock.sendall(b"HELLO THERE\r\n\r\n")
        data, _ = read_until_closed(sock, 5)
    status, error = status_and_error(data)
    assert status == 400 and error["code"] == "invalid_http_request"


def test_the_app_refuses_headers_over_its_limit_when_the_server_in_front_lets_them_through(tiny_model_dir):
    """Behind Serve's proxy, which reads headers of any size, the ingress app is what answers."""
    roomy = HTTPLimits(max_header_bytes=1 << 20)
    app = build_app(OneTokenClient(max_model_len=4096), tiny_model_dir,
                    APIOptions(served_model_name="tiny", http_limits=HTTPLimits(max_header_bytes=4096)))
    with BackgroundServer(app, limits=roomy) as s, connect(s) as sock:
        sock.sendall(get(extra=b"X-Big: " + b"a" * 8000 + b"\r\n"))
        status, headers, body = read_response(sock)
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "headers_too_large"
        data, _ = read_until_closed(sock, 5)
        assert data == b""


def test_the_operators_request_timeout_ends_a_request_whatever_timeout_header_its_client_sends(tiny_model_dir):
    """`request_timeout_s` is the operator's end-to-end limit. Behind Serve's proxy a client's
    `x-request-timeout-seconds` header lifts the proxy's own; the app's holds: a 408 for a whole
    response, an error event and [DONE] in a stream, and the engine stream is closed either way."""
    import asyncio

    from cairn.workers import RequestOutput

    class Slow(OneTokenClient):
        def __init__(self):
            super().__init__()
            self.closed = 0

        async def generate(self, request):
            try:
                for k in range(1, 200):
                    yield RequestOutput(request.request_id, [5], None, k, 0)
                    await asyncio.sleep(0.05)
            finally:
                self.closed += 1

    slow = Slow()
    app = build_app(slow, tiny_model_dir, APIOptions(served_model_name="tiny", request_timeout_s=1.0))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 500}
    lifted = {"x-request-timeout-seconds": "1000", "x-request-disconnect-disabled": "?1"}
    with BackgroundServer(app) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        start = time.monotonic()
        r = http.post("/v1/chat/completions", json=body, headers=lifted)
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
        assert time.monotonic() - start < 3
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}, headers=lifted) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "request_timeout"
        assert len(events) < 60, "ended at the deadline, not at the end of its 200 tokens"
    assert slow.closed == 2
