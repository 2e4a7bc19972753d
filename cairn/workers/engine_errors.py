"""The engine's errors, grouped by who must act (design rule 9).

- `RequestRejected`: the request is at fault (a bad sampling value, a prompt too long, a token
  out of the vocabulary). It carries `param`, the request field at fault, so the API names it
  without reading the message; a `ValueError`, so plain callers need nothing new.
  `SamplingParamError` is the one a `SamplingParams` field raises: its `field` and `reason` apart,
  so a layer that calls the field otherwise names it its own way.
- `EngineError`: an internal fault while a request ran; not the caller's doing.
- `EngineBroken`: an `EngineError` after which the engine cannot run any request (a
  tensor-parallel rank was lost): every request it holds fails, later ones are refused, and
  its replica reports itself unhealthy so that Serve replaces it. A client should retry. The
  ingress raises it too for a request whose replica was lost (`cairn.cluster.ingress`).
- `SequenceFault`: what went wrong for one sequence inside a step (its sampling, its logits, its
  stop check, one of its cache operations). The engine ends that sequence alone, with
  `finish_reason` "error" and the fault's message; every other sequence of the step goes on.

Running out of pages or state slots is neither: the scheduler waits or preempts.
"""

from __future__ import annotations


class RequestRejected(ValueError):
    """The engine refuses this request. `param`: the field at fault (a `SamplingParams` field,
    `prompt`, `page_hashes`, `hash_root`, `checkpoint_hints` or `request_id`); `message`: what is
    wrong, for the client."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param

    def __reduce__(self):  # keeps `param` across processes (Ray)
        return type(self), (self.message, self.param)


class SamplingParamError(RequestRejected):
    """A `SamplingParams` field out of its range. `field`: the field (also `param`); `reason`: what
    it must be and what it got, "must be in [0, 2], got 3"; the message is the two joined."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field} {reason}", field)
        self.field, self.reason = field, reason

    def __reduce__(self):
        return type(self), (self.field, self.reason)


class EngineError(RuntimeError):
    """An internal fault while a request was running (not the caller's doing)."""


class EngineBroken(EngineError):
    """The engine can no longer run anything; retry the request elsewhere (or later)."""


class SequenceFault(Exception):
    """One sequence's part of a step failed; the message says where, for its client."""
