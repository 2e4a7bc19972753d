"""Errors in OpenAI's shape, grouped by who must act (design rule 9).

Every error body is `{"error": {"message", "type", "param", "code"}}`. The client's fault is
4xx with a message that says what to change and `param` naming the field (a dotted path such
as `messages[2].role`); a request over a size limit is 413 (or 400 for a parameter list) with
code `limit_exceeded`, its message giving the value and the limit. Come back later: a full
queue is 429, no free thread to prepare the request is 503, both with Retry-After; a request that
ran past the operator's end-to-end limit is 408 `request_timeout`. Our own
fault is 500 with a generic message and the request id, the traceback going to the log under
that id, never to the client; an engine that broke (a tensor-parallel rank lost, or its replica
lost with its process or node) is 503 `engine_unavailable` with Retry-After: its replica is being
replaced. A client that left is logged as 499.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cairn.cluster.api.limits import LIMIT_EXCEEDED
from cairn.cluster.api.responses import ErrorInfo, ErrorResponse
from cairn.workers.engine_errors import EngineBroken

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}
CLIENT_CLOSED_REQUEST = 499  # the status logged for a request whose client left (nginx's convention)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def client_closed() -> APIError:
    """The client left before its answer: the status is for the logs and metrics; no one reads it."""
    return APIError(CLIENT_CLOSED_REQUEST, "the client closed the request", code="client_closed")


def request_timed_out(limit_s: float) -> APIError:
    """The request ran past the operator's end-to-end limit (`request_timeout_s`), which a client's
    `x-request-timeout-seconds` header cannot lift."""
    return APIError(408, f"this request ran past this server's limit of {limit_s:g} s from its arrival; ask for "
                         f"fewer tokens, or fewer choices", code="request_timeout")


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"internal server error (request id {request_id})", code="internal_error")


def engine_unavailable(request_id: str) -> APIError:
    """The engine running the request broke (`workers.EngineBroken`: a tensor-parallel rank lost, or
    the replica itself): nothing the client did; the replica is being replaced, so a retry succeeds."""
    return APIError(503, f"the engine serving this request failed and is being replaced; retry the request "
                         f"(request id {request_id})", code="engine_unavailable", headers={"Retry-After": "1"})


def fault(request_id: str, e: BaseException) -> APIError:
    """The error a client gets for an engine fault: 503 (retry) if the engine broke, else 500."""
    return engine_unavailable(request_id) if isinstance(e, EngineBroken) else internal_error(request_id)


def _is_field(part: str | int) -> bool:
    """A location part that names a field (ours are snake_case), not a union member's type tag
    such as `str`, `list[int]` or `TextPart`."""
    return isinstance(part, int) or (re.fullmatch(r"[a-z_][a-z0-9_]*", part) is not None
                                     and part not in ("str", "int", "float", "bool", "dict", "list", "none"))


def _path(loc: Sequence[str | int]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
    return path


def param_path(loc: Sequence[str | int]) -> str | None:
    """The field a pydantic error location names, as a path (`messages[2].role`); a union's
    member errors name the union field itself."""
    fields = []
    for part in loc:
        if not _is_field(part):
            break
        fields.append(part)
    return _path(fields) or None


def from_validation(errors: Sequence[dict[str, Any]]) -> APIError:
    """A 400 naming the field; of a union's member errors, the deepest says the most. A request
    over one of `limits.APILimits` gets that limit's status (413 or 400) instead."""
    if any(e.get("type") == "json_invalid" for e in errors):
        msg = next(e for e in errors if e.get("type") == "json_invalid").get("msg", "")
        return bad_request(f"request body is not valid JSON: {msg}", code="invalid_json")
    over = next((e for e in errors if e.get("type") == LIMIT_EXCEEDED), None)
    if over is not None:
        ctx = over.get("ctx", {})
        return APIError(ctx["status"], over["msg"], ctx.get("param") or param_path(over.get("loc", ())),
                        LIMIT_EXCEEDED)
    worst = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = worst.get("loc", ())
    param = param_path(loc)
    if param is None and worst.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        return bad_request("request body must be a JSON object", code="invalid_body")
    msg = str(worst.get("msg", "invalid value")).removeprefix("Value error, ")
    where = _path([p for p in loc if _is_field(p)])
    return bad_request(f"{where}: {msg}" if where else msg, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped bodies for our errors, FastAPI's validation errors and Starlette's 404/405
    (anything else is the outermost `RequestGuard`'s 500)."""
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc.errors()).response()

    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
