"""How deep a prompt hits on a worker, and where that worker would resume it (design rule 4).

One home for the rule every scorer and the engine share: for a prompt of n tokens, `hit_pages`
is the longest run of its pages resident on the worker, `state_pages` the deepest state
checkpoint at or under that run, and the worker resumes at

    resume_at_token = min(pages * page_size, n - 1),  pages = state_pages (recurrent model)
                                                               or hit_pages (attention only)

so the last prompt token is always computed (its logits pick the first output token). The
prefix cache resumes there (`workers.prefix_cache`), the index and its mirrors score with
`walk_scores`, and the router turns a score into a resume point with `resume_at_token`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerScore:
    """hit_pages: longest k with page_hashes[0:k] all resident on the worker.
    state_pages: deepest j in 1..hit_pages with a state at page_hashes[j-1] there, 0 if none."""
    hit_pages: int
    state_pages: int


ZERO = WorkerScore(0, 0)


def resume_at_token(hit_pages: int, state_pages: int, num_prompt_tokens: int, page_size: int,
                    recurrent: bool) -> int:
    """Tokens a worker holding (hit_pages, state_pages) of a prompt skips: the resume point."""
    pages = state_pages if recurrent else hit_pages
    return max(0, min(pages * page_size, num_prompt_tokens - 1))


def walk_scores(masks: Iterable[tuple[int, int]], trusted: int, bits: dict[str, int]) -> dict[str, WorkerScore]:
    """Scores from the prompt's (page mask, state mask) pairs, in prompt order; `bits` maps every
    known worker to its bit, `trusted` masks those that may score. Consumes `masks` only while
    some trusted worker still matches (a lazy iterable stops fetching there)."""
    alive, depth = trusted, 0
    ends: list[tuple[int, int]] = []   # (hit_pages, workers whose run ends there)
    marks: list[tuple[int, int]] = []  # (j, alive workers with a state at page j-1)
    if alive:
        for page_mask, state_mask in masks:
            here = page_mask & alive
            if here != alive:
                ends.append((depth, alive & ~here))
                alive = here
                if not alive:
                    break
            depth += 1
            s = state_mask & alive
            if s:
                marks.append((depth, s))
    if alive:
        ends.append((depth, alive))
    out = {}
    for worker, bit in bits.items():
        m = 1 << bit
        hit = next((d for d, ended in ends if ended & m), 0)
        state = next((j for j, s in reversed(marks) if s & m), 0) if marks else 0
        out[worker] = WorkerScore(hit, state) if hit else ZERO
    return out
