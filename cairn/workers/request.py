"""The one request object, from the ingress to the engine, and the ask a peer fetch sends.

`GenerateRequest` is everything the ingress decided once: token ids, sampling, and the
prefix-cache inputs (the hash root salted with the request's cache_salt, the page hashes under
it, checkpoint hints at message starts), who asked (`tenant`), and the prompt text and messages,
which text-matching routers read. The router reads it and never writes it: its choice of replica
comes back beside a `FetchHint` (the replica resuming the request deepest, and how deep), which
the Serve adapter sends along as a copy of the request with `fetch` set. The replica hands the
request whole to its `EngineFront`, and the engine validates it (`Engine.add`).

`ExportRequest` is what a receiving replica asks of the holder a hint named
(`cairn.cluster.replica_peer_fetch`): pages [first, depth) of the prompt's chain and the checkpoint at
`depth`, routed to exactly `target_worker`.

Plain data: no torch, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cairn.workers.sampling_params import SamplingParams


@dataclass(frozen=True)
class FetchHint:
    holder: str  # the worker id of the replica resuming the request deepest
    depth: int  # its resume point, in pages
    tail: int = 0  # ... or, a sub-page state: this many tokens into the page after them


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt: str | None = None                      # the prompt text, for text-matching routers
    messages: list[dict[str, Any]] | None = None   # the chat messages it was rendered from
    hash_root: bytes | None = None                 # spec.hash_root(cache_salt); None: unsalted
    page_hashes: list[bytes] | None = None         # one per whole page, under hash_root
    checkpoint_hints: list[int] = field(default_factory=list)  # token positions of message starts
    tenant: str | None = None                      # who asked (None: no keys), for the engine's fair scheduling
    fetch: FetchHint | None = None                 # the router's (routing config `fetch`): who holds it deepest
    images: list[Any] = field(default_factory=list)  # the prompt's (cairn.workers.vision.image_input.ImageInput)
    prompt_keys: list[int] | None = None  # with images: the prompt as the cache keys it (what page_hashes hash)

    @property
    def cache_tokens(self) -> list[int]:
        """The prompt as the cache keys it: what routers name sub-page states by."""
        return self.prompt_keys if self.prompt_keys is not None else self.prompt_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class ExportRequest:
    """Pages [first, depth) of a prompt's chain and the checkpoint at `depth` (with `tail`: the
    sub-page one `tail` into the next page, and that page's head), asked of the replica
    `target_worker` (the router routes it there and nowhere else)."""
    target_worker: str
    page_hashes: list[bytes]
    first: int
    depth: int
    tail: tuple[int, ...] = ()  # a sub-page state's tokens after page `depth`, asked for with the
    root: bytes | None = None   # head of the page they begin (under the request's hash root)
    before: tuple[int, ...] = ()  # page `depth - 1`'s tokens: the holder may answer with a state in it
