"""The outermost layer of the app: request id, header and body limits, last-resort 500, request counts.

Every HTTP request gets an id (`request.state.request_id`): the `X-Request-Id` it came with if
that is a plain token of up to 128 characters (a client's, or the one Ray Serve's proxy sets),
else a new one; it is echoed as `X-Request-Id` unless `echo_request_id` is off (behind Serve's
proxy, which echoes the same id itself). Headers over `max_header_bytes` (names and values) are a
431: in-process the server refuses them before the app sees them (`cairn.cluster.api.connection`), but
Serve's proxy reads headers of any size, so behind it this is where they stop. A body is read
here, whole, before the app sees it: more than `max_body_bytes` (by Content-Length or by counting
a chunked body) is a 413, after draining what the client still sends (up to a bound) so it reads
the answer instead of a reset connection; a body, drain included, that has not arrived whole
`body_timeout_s` after the headers is a 408 that closes the connection (`Connection: close`), so a
client that sends half a body and stalls holds nothing. The app then reads the body from memory
and later `receive` calls reach the server, so a disconnect is still noticed. An exception that
escapes the app is logged with the request id; the client gets a 500 naming only that id (or, if
a stream had started, a closed stream). Nothing a client sends takes the process down.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cairn.cluster.api.api_errors import APIError, fault

log = logging.getLogger("cairn.cluster.api")

DRAIN_LIMIT_BYTES = 64 << 20  # read and drop at most this much of an oversized body
REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, count: Callable[[str, int], None],
                 endpoints: frozenset[str], echo_request_id: bool = True, max_header_bytes: int = 32 << 10,
                 body_timeout_s: float = 60.0):
        self.app, self.echo_request_id = app, echo_request_id
        self.max_body_bytes, self.max_header_bytes = max_body_bytes, max_header_bytes
        self.body_timeout_s = body_timeout_s
        self.count = count
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", [])).get(b"x-request-id", b"")
        request_id = given.decode() if REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex[:20]}"
        scope.setdefault("state", {})["request_id"] = request_id
        status: list[int] = []

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
                if self.echo_request_id:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            body = self._headers_too_large(scope) or await self._read_body(scope, receive)
            if isinstance(body, APIError):
                await self._send_error(body, send_with_id)
                return
            await self.app(scope, _replay(body, receive), send_with_id)
        except Exception as e:
            log.exception("request %s failed", request_id)
            if not status:
                await self._send_error(fault(request_id, e), send_with_id)
        finally:
            path = scope.get("path", "")
            self.count(path if path in self.endpoints else "other", status[0] if status else 500)

    def _headers_too_large(self, scope: Scope) -> APIError | None:
        if sum(len(k) + len(v) for k, v in scope.get("headers", [])) <= self.max_header_bytes:
            return None
        return APIError(431, f"the request headers are over {self.max_header_bytes} bytes", code="headers_too_large",
                        headers={"Connection": "close"})

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | APIError:
        try:
            return await self._read_whole_body(scope, _by(time.monotonic() + self.body_timeout_s, receive))
        except _Late:
            return APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                            code="request_timeout", headers={"Connection": "close"})

    async def _read_whole_body(self, scope: Scope, receive: Receive) -> bytes | APIError:
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                return APIError(400, "Content-Length is not a number", code="invalid_body")
            if length > self.max_body_bytes:
                await self._drain(receive, 0)
                return self._too_large(length)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                if message.get("more_body", False):
                    await self._drain(receive, total)
                return self._too_large(total, at_least=True)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    def _too_large(self, size: int, at_least: bool = False) -> APIError:
        return APIError(413, f"request body is {'over ' if at_least else ''}{size} bytes; this server accepts "
                             f"at most {self.max_body_bytes}", code="request_too_large", headers={"Connection": "close"})

    @staticmethod
    async def _drain(receive: Receive, seen: int) -> None:
        """Reads and drops what the client still sends, up to a bound, until the body's deadline."""
        try:
            while seen < DRAIN_LIMIT_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                seen += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
        except _Late:
            return

    @staticmethod
    async def _send_error(error: APIError, send: Send) -> None:
        response = error.response()
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


class _Late(Exception):
    """The body did not arrive in time."""


def _by(deadline: float, receive: Receive) -> Receive:
    """`receive`, raising `_Late` once the clock passes `deadline` (time.monotonic())."""
    async def receive_by() -> Message:
        try:
            return await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise _Late() from None

    return receive_by


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
