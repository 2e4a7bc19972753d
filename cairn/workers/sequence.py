"""One request as the engine tracks it: its tokens, how far they are computed, how it ends.

Token accounting, in tokens: `token_ids` = prompt + generated; `num_computed` tokens have their
KV in pages and their effect in the state slot; the next step computes from there. A sequence
samples when a step brings `num_computed` to `len(token_ids)`. The scheduler alone writes
`num_computed` (the resume point at admission, a step's end afterwards, 0 on preemption).

What it holds in the cache (pages, state slot, hash chain, checkpoints to leave) is `cache`, a
`SequenceCache` that only the prefix cache writes. The request brings `hash_root` (the root of its
page-hash chain, salted by the ingress) and `hints` (token positions of message starts, where a
checkpoint may pay off). A preempted sequence keeps its tokens and recomputes them later.
Under speculative decoding, `draft` holds tokens proposed after `token_ids`: never part of them
until a verify step keeps them (cairn.workers.speculative).
A prompt with images (a vision-language model) carries them (`images`), their M-RoPE positions
(`rope`) and its cache keys (`prompt_keys`): the cache reads `cache_tokens`, never `token_ids`.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from cairn.workers.cache_tokens import CacheTokens
from cairn.workers.sampling_params import SamplingParams
from cairn.workers.sequence_cache import SequenceCache

_arrival = itertools.count()

PENDING = -1  # a sequence's token while a step that decodes it is planned before it is read (async scheduling)


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
    hash_root: bytes = b""
    hints: tuple[int, ...] = ()  # token positions the ingress marked (message starts)
    max_total_tokens: int = 0  # prompt + max output, capped by the model's length
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it failed (finish_reason "error"), for its client
    cached_tokens: int = 0  # tokens skipped at its first admission
    admitted_once: bool = False
    num_preemptions: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival))
    tenant: str | None = None  # who asked: the scheduler shares sequence slots among tenants with work
    added_at: float = field(default_factory=time.monotonic)
    queue_s: float | None = None  # seconds from added_at to its first admission
    paused: bool = False  # its reader is behind: while running, it is not scheduled (Engine.pause)
    cache: SequenceCache = field(default_factory=SequenceCache)
    grammar_state: object = None  # its place in its grammar (cairn.workers.grammar), from its first sampled step
    fetch_pending: bool = False  # a peer fetch for it is under way: the engine holds it back until it arrives
    grammar_pending: bool = False  # its grammar is still compiling: the engine holds it back until it is
    draft: list[int] = field(default_factory=list)  # tokens drafted after token_ids, to verify (cairn.workers.speculative)
    sample_key: int | None = None  # its draws' key without a seed: the sampler's, from its first sampled row
    draft_q: list = field(default_factory=list)  # without a seed: the distribution each drafted token was drawn from
    images: tuple = ()  # its prompt's images (cairn.workers.vision.image_input.ImageInput), in prompt order
    rope: object = None  # with images: their M-RoPE positions (cairn.workers.model.mrope.PromptPositions)
    prompt_keys: list[int] | None = None  # with images: the prompt as the cache keys it (image_input.prompt_keys)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def cache_tokens(self):
        """Its tokens as every cache path hashes and compares them: `token_ids` itself, or with
        images a view keying each image token by the image's content (cairn.workers.cache_tokens)."""
        return self.token_ids if self.prompt_keys is None else CacheTokens(self.token_ids, self.prompt_keys)

    def decodes_at(self, start: int) -> bool:
        """Whether one token from `start` runs as a decode row: always, but inside the prompt of a
        sequence with images, whose rows there need M-RoPE positions and image embeddings (a
        prefill segment gives them: cairn.workers.execution.image_rows)."""
        return self.rope is None or start >= len(self.prompt_token_ids)

    def rope_shift(self) -> int:
        """What a token past the prompt adds to its index for its rotary position (M-RoPE's delta)."""
        return 0 if self.rope is None else self.rope.delta

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
