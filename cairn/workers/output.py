"""What an engine hands back per step and per request: `RequestOutput`, and `outputs_of`, which
turns a step's applied tokens into one output a sequence. Plain data, no torch.
(The engine's running totals are `cairn.workers.engine_metrics.EngineTotals`.)"""

from __future__ import annotations

from dataclasses import dataclass

from cairn.workers.sequence import Sequence, TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: its new tokens, and on the last output (finished)
    every output token. Small on purpose: a step's outputs cross a process boundary (Ray) once per
    token, so nothing in them grows with the sequence except on the finished one."""
    request_id: str
    new_token_ids: list[int]  # output tokens produced by this step
    new_logprobs: list[TokenLogprob] | None  # one per new token, when asked
    num_output_tokens: int  # output tokens so far, these included
    cached_tokens: int
    finish_reason: str | None = None
    num_preemptions: int = 0
    worker_id: str = "local"  # the engine that produced it (its cache index worker id)
    token_ids: list[int] | None = None  # every output token: on the finished output only
    logprobs: list[TokenLogprob] | None = None  # every output token's, when asked: finished only
    error: str | None = None  # finish_reason "error": what failed, for the client
    queue_s: float | None = None  # seconds from `Engine.add` to its first admission: on its first token's output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, seq: Sequence, new: list[int], new_logprobs: list[TokenLogprob], worker_id: str) -> RequestOutput:
        """`seq`'s output for a step that produced `new` (maybe none: an abort, an error); a
        finished sequence's carries every output token, and its error."""
        asked = seq.params.logprobs is not None
        n_out = len(seq.token_ids) - len(seq.prompt_token_ids)
        out = cls(seq.request_id, new, new_logprobs if asked else None, n_out, seq.cached_tokens,
                  seq.finish_reason, seq.num_preemptions, worker_id, queue_s=seq.queue_s if n_out == len(new) and new else None)
        if seq.finish_reason is not None:
            out.token_ids = seq.output_token_ids
            out.logprobs = list(seq.logprobs) if asked else None
            out.error = seq.error
        return out


def outputs_of(applied: list, requests: dict, worker: str) -> list[RequestOutput]:
    """The outputs of the sequences `Scheduler.apply_tokens` gave tokens: one a sequence, with
    its tokens of the step in order (a verify step gives several). A finished one leaves
    `requests` (the engine's, by id); `worker`: the engine's id, stamped on each."""
    outputs = []
    i = 0
    while i < len(applied):
        seq, token, logprob = applied[i]
        i += 1
        new, logprobs = [token], [logprob] if logprob else []
        while i < len(applied) and applied[i][0] is seq:
            new.append(applied[i][1])
            if applied[i][2]:
                logprobs.append(applied[i][2])
            i += 1
        if seq.finish_reason is not None:
            requests.pop(seq.request_id, None)
            outputs.append(RequestOutput.of(seq, new, logprobs, worker))
        else:  # the common case, inline: one small object per request and step
            n_out = len(seq.token_ids) - len(seq.prompt_token_ids)
            outputs.append(RequestOutput(
                seq.request_id, new, None if seq.params.logprobs is None else logprobs,
                n_out, seq.cached_tokens, None, seq.num_preemptions, worker,
                queue_s=seq.queue_s if n_out == len(new) else None))
    return outputs
