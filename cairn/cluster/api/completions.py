"""POST /v1/completions: raw prompts (text or token ids, one or a batch), no template.

Choice `k * n + i` is the i-th of n choices for prompt k. `echo` puts the prompt's text in
front of each choice (and shifts `text_offset` by its length); echo with logprobs would need
the prompt's logprobs and is refused. Logprobs come in the legacy shape: tokens,
token_logprobs, top_logprobs (one dict per token) and text_offset. vLLM's `structured_outputs`
constrains each choice (`structured`; raw prompts have no thinking to leave free).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.responses import Response

from cairn.cluster.api.choice import MIN_LOGPROB, Choice, PlacedLogprob
from cairn.cluster.api.api_errors import bad_request
from cairn.cluster.api.protocol import CompletionRequest
from cairn.cluster.api.reply import Reply
from cairn.cluster.api.responses import Completion, CompletionChoice, CompletionLogprobs
from cairn.cluster.api.serving import Endpoint, Prepared
from cairn.cluster.api.structured import structured_outputs_grammar
from cairn.cluster.api.tenants import Caller
from cairn.cluster.api.text_tokenizer import TextTokenizer


def completion_logprobs(tokenizer: TextTokenizer, placed: list[PlacedLogprob], base: int) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[tokenizer.token_text(p.logprob.token_id) for p in placed],
        token_logprobs=[max(p.logprob.logprob, MIN_LOGPROB) for p in placed],
        top_logprobs=[{tokenizer.token_text(t): max(lp, MIN_LOGPROB) for t, lp in p.logprob.top} for p in placed],
        text_offset=[base + p.text_offset for p in placed])


class Completions(Endpoint):
    async def __call__(self, req: CompletionRequest, request_id: str, arrived: float,
                       client_gone: Callable[[], Awaitable[None]], caller: Caller = Caller()) -> Response:
        s = self.serving
        s.check_common(req)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (it may only equal n)", "best_of", "unsupported")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs is not supported", "echo", "unsupported")
        prompts = await s.pool.run(lambda stop: s.prompts.completion(req, stop), client_gone, caller.tenant_id)
        max_tokens = min(s.max_tokens(req, len(p.ids), "prompt") for p in prompts)
        constraint = structured_outputs_grammar(req.structured_outputs)
        grammar = None
        if constraint is not None:
            await s.grammars.check(*constraint, client_gone, caller.tenant_id)
            grammar = s.grammars.grammar(constraint[1], None, reasoning_model=False)
        params = s.sampling(req, max_tokens, req.logprobs, {}, grammar)
        choices = [Choice(k * req.n + i, s.tokenizer, p.ids, req.stop_strings())
                   for k, p in enumerate(prompts) for i in range(req.n)]
        echoes = [self._echo(req, p) for p in prompts for _ in range(req.n)]
        fan, first = await s.start(request_id, req, prompts, params, caller, "prompt",
                                   "n" if len(prompts) == 1 else "prompt", arrived)
        reply = Reply(s, req, request_id, prompts, choices, fan, first, arrived, caller, "cmpl")

        def logprobs(c: Choice, placed: list[PlacedLogprob]) -> CompletionLogprobs | None:
            return completion_logprobs(s.tokenizer, placed, len(echoes[c.index])) if req.logprobs is not None else None

        if req.stream:
            return reply.stream(Completion, lambda c: [CompletionChoice(index=c.index, text=echoes[c.index])]
                                if echoes[c.index] else [],  # the echo first, where there is one
                                lambda c, d: [CompletionChoice(index=c.index, text=d.content,
                                                               logprobs=logprobs(c, d.logprobs),
                                                               finish_reason=d.finish_reason)])
        return await reply.whole(client_gone, Completion, lambda c: CompletionChoice(
            index=c.index, text=echoes[c.index] + c.content, finish_reason=c.finish_reason,
            logprobs=logprobs(c, c.logprobs)))

    def _echo(self, req: CompletionRequest, prompt: Prepared) -> str:
        if not req.echo:
            return ""
        return prompt.text if prompt.text is not None else self.serving.tokenizer.decode(prompt.ids)
