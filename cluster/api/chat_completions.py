"""POST /v1/chat/completions: messages through the model's chat template, reasoning split out.

Each choice's text is split into `reasoning_content` (what the model wrote inside
`<think>…</think>`) and `content`, for reasoning models (a tokenizer with those tags).
Streaming sends a role delta per choice first, then content / reasoning deltas with their
tokens' logprobs, each choice's finish_reason, a usage chunk when `stream_options.include_usage`
asks for it, and `[DONE]`. A fault after the stream started is sent as an error event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable

from fastapi.responses import JSONResponse
from starlette.responses import Response

from cluster.api.choice import MIN_LOGPROB, Choice, PlacedLogprob
from cluster.api.errors import bad_request
from cluster.api.fanout import Fanout
from cluster.api.protocol import ChatCompletionRequest
from cluster.api.reasoning import ReasoningParser
from cluster.api.responses import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta,
                               ChatLogprobs, ChatMessageOut, TokenLogprob, TopLogprob, Usage)
from cluster.api.serving import CLIENT_CLOSED_REQUEST, Prepared, Serving
from cluster.api.sse import SSEResponse
from cluster.api.tokenizer import TextTokenizer


def chat_logprobs(tokenizer: TextTokenizer, placed: list[PlacedLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        raw = tokenizer.token_bytes(token_id)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=max(logprob, MIN_LOGPROB),
                          bytes=list(raw))

    return ChatLogprobs(content=[
        TokenLogprob(**top(p.logprob.token_id, p.logprob.logprob).model_dump(),
                     top_logprobs=[top(t, lp) for t, lp in p.logprob.top])
        for p in placed])


class ChatCompletions:
    def __init__(self, serving: Serving):
        self.serving = serving

    async def __call__(self, req: ChatCompletionRequest, request_id: str, arrived: float,
                       client_gone: Callable[[], Awaitable[None]], tenant: str | None = None) -> Response:
        s = self.serving
        s.check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        if not (req.tool_choice is None or req.tool_choice in ("none", "auto")):
            raise bad_request("only tool_choice none or auto is supported", "tool_choice", "unsupported")
        if req.response_format is not None and req.response_format.get("type", "text") != "text":
            raise bad_request("only response_format {type: text} is supported", "response_format", "unsupported")
        prompt = await s.pool.run(lambda stop: s.prompts.chat(req, stop), client_gone)
        name, _ = req.requested_max_tokens()
        max_tokens = s.max_tokens(req, len(prompt.ids), "messages")
        params = s.sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                           {"max_tokens": name, "logprobs": "top_logprobs"})
        s.admit(req.n)
        requests = s.engine_requests(request_id, req, [prompt], params, tenant)
        choices = [Choice(i, s.tokenizer, prompt.ids, req.stop_strings(),
                          ReasoningParser(prompt.opens_think) if s.reasoning_model else None)
                   for i in range(req.n)]
        fan, first = await s.start(requests, "messages")
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return SSEResponse(self._stream(req, completion_id, request_id, prompt, fan, first, choices, arrived))
        if not await s.collect(fan, first, choices, arrived, client_gone):
            self._count(prompt, choices, arrived)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        usage = Usage.of(*self._count(prompt, choices, arrived))
        body = ChatCompletion(id=completion_id, model=s.model_name, usage=usage, choices=[
            ChatChoice(index=c.index, finish_reason=c.finish_reason,
                       message=ChatMessageOut(content=c.content, reasoning_content=c.reasoning or None),
                       logprobs=chat_logprobs(s.tokenizer, c.logprobs) if req.logprobs else None)
            for c in choices])
        return JSONResponse(body.model_dump(mode="json"))

    def _count(self, prompt: Prepared, choices: list[Choice], arrived: float) -> tuple[int, int, int]:
        return self.serving.record([prompt], choices, arrived)

    def _stream(self, req: ChatCompletionRequest, completion_id: str, request_id: str, prompt: Prepared,
                fan: Fanout, first: tuple, choices: list[Choice], arrived: float) -> AsyncGenerator[str, None]:
        s = self.serving
        created = int(time.time())

        def chunk(parts: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return ChatCompletionChunk(id=completion_id, created=created, model=s.model_name, choices=parts,
                                       usage=usage).sse()

        async def events() -> AsyncGenerator[str, None]:
            for c in choices:
                yield chunk([ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))])
            async for c, d in s.drive(fan, first, choices, arrived):
                yield chunk([ChatChunkChoice(
                    index=c.index, finish_reason=d.finish_reason,
                    delta=ChatDelta(content=d.content or None, reasoning_content=d.reasoning or None),
                    logprobs=chat_logprobs(s.tokenizer, d.logprobs) if req.logprobs and d.logprobs else None)])

        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return s.stream(request_id, fan, events(), [prompt], choices, arrived,
                        (lambda usage: chunk([], usage)) if include_usage else None)
