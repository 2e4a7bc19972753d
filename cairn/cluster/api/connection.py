"""The in-process server's HTTP/1.1 connection: uvicorn's h11 protocol, with a header size limit
and a deadline for each request's headers, which uvicorn does not offer.

uvicorn closes a kept-alive connection that stays idle `timeout_keep_alive` seconds, but arms
that timer only once a response is complete: a connection that opens and sends nothing, or half a
request line and headers, is held forever, and its headers may grow without bound (with
httptools, uvicorn's default parser). `GuardedH11Protocol` keeps these rules:
- A request's line and headers must arrive whole within `header_timeout_s`, counted from the
  connection's opening or, on a kept-alive connection, from the request's first byte. Past it the
  connection is closed, after a 408 if part of a request had arrived.
- They may take at most `max_header_bytes` (h11's incomplete-event limit): past it, a 431 and
  the connection is closed. Any other malformed request is a 400, also closing it.
- Every such answer is in OpenAI's error shape (`cairn.cluster.api.api_errors`).
The body is the app's to time (`RequestGuard`), since only the app reads it.

`uvicorn_config(app, limits)` is the `uvicorn.Config` of every in-process server.
"""

from __future__ import annotations

import asyncio
import functools
import json
from http import HTTPStatus
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cairn.cluster.api.api_errors import APIError
from cairn.cluster.api.http_limits import HTTPLimits


class _Connection(h11.Connection):
    """h11's connection, remembering why it last refused the peer (its status hint: 431 for
    headers over the limit)."""

    refused: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.refused = e
            raise


class GuardedH11Protocol(H11Protocol):
    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: HTTPLimits):
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.conn = _Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_deadline is None:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its headers are in (or the connection failed)
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        """What uvicorn calls for any request h11 refuses."""
        refused = self.conn.refused
        if refused is not None and refused.error_status_hint == 431:
            self._refuse(431, f"the request line and headers are over {self.limits.max_header_bytes} bytes",
                         "headers_too_large")
        else:
            self._refuse(400, "not a valid HTTP/1.1 request", "invalid_http_request")

    def _arm(self) -> None:
        self._disarm()
        self._header_deadline = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # a request began, and stalled
            self._refuse(408, f"the request's headers did not arrive within {self.limits.header_timeout_s:g} s",
                         "request_timeout")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Writes an error response by hand (h11 is in no state to) and closes the connection."""
        self._disarm()
        body = json.dumps(APIError(status, message, code=code).body()).encode()
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()


def uvicorn_config(app: Any, limits: HTTPLimits | None = None, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's config for `app` with `limits` (default: HTTPLimits()) on every connection."""
    limits = limits or HTTPLimits()
    return uvicorn.Config(app, http=functools.partial(GuardedH11Protocol, limits=limits),  # type: ignore[arg-type]
                          timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
                          **kwargs)
