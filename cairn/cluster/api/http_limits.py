"""What one HTTP connection may cost the server: header size, and how long it may take to send.

`HTTPLimits` holds the numbers; who enforces each depends on who owns the connection:

| limit | in-process (`cairn.cluster.api.server`) | behind Ray Serve's proxy |
|---|---|---|
| `max_header_bytes` | `GuardedH11Protocol`: 431, connection closed | the proxy reads any size; the ingress (`RequestGuard`) answers 431 |
| `header_timeout_s` | `GuardedH11Protocol`: 408 if a request began, connection closed | not offered by Serve |
| `body_timeout_s` | `RequestGuard`: 408, connection closed | `RequestGuard`, the same |
| `keep_alive_timeout_s` | uvicorn's `timeout_keep_alive` | Serve's `http_options.keep_alive_timeout_s` |
| `stream_stall_timeout_s` | `SSEResponse`: the stream ends, its engine requests are aborted, connection closed | not seen: the proxy buffers a stream for a client that does not read, for up to `http_options.request_timeout_s` |

The body cap is `APIOptions.max_body_bytes` (`RequestGuard`, 413). Every refusal the app or
our protocol writes is in OpenAI's error shape (`cairn.cluster.api.api_errors`); the proxy's own answers
are plain text and cannot be shaped: a 408 past `http_options.request_timeout_s` (a whole
request, stream included; a client may lift it with an `x-request-timeout-seconds` header, which
the proxy obeys), a 503 when no replica can take the request.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HTTPLimits(BaseModel):
    """Limits on one HTTP request's headers and on how long a client may take to send it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_header_bytes: int = Field(32 << 10, gt=0, description=(
        "The request line and headers, in bytes: past it, 431 and the connection is closed."))
    header_timeout_s: float = Field(10.0, gt=0, description=(
        "Seconds a client has to send a request's line and headers, counted from the connection's "
        "opening or, on a kept-alive connection, from the request's first byte."))
    body_timeout_s: float = Field(60.0, gt=0, description=(
        "Seconds a client has to send a request's whole body, counted from the end of its headers: "
        "past it, 408 and the connection is closed."))
    stream_stall_timeout_s: float = Field(30.0, gt=0, description=(
        "Seconds a streamed response waits for its client to take output: past it, the stream "
        "ends, its engine requests are aborted and their sequences freed."))
    keep_alive_timeout_s: float = Field(5.0, gt=0, description=(
        "Seconds an idle connection is kept open between requests (in-process only; behind Serve "
        "it is http_options.keep_alive_timeout_s)."))
