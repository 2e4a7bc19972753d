"""The outermost layer of the app: request id, body limit, last-resort 500, request counts.

Every HTTP request gets an id (`request.state.request_id`): the `X-Request-Id` it came with if
that is a plain token of up to 128 characters (a client's, or the one Ray Serve's proxy sets),
else a new one; it is echoed as `X-Request-Id` unless `echo_request_id` is off (behind Serve's
proxy, which echoes the same id itself). A body
is read here, whole, before the app sees it: more than `max_body_bytes` (by Content-Length or
by counting a chunked body) is a 413, after draining what the client still sends (up to a
bound) so it reads the answer instead of a reset connection. The app then reads the body from
memory and later `receive` calls reach the server, so a disconnect is still noticed. An
exception that escapes the app is logged with the request id; the client gets a 500 naming
only that id (or, if a stream had started, a closed stream). Nothing a client sends takes the
process down.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.api.errors import APIError, internal_error

log = logging.getLogger("cluster.api")

DRAIN_LIMIT_BYTES = 64 << 20  # read and drop at most this much of an oversized body
REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int, count: Callable[[str, int], None],
                 endpoints: frozenset[str], echo_request_id: bool = True):
        self.app, self.echo_request_id = app, echo_request_id
        self.max_body_bytes = max_body_bytes
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
            body = await self._read_body(scope, receive)
            if isinstance(body, APIError):
                await self._send_error(body, send_with_id)
                return
            await self.app(scope, _replay(body, receive), send_with_id)
        except Exception:
            log.exception("request %s failed", request_id)
            if not status:
                await self._send_error(internal_error(request_id), send_with_id)
        finally:
            path = scope.get("path", "")
            self.count(path if path in self.endpoints else "other", status[0] if status else 500)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | APIError:
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
                             f"at most {self.max_body_bytes}", code="request_too_large")

    @staticmethod
    async def _drain(receive: Receive, seen: int) -> None:
        while seen < DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    @staticmethod
    async def _send_error(error: APIError, send: Send) -> None:
        response = error.response()
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
