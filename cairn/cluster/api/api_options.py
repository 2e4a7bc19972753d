"""The API's options: one model, passed whole from the CLI and the deploy config to the app.

`APIOptions` holds everything `build_app` is told beyond the engine client, the model directory
and the keys: the name clients see, the body and queue bounds, the per-request limits
(`cairn.cluster.api.limits.APILimits`), the HTTP limits (`cairn.cluster.api.http_limits.HTTPLimits`), the
tenants' quotas (`cairn.cluster.api.quotas.TenantLimits`), cache sharing among tenants, the
special-token opt-out, the tool-call format and the request timeout. Keys are never options:
they travel apart (`build_app(tenants=..., api_key=..., metrics_key=...)`, or as digests to
the cluster's ingress), since options are logged where they are deployed. Validated on
construction: a bad value is a `ValueError` naming the field, at deploy rather than per request.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cairn.cluster.api.http_limits import HTTPLimits
from cairn.cluster.api.limits import APILimits
from cairn.cluster.api.quotas import TenantLimits
from cairn.cluster.api.tool_call_formats import resolve_format

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_WAITING = 256


class APIOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str | None = Field(
        None, description="The model's name for clients (default: the model directory's or Hugging Face id's).")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, description="Largest request body (413 past it).")
    max_waiting: int = Field(DEFAULT_MAX_WAITING, ge=1, description="Engine requests waiting for their first "
                             "token before new ones get 503 (in process; a cluster bounds its queues in Serve).")
    echo_request_id: bool = Field(True, description="Answer with an X-Request-Id header (off behind Serve's proxy, "
                                  "which sends its own).")
    api_limits: APILimits = Field(default_factory=APILimits, description="What one request may ask before the engine.")
    http_limits: HTTPLimits = Field(default_factory=HTTPLimits, description="The HTTP limits the app enforces.")
    tenant_limits: TenantLimits = Field(default_factory=TenantLimits, description="Every tenant's quotas (kept only "
                                        "with keys; a keys file may give a tenant its own).")
    shared_cache_tenants: bool = Field(False, description="Root every tenant's pages together.")
    public_system_prompts: tuple[str, ...] = Field((), description="System prompts whose pages every tenant shares "
                                                   "when a chat opens with one.")
    special_tokens_in_content: bool = Field(False, description="Let special-token strings in messages become "
                                            "control tokens (cairn.cluster.api.special_tokens).")
    tool_call_parser: str = Field("auto", description="How the model writes tool calls: auto, qwen3_json, "
                                  "qwen3_xml, none (cairn.cluster.api.tool_call_formats).")
    request_timeout_s: float | None = Field(None, gt=0, description="The longest a request may run from its "
                                            "arrival (a 408); None: no limit.")
    image_url_allow: tuple[str, ...] = Field((), description="URL prefixes an image_url may name besides data: "
                                             "URLs, each ending in '/': http(s)://host/path/ or file:///dir/ "
                                             "(none by default: a server that fetches any URL is an SSRF hole).")
    image_fetch_timeout_s: float = Field(10.0, gt=0, description="The longest one allowed image URL may take to "
                                         "read (a 400 past it).")

    @field_validator("image_url_allow")
    @classmethod
    def _whole_prefixes(cls, prefixes: tuple[str, ...]) -> tuple[str, ...]:
        for p in prefixes:
            scheme, _, rest = p.partition("://")
            where = rest.split("/")[0] if scheme in ("http", "https") else rest.strip("/") if scheme == "file" else ""
            if not where or not p.endswith("/") or (scheme == "file" and not rest.startswith("/")):
                raise ValueError(f"image_url_allow: {p!r} must be http(s)://host/... or file:///dir/... (not the "
                                 f"root), ending in '/'")
        return prefixes

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        resolve_format(value, None)  # a ValueError naming the choices
        return value
