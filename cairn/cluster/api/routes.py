"""The OpenAI-compatible HTTP API: `build_app(client, model_dir, ...)` returns the FastAPI app.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/ID], GET /health
(the server is up), GET /ready (an engine takes requests: 200, else 503), GET /metrics
(Prometheus text), GET /openapi.json. With API keys (`cairn.cluster.api.tenants`: by
argument or CAIRN_API_KEY) the /v1 ones need `Authorization: Bearer <key>` of a tenant, which
roots that request's page hashes and is held to its quotas (`request.state.caller`,
`cairn.cluster.api.quotas`); /metrics and /openapi.json need a key
too (the metrics key, if one is set, for /metrics); /health and /ready never do. The same app runs
in-process over one engine (`LocalEngineClient`) and as the Ray Serve ingress (the cluster's
client): it knows engines only through `EngineClient`.

A body is parsed here, not by FastAPI: bytes that are not UTF-8, not JSON, or not an object
are a 400 with what is wrong; then the pydantic model checks fields strictly (400 naming the
field). A body of `PARSE_ON_LOOP_BYTES` or more is parsed on the preparation threads
(`prep_pool`), within the tenant's share of them. See `cairn.cluster.api.api_errors` for the error shape,
`cairn.cluster.api.middleware` for the body limit (413), the body deadline (408), the header limit
behind a proxy (431) and the last-resort 500, and `cairn.cluster.api.http_limits` for where each HTTP
limit is enforced.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from cairn.cluster.api.chat_completions import ChatCompletions
from cairn.cluster.api.chat_template import ChatTemplate, TemplateError
from cairn.cluster.api.completions import Completions
from cairn.cluster.api.engine_client import EngineClient
from cairn.cluster.api.api_errors import APIError, bad_request, from_validation, install_error_handlers
from cairn.cluster.api.limits import DEFAULT_LIMITS, APILimits
from cairn.cluster.api.api_metrics import CONTENT_TYPE, APIMetrics, TimedClient
from cairn.cluster.api.middleware import RequestGuard
from cairn.cluster.api.api_options import APIOptions
from cairn.cluster.api.prompt_images import PromptImages
from cairn.cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from cairn.cluster.api.responses import ModelCard, ModelList
from cairn.cluster.api.serving import Serving
from cairn.cluster.api.quotas import TenantQuotas
from cairn.cluster.api.tenants import DEFAULT_TENANT, Caller, Tenants
from cairn.cluster.api.text_tokenizer import TextTokenizer

PARSE_ON_LOOP_BYTES = 64 << 10  # bodies below this are parsed on the event loop (well under a millisecond)
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready",
                       "/metrics", "/openapi.json"})

M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], body: bytes, limits: APILimits = DEFAULT_LIMITS) -> M:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object", code="invalid_body")
    try:
        return model.model_validate_json(text, context={"limits": limits})
    except ValidationError as e:
        raise from_validation(e.errors(include_url=False)) from None


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read; what comes next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _unauthorized(what: str) -> APIError:
    return APIError(401, f"missing or wrong {what}; send Authorization: Bearer <key>", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _tenant_check(tenants: Tenants, shared_cache: bool):
    """/v1: who is asking and whose cache they use (`request.state.caller`, a `Caller`)."""
    async def check(request: Request) -> None:
        request.state.caller = Caller()
        if not tenants:
            return
        tenant = tenants.tenant_of(_bearer(request))
        if tenant is None:
            raise _unauthorized("API key")
        request.state.caller = Caller(tenant, None if shared_cache else tenant)
    return check


def _key_check(*allowed: Tenants):
    """Open when no key is configured in `allowed`; else a key of one of them."""
    async def check(request: Request) -> None:
        token = _bearer(request)
        found = [keys.tenant_of(token) for keys in allowed if keys]  # every set asked: no early answer
        if found and all(tenant is None for tenant in found):
            raise _unauthorized("key")
    return check


def build_app(client: EngineClient, model_dir: str | Path, options: APIOptions | None = None, *,
              tenants: Tenants | None = None, api_key: str | None = None, metrics_key: str | None = None,
              metrics_key_digest: str | None = None) -> FastAPI:
    """The API over `client`; the tokenizer and chat template come from `model_dir`; everything
    else it is told is `options` (`cairn.cluster.api.api_options.APIOptions`). Keys (`cairn.cluster.api.tenants`):
    `api_key` is one key of the tenant "default", `tenants` any number (give one or the other;
    neither: CAIRN_API_KEY, else no keys); `metrics_key` (or its `metrics_key_digest`,
    `tenants.key_digest`) alone opens /metrics."""
    options = options or APIOptions()
    if api_key is not None and tenants is not None:
        raise ValueError("give api_key or tenants, not both")
    tenants = Tenants([(DEFAULT_TENANT, api_key)]) if api_key is not None else tenants or Tenants.load()
    metrics_keys = Tenants([("metrics", metrics_key)] if metrics_key else [],
                           [("metrics", metrics_key_digest)] if metrics_key_digest else [])
    operators = metrics_keys or tenants  # who may read /metrics (everyone's traffic)
    readers = (tenants, metrics_keys) if tenants else ()  # /openapi.json: whoever may call /v1, and operators
    http_limits = options.http_limits
    name = options.served_model_name or Path(model_dir).name
    try:
        template: ChatTemplate | None = ChatTemplate.from_dir(model_dir)
    except TemplateError:
        template = None  # completions still work; chat answers 400
    metrics = APIMetrics()
    quotas = None
    if tenants:  # without keys everyone is one tenant, bounded by the server's queue alone
        defaults = options.tenant_limits
        quotas = TenantQuotas(defaults, {t: defaults.merged(v) for t, v in tenants.limits.items()}, metrics)
    serving = Serving(TimedClient(client, metrics), TextTokenizer.from_dir(model_dir), template, name, options, metrics,
                      quotas, PromptImages.from_dir(model_dir, options))
    chat, completions = ChatCompletions(serving), Completions(serving)

    app = FastAPI(title="cairn", summary="OpenAI-compatible API for hybrid LLMs with prefix caching",
                  docs_url=None, redoc_url=None, openapi_url=None)  # /openapi.json: below, behind a key
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=options.max_body_bytes, count=metrics.count_request,
                       endpoints=ENDPOINTS, echo_request_id=options.echo_request_id,
                       max_header_bytes=http_limits.max_header_bytes, body_timeout_s=http_limits.body_timeout_s)
    app.state.serving, app.state.metrics = serving, metrics  # metrics: what a cluster exports

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if await client.ready():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "starting", "message": "no engine takes requests yet"}, status_code=503)

    @app.get("/metrics", dependencies=[Depends(_key_check(operators))])
    async def prometheus() -> Response:
        return Response(metrics.render(await client.metrics()), media_type=CONTENT_TYPE)

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(_key_check(*readers))])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_tenant_check(tenants, options.shared_cache_tenants))])

    @v1.get("/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=name, max_model_len=client.spec.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @v1.get("/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {name!r}", "model",
                           "model_not_found")
        return JSONResponse(ModelCard(id=name, max_model_len=client.spec.max_model_len).model_dump(mode="json"))

    async def parsed(model: type[M], request: Request) -> M:
        """The body as `model`; a large one is parsed on the preparation threads, in the caller's
        share of them, so a tenant's flood of large bodies does not hold the event loop."""
        body = await request.body()
        if len(body) < PARSE_ON_LOOP_BYTES:
            return parse_body(model, body, options.api_limits)
        return await serving.pool.run(lambda stop: parse_body(model, body, options.api_limits), lambda: _client_gone(request),
                                      request.state.caller.tenant_id)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.monotonic()
        req = await parsed(ChatCompletionRequest, request)
        return await chat(req, request.state.request_id, arrived, lambda: _client_gone(request),
                          request.state.caller)

    @v1.post("/completions")
    async def text_completions(request: Request) -> Response:
        arrived = time.monotonic()
        req = await parsed(CompletionRequest, request)
        return await completions(req, request.state.request_id, arrived, lambda: _client_gone(request),
                                 request.state.caller)

    app.include_router(v1)
    return app
