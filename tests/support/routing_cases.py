"""Requests and configs the routing tests share: a routing config for a large hybrid model's
page and state sizes, page hashes, requests as the ingress makes them, a ranking shorthand and an
injectable clock."""

from __future__ import annotations

import itertools
import random

from cairn.cache_service.scoring import WorkerScore
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.cluster.routing.cost import rank_replicas
from cairn.workers.request import GenerateRequest


PAGE = 16
PAGE_BYTES, STATE_BYTES = 2 << 20, 64 << 20  # a large hybrid model's page and state, in bytes
CFG = RoutingConfig(page_size=PAGE, recurrent=True, page_bytes=PAGE_BYTES, state_bytes=STATE_BYTES,
                    load_weight=0.5, request_load_tokens=256, occupancy_load_tokens=2048,
                    spill_limit=4, predicted_holder_ttl_s=2.0, index_mode="remote", index_timeout_ms=50,
                    fetch=False)  # the cost rule without fetch; the tests of fetch turn it on
H = [bytes([i]) * 16 for i in range(200)]

_ids = itertools.count()


def routed(page_hashes: list[bytes] | None, num_prompt_tokens: int, prompt: str | None = "hello",
           messages: list | None = None) -> GenerateRequest:
    """A request as the ingress makes it, with `num_prompt_tokens` tokens and these page hashes."""
    return GenerateRequest(f"req-{next(_ids)}", [0] * num_prompt_tokens, prompt=prompt, messages=messages,
                           page_hashes=None if page_hashes is None else list(page_hashes))


def request(pages: int, extra_tokens: int = 5) -> GenerateRequest:
    return routed(H[:pages], pages * PAGE + extra_tokens)


def rank(scores, loads=None, n=1000, config=CFG, replicas=("a", "b", "c"), seed=0):
    """`scores`: replica -> WorkerScore fields, (hit_pages, state_pages) alone meaning all on the device."""
    scores = {r: WorkerScore(*s) for r, s in scores.items()}
    return rank_replicas(list(replicas), scores, loads or {}, config, n, random.Random(seed))



class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
