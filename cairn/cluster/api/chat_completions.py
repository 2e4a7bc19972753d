"""POST /v1/chat/completions: messages through the model's chat template, reasoning and tool calls split out.

Each choice's text is split into `reasoning_content` (what the model wrote inside
`<think>…</think>`) and `content`, for reasoning models (a tokenizer with those tags). With
`tools` (and `tool_choice` not none), the calls the model writes in its content become
`tool_calls` in its format (`tool_calls`, `tool_call_formats`), content is null when nothing else
is left, and finish_reason is "tool_calls". `tool_choice` none hides the tools from the template
and parses nothing; auto is the default; required (one call or more) and a named function (one
call to it; a name not among `tools` is a 400) constrain the output to calls in the family's
format whose arguments match the tools' schemas, and tools with `strict: true` constrain every
call made to them (`tool_grammar`). With auto, every call is kept well formed (any JSON object
as arguments for a tool that is not strict), so that calls stream their arguments as written,
unless `response_format` or `structured_outputs` constrains the content instead (then calls are
parsed as written, and given out whole once they parse). `parallel_tool_calls: false` keeps only the first call, and
a constrained output makes only one. `response_format` and `structured_outputs` constrain the
content (`structured`); one source of constraint per request.
Streaming (`reply`: the usage chunk, `[DONE]`, a fault as an error event) sends a role delta per
choice first, then content / reasoning / tool-call deltas (one tool-call item a chunk) with their
tokens' logprobs, and each choice's finish_reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from starlette.responses import Response

from cairn.cluster.api.choice import MIN_LOGPROB, Choice, Delta, PlacedLogprob
from cairn.cluster.api.api_errors import bad_request
from cairn.cluster.api.protocol import ChatCompletionRequest, NamedToolChoice
from cairn.cluster.api.reasoning import ReasoningParser
from cairn.cluster.api.reply import Reply
from cairn.cluster.api.responses import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta,
                               ChatLogprobs, ChatMessageOut, TokenLogprob, TopLogprob)
from cairn.cluster.api.serving import Endpoint
from cairn.cluster.api.structured import response_format_grammar, structured_outputs_grammar
from cairn.cluster.api.tenants import Caller
from cairn.cluster.api.text_tokenizer import TextTokenizer
from cairn.cluster.api.tool_calls import ToolCallParser
from cairn.cluster.api.tool_grammar import CONSTRAINED_FORMATS, tool_grammar


def chat_logprobs(tokenizer: TextTokenizer, placed: list[PlacedLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        raw = tokenizer.token_bytes(token_id)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=max(logprob, MIN_LOGPROB),
                          bytes=list(raw))

    return ChatLogprobs(content=[
        TokenLogprob(**top(p.logprob.token_id, p.logprob.logprob).model_dump(),
                     top_logprobs=[top(t, lp) for t, lp in p.logprob.top])
        for p in placed])


class ChatCompletions(Endpoint):
    async def __call__(self, req: ChatCompletionRequest, request_id: str, arrived: float,
                       client_gone: Callable[[], Awaitable[None]], caller: Caller = Caller()) -> Response:
        s = self.serving
        s.check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        check_tools(req)
        content = [response_format_grammar(req.response_format), structured_outputs_grammar(req.structured_outputs)]
        tool_constraint = self._tool_grammar(req, content_constrained=any(content))
        constraint = one_constraint(content + [tool_constraint])
        if constraint is not None:
            await s.grammars.check(*constraint, client_gone, caller.tenant_id)
        prompt = await s.pool.run(lambda stop: s.prompts.chat(req, stop), client_gone, caller.tenant_id)
        name, _ = req.requested_max_tokens()
        max_tokens = s.max_tokens(req, len(prompt.ids), "messages")
        grammar = None if constraint is None else s.grammars.grammar(constraint[1], prompt, s.reasoning_model)
        params = s.sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                           {"max_tokens": name, "logprobs": "top_logprobs"}, grammar)
        choices = [Choice(i, s.tokenizer, prompt.ids, req.stop_strings(),
                          ReasoningParser(prompt.opens_think) if s.reasoning_model else None,
                          self._tool_parser(req, stream_arguments=tool_constraint is not None))
                   for i in range(req.n)]
        fan, first = await s.start(request_id, req, [prompt], params, caller, "messages", "n", arrived)
        reply = Reply(s, req, request_id, [prompt], choices, fan, first, arrived, caller, "chatcmpl")
        if req.stream:
            return reply.stream(ChatCompletionChunk, opening, lambda c, d: self._chunk_choices(req, c, d))
        return await reply.whole(client_gone, ChatCompletion, lambda c: ChatChoice(
            index=c.index, finish_reason=c.finish_reason,
            message=ChatMessageOut(content=None if c.tool_calls and not c.content else c.content,
                                   reasoning_content=c.reasoning or None,
                                   tool_calls=[call.message() for call in c.tool_calls] or None),
            logprobs=chat_logprobs(s.tokenizer, c.logprobs) if req.logprobs else None))

    def _tool_grammar(self, req: ChatCompletionRequest, content_constrained: bool) -> tuple[str, str] | None:
        """(field, grammar) of the request's tool calls, or None: forced calls and calls to strict
        tools match their schemas; with tool_choice auto every call is at least well formed (so
        that its arguments can stream), unless response_format or structured_outputs constrains
        the content instead."""
        choice, fmt = req.tool_choice, self.serving.tool_format
        forced = choice == "required" or isinstance(choice, NamedToolChoice)
        strict = any(t.function.strict for t in req.tools or ())
        if not req.tools or choice == "none":
            return None
        field = "tool_choice" if forced else "tools"
        if fmt not in CONSTRAINED_FORMATS:
            if forced or strict:
                raise bad_request("this model has no tool-call format to constrain calls to", field, "unsupported")
            return None
        if not (forced or strict) and content_constrained:
            return None
        import llguidance

        tools = {t.function.name: (t.function.parameters, bool(t.function.strict)) for t in req.tools}
        mode = "named" if isinstance(choice, NamedToolChoice) else "required" if forced else "auto"
        text = tool_grammar(fmt, tools, mode, parallel=req.parallel_tool_calls is not False,
                            name=choice.function.name if isinstance(choice, NamedToolChoice) else None,
                            tag_ids=self.serving.grammars.tag_ids)
        return field, llguidance.LLMatcher.grammar_from_lark(text)

    def _tool_parser(self, req: ChatCompletionRequest, stream_arguments: bool) -> ToolCallParser | None:
        fmt = self.serving.tool_format
        if not req.tools or req.tool_choice == "none" or fmt == "none":
            return None
        return ToolCallParser(fmt, {t.function.name: t.function.parameters or {} for t in req.tools},
                              max_calls=1 if req.parallel_tool_calls is False else None,
                              stream_arguments=stream_arguments)

    def _chunk_choices(self, req: ChatCompletionRequest, c: Choice, d: Delta) -> Iterator[ChatChunkChoice]:
        """A delta's chunk choices: its content, reasoning and first tool-call item, then one
        chunk choice per further item; the last carries the finish_reason, the first the logprobs."""
        calls = d.tool_calls
        deltas = [ChatDelta(content=d.content or None, reasoning_content=d.reasoning or None,
                            tool_calls=calls[:1] or None)]
        deltas += [ChatDelta(tool_calls=[item]) for item in calls[1:]]  # one tool-call item per chunk
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            yield ChatChunkChoice(
                index=c.index, finish_reason=d.finish_reason if last else None, delta=delta,
                logprobs=chat_logprobs(self.serving.tokenizer, d.logprobs) if k == 0 and req.logprobs and d.logprobs
                else None)


def opening(c: Choice) -> list[ChatChunkChoice]:
    """A streamed choice's first chunk choice: the assistant's role, empty content."""
    return [ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))]


def one_constraint(found: list[tuple[str, str] | None]) -> tuple[str, str] | None:
    """The request's one (field, grammar); a second source is a 400 naming it."""
    given = [c for c in found if c is not None]
    if len(given) > 1:
        raise bad_request(f"a request takes one constraint on its output; this one also has {given[0][0]}",
                          given[1][0])
    return given[0] if given else None


def check_tools(req: ChatCompletionRequest) -> None:
    """400s for tools the request cannot have: a function defined twice, a call forced to a
    function not among them."""
    names: set[str] = set()
    for i, tool in enumerate(req.tools or ()):
        if tool.function.name in names:
            raise bad_request(f"function {tool.function.name!r} is defined twice", f"tools[{i}].function.name")
        names.add(tool.function.name)
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not among tools",
                          "tool_choice")
    if choice == "required" and not req.tools:
        raise bad_request("tool_choice required needs tools", "tool_choice")
