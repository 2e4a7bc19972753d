"""From a validated request to engine requests, and their outputs to choices (`reply` answers with them).

The ingress does its share of the prefix cache's work here, once per prompt: render the chat
template, tokenize and turn message starts into checkpoint hints (`prompts`, on the threads of
`prep_pool`, once `limits` have passed), and hash whole pages with the engine's root under the
request's cache_salt. Then it checks what only it can check (model name, context length with both
numbers, fields we cannot honour, queue room: 429 when full, 413 for a request that could never fit
the queue or makes more than `max_engine_requests`; the tenant's quotas, `quotas`), starts one
engine request per choice (`seed + i` for choice i; a sampling field left out keeps
`SamplingParams`' default), each carrying its tenant for the engine's fair scheduling, and waits
for the first output, so a request the engine refuses is still a 400 even when streaming. With
`request_timeout_s` (the operator's end-to-end limit) a request still running that long after its
arrival is ended: a 408 (`reply` makes it an error event in a stream), its engine requests
aborted; behind Serve's proxy this holds whatever `x-request-timeout-seconds` a client sends,
since the proxy obeys that header and the ingress does not. Prompt tokens are counted once per
prompt, completion tokens summed over choices; cached_tokens is a prompt's smallest over its
choices; each is counted for the tenant too, with each engine request's queue time. Both
endpoints are an `Endpoint`: a callable that holds the one `Serving`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cairn.cluster.api.chat_template import ChatTemplate
from cairn.cluster.api.choice import Choice, Delta
from cairn.cluster.api.engine_client import EngineClient
from cairn.cluster.api.api_errors import APIError, bad_request, request_timed_out
from cairn.cluster.api.fanout import Fanout
from cairn.cluster.api.api_metrics import APIMetrics
from cairn.cluster.api.api_options import APIOptions
from cairn.cluster.api.prep_pool import PrepPool
from cairn.cluster.api.prompt_images import PromptImages
from cairn.cluster.api.prompts import Prepared, Prompts
from cairn.cluster.api.protocol import SamplingFields
from cairn.cluster.api.quotas import Admission, TenantQuotas
from cairn.cluster.api.structured import GrammarCompiler
from cairn.cluster.api.tenants import Caller
from cairn.cluster.api.text_tokenizer import TextTokenizer
from cairn.cluster.api.tool_call_formats import resolve_format
from cairn.workers import MAX_SEED, RequestRejected, SamplingParamError, SamplingParams
from cairn.workers.grammar import Grammar
from cairn.workers.request import GenerateRequest

__all__ = ["Endpoint", "Prepared", "Serving"]

log = logging.getLogger("cairn.cluster.api")

# request fields that are `SamplingParams`' of the same name: one left out (or null) keeps its default there
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_tokens", "stop_token_ids")


class Serving:
    def __init__(self, client: EngineClient, tokenizer: TextTokenizer, template: ChatTemplate | None,
                 model_name: str, options: APIOptions, metrics: APIMetrics, quotas: TenantQuotas | None = None,
                 images: PromptImages | None = None):
        self.client, self.tokenizer = client, tokenizer
        self.stream_stall_timeout_s = options.http_limits.stream_stall_timeout_s  # SSEResponse's
        self.request_timeout_s = options.request_timeout_s  # from arrival to the last output; None: no limit
        self.model_name, self.max_waiting, self.metrics = model_name, options.max_waiting, metrics
        self.limits, self.quotas = options.api_limits, quotas
        self.prompts = Prompts(tokenizer, template, client.spec.vocab_size, options.special_tokens_in_content,
                               options.public_system_prompts, client.spec.max_model_len, images)
        self.reasoning_model = self.prompts.reasoning_model
        self.tool_format = resolve_format(options.tool_call_parser, template.source if template is not None else None)
        limits = options.api_limits
        self.pool = PrepPool(limits.prepare_threads, limits.prepare_wait_s, limits.prepare_threads_per_tenant)
        self.grammars = GrammarCompiler(tokenizer, client.spec.vocab_size, limits)

    # ---- checks shared by both endpoints -------------------------------------------------------
    def check_common(self, req: SamplingFields) -> None:
        if req.model != self.model_name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        self.logit_bias(req)

    def logit_bias(self, req: SamplingFields) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs; a key that is not a token id of this model is
        a 400 naming it (the biases' range is `SamplingParams`')."""
        vocab, out = self.client.spec.vocab_size, []
        for key, bias in (req.logit_bias or {}).items():
            token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
            if not 0 <= token < vocab:
                raise bad_request(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias")
            out.append((token, bias))
        return tuple(out)

    def max_tokens(self, req: SamplingFields, n_prompt: int, prompt_param: str) -> int:
        limit = self.client.spec.max_model_len
        if n_prompt >= limit:
            raise bad_request(f"prompt has {n_prompt} tokens; this model allows at most {limit - 1} "
                              f"(max_model_len {limit}, one left to generate)", prompt_param,
                              "context_length_exceeded")
        name, asked = req.requested_max_tokens()
        if asked is None or getattr(req, name) is None or name not in req.model_fields_set:
            return min(asked or limit, limit - n_prompt)  # a default (null too) never overflows the context
        if asked < 1:
            raise bad_request(f"{name} must be at least 1, got {asked}", name)
        if n_prompt + asked > limit:
            raise bad_request(f"this model's context is {limit} tokens; the request needs {n_prompt + asked} "
                              f"({n_prompt} in the prompt, {asked} to generate)", name, "context_length_exceeded")
        return asked

    def sampling(self, req: SamplingFields, max_tokens: int, logprobs: int | None,
                 names: dict[str, str], grammar: Grammar | None = None) -> list[SamplingParams]:
        out, bias = [], self.logit_bias(req)
        given = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
        for i in range(req.n):
            if req.seed is not None:
                seed = req.seed
                if 0 <= seed <= MAX_SEED:  # out of range: SamplingParams says so
                    seed = (seed + i) % (MAX_SEED + 1)
                given["seed"] = seed
            try:
                out.append(SamplingParams(max_tokens=max_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                                          logit_bias=bias, grammar=grammar, **given))
            except SamplingParamError as e:  # the API may call the field otherwise
                param = names.get(e.field, e.field)
                raise bad_request(f"{param} {e.reason}", param) from None
        return out

    def admit(self, count: int, param: str, caller: Caller, prompt_tokens: int) -> Admission | None:
        """Room for `count` engine requests of `prompt_tokens` prompt tokens in all: in one request
        (413), in the server's queue (429) and in the caller's quotas (429); what the quotas hold
        for it (None: no quotas)."""
        try:
            bound, name = min((self.max_waiting, "the server's queue"),
                              (self.limits.max_engine_requests, "max_engine_requests"))
            if count > bound:
                raise APIError(413, f"this request makes {count} engine requests (choices times prompts); this "
                                    f"server accepts at most {bound} ({name})", param, "limit_exceeded")
            waiting = self.client.num_waiting()
            if waiting + count > self.max_waiting:
                raise APIError(429, f"the server's queue is full ({waiting} requests waiting); retry later",
                               code="queue_full", headers={"Retry-After": "1"})
        except APIError as e:
            self.metrics.tenant_rejected(caller.label, e.code or str(e.status))
            raise
        if self.quotas is None or caller.tenant_id is None:
            self.metrics.tenant_admitted(caller.label)
            return None
        return self.quotas.admit(caller.tenant_id, count, prompt_tokens)

    def engine_requests(self, request_id: str, req: SamplingFields, prompts: list[Prepared],
                        params: list[SamplingParams], caller: Caller = Caller()) -> list[GenerateRequest]:
        """One engine request per (prompt, choice). Their ids are new, unique by construction:
        `request_id` (the client's X-Request-Id, or ours) is a label for logs and the client,
        never an engine key, so a reused label touches no other request. Page hashes are rooted
        in the tenant (who asked) and the request's cache_salt: tenants never share a page, but
        for the whole pages of a public system prompt opening an unsalted chat, which every
        tenant shares (`public_system_prompts`); where they end is a checkpoint hint (a state
        there is keyed by the last public page: every tenant resumes from it, and from nothing
        past it that another tenant computed)."""
        internal = uuid.uuid4().hex
        log.debug("request %s runs as engine requests %s-*", request_id, internal)
        spec, tenant = self.client.spec, caller.cache
        root = spec.hash_root(req.cache_salt, tenant)
        out = []
        for p_index, p in enumerate(prompts):
            public = p.public_tokens // spec.page_size if req.cache_salt is None and tenant is not None else 0
            hashes = spec.page_hashes(p.keys or p.ids, root, shared_pages=public)  # images: keyed by content
            hints = p.hints
            if public and len(p.ids) // spec.page_size > public:  # the state where the public pages end,
                hints = sorted({*hints, public * spec.page_size})  # keyed by the last of them: every tenant's
            for i, sp in enumerate(params):
                out.append(GenerateRequest(
                    request_id=f"{internal}-{p_index * len(params) + i}", prompt_token_ids=p.ids, params=sp,
                    prompt=p.text, messages=p.messages, hash_root=root, page_hashes=hashes,
                    checkpoint_hints=hints, tenant=caller.tenant_id, images=p.images, prompt_keys=p.keys))
        return out

    # ---- running -----------------------------------------------------------------------------
    async def _next(self, fan: Fanout, arrived: float) -> tuple[int, Any] | None:
        """The next output of `fan`, or None at its end; past the request's deadline, a 408."""
        limit = self.request_timeout_s
        if limit is None:
            return await anext(fan, None)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + limit - (time.monotonic() - arrived)):
                return await anext(fan, None)
        except TimeoutError:
            raise request_timed_out(limit) from None

    async def start(self, request_id: str, req: SamplingFields, prompts: list[Prepared],
                    params: list[SamplingParams], caller: Caller, prompt_param: str, count_param: str,
                    arrived: float) -> tuple[Fanout, tuple[int, Any]]:
        """Admits the engine requests of `prompts` times `params` (`admit`), starts them and waits
        for the first output (or the engine's refusal: a 400 naming `stop_token_ids`, or else the
        prompt under `prompt_param`)."""
        admission = self.admit(len(prompts) * len(params), count_param, caller, sum(len(p.ids) for p in prompts))
        try:
            requests = self.engine_requests(request_id, req, prompts, params, caller)
        except BaseException:
            if admission is not None:
                admission.close()
            raise
        fan = Fanout(self.client, requests, admission)
        try:
            first = await self._next(fan, arrived)
            if first is None:
                raise RuntimeError("an engine stream ended without an output")
            return fan, first
        except RequestRejected as e:
            await fan.close()
            raise bad_request(e.message, "stop_token_ids" if e.param == "stop_token_ids" else prompt_param) from None
        except BaseException:
            await fan.close()
            raise

    async def drive(self, fan: Fanout, first: tuple[int, Any], choices: list[Choice], arrived: float,
                    caller: Caller) -> AsyncIterator[tuple[Choice, Delta]]:
        """Feeds outputs to their choices; yields (choice, delta) for each that adds something."""
        self.metrics.ttft.observe(time.monotonic() - arrived)
        item: tuple[int, Any] | None = first
        while item is not None:
            index, out = item
            if out.queue_s is not None:  # an engine request's first output
                self.metrics.tenant_queued(caller.label, out.queue_s)
            choice = choices[index]
            delta = choice.update(out)
            if choice.finished and not out.finished:
                await fan.close(index)
            if delta:
                yield choice, delta
            item = await self._next(fan, arrived)

    def record(self, prompts: list[Prepared], choices: list[Choice], arrived: float,
               caller: Caller) -> tuple[int, int, int]:
        """(prompt, completion, cached) tokens of the request, counted into the metrics, the
        caller's included, and its generated tokens charged to its tokens per minute."""
        per = len(choices) // len(prompts)
        prompt_tokens = sum(len(p.ids) for p in prompts)
        cached = sum(min(c.cached_tokens for c in choices[k * per:(k + 1) * per]) for k in range(len(prompts)))
        completion = sum(c.num_tokens for c in choices)
        self.metrics.observe_finished(prompt_tokens, cached, completion, time.monotonic() - arrived, caller.label)
        if self.quotas is not None and caller.tenant_id is not None:
            self.quotas.charge_tokens(caller.tenant_id, completion)
        return prompt_tokens, completion, cached


class Endpoint:
    """A generation endpoint over one `Serving` (`chat_completions`, `completions`): the routes
    await `endpoint(req, request_id, arrived, client_gone, caller)` for its response."""

    def __init__(self, serving: Serving):
        self.serving = serving
