"""One request as the engine tracks it: its tokens, how far they are computed, what it holds.

Token accounting, in tokens: `token_ids` = prompt + generated; `num_computed` tokens have their
KV in pages and their effect in the state slot; the next step computes from there. A sequence
samples when a step brings `num_computed` to `len(token_ids)`.

Holdings: `page_ids` (one per started page, in order) and `state_slot` (or None). Both are
returned to their pools when the sequence finishes, is aborted or is preempted; a preempted
sequence keeps its tokens and recomputes them later (`num_computed` back to its resume point).

Prefix cache (units: pages): `page_hashes` is the sequence's hash chain over its whole pages
(prompt and output, extended as pages fill); the first `shared_pages` pages came from the cache
and are never written; `registered_pages` are named in the cache. `ckpt_targets` maps page
boundaries of the prompt to the checkpoint kinds that want them; `pending_slot` holds the state
at `pending_page`, the last boundary crossed, stored as a finish checkpoint when it ends.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from workers.sampling_params import SamplingParams

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    page_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival))
    max_total_tokens: int = 0  # prompt + max output, capped by the model's length
    # prefix cache
    hash_root: bytes = b""
    page_hashes: list[bytes] = field(default_factory=list)
    hints: tuple[int, ...] = ()  # token positions the ingress marked (message starts)
    shared_pages: int = 0
    registered_pages: int = 0
    register_stopped: bool = False
    resumed_from: tuple[bytes, int] | None = None  # (checkpoint hash, depth in pages)
    ckpt_targets: dict[int, set[str]] = field(default_factory=dict)
    pending_slot: int | None = None
    pending_page: int | None = None
    finish_admitted: bool | None = None
    admitted_once: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
