"""How deep a prompt hits on a worker, and where that worker would resume it (design rule 4).

One home for the rule every scorer and the engine share: for a prompt of n tokens, `hit_pages`
is the longest run of its pages resident on the worker, `state_pages` the deepest state
checkpoint at or under that run, and the worker resumes at

    resume_at_token = min(pages * page_size, n - 1),  pages = state_pages (recurrent model)
                                                               or hit_pages (attention only)

so the last prompt token is always computed (its logits pick the first output token). Two
helpers name the rule's halves, and every other module calls them rather than writing them
again: `resume_pages` (which of the two counts) and `last_resumable_token` (the n - 1 cap),
with `last_resumable_page` for callers that count in pages. The prefix cache resumes there
(`cairn.workers.cache.lookup`), the index and its mirrors score with `walk_scores`, and the router
turns a score into a resume point with `resume_at_token`.

Media (`cairn.cache_service.events`): a hit counts pages in either medium. A score also says how much
of it is on the worker's device (`device_pages`, the longest run of the prompt's pages there) and
whether the state it resumes from is on the host (`state_on_host`), so the router can charge
what must be copied back before the worker resumes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerScore:
    """hit_pages: longest k with page_hashes[0:k] all resident on the worker (either medium).
    state_pages: deepest j in 1..hit_pages with a state at page_hashes[j-1] there, 0 if none.
    device_pages: longest k with page_hashes[0:k] all on the worker's device (<= hit_pages);
    None, the default, means hit_pages: a score built from two numbers is all on the device.
    state_on_host: the state at state_pages is in the worker's host memory.
    sub_tokens: a sub-page state the router found there (`held_states`), in tokens: the prompt's
    tokens before it, past state_pages' (0: none); sub_on_host: that state is in host memory."""
    hit_pages: int
    state_pages: int
    device_pages: int | None = None  # an int once made: None becomes hit_pages
    state_on_host: bool = False
    sub_tokens: int = 0
    sub_on_host: bool = False

    def __post_init__(self) -> None:
        if self.device_pages is None:
            object.__setattr__(self, "device_pages", self.hit_pages)


ZERO = WorkerScore(0, 0)


def resume_pages(hit_pages: int, state_pages: int, recurrent: bool) -> int:
    """How deep (pages) a worker holding (hit_pages, state_pages) of a prompt resumes, before the
    cap: a recurrent model needs a state there, an attention-only one its pages."""
    return state_pages if recurrent else hit_pages


def last_resumable_token(num_prompt_tokens: int) -> int:
    """The deepest resume point of a prompt: its last token is always computed."""
    return max(0, num_prompt_tokens - 1)


def last_resumable_page(num_prompt_tokens: int, page_size: int) -> int:
    """The deepest whole page a prompt can resume at (`last_resumable_token` in pages)."""
    return last_resumable_token(num_prompt_tokens) // page_size


def resume_at_token(hit_pages: int, state_pages: int, num_prompt_tokens: int, page_size: int,
                    recurrent: bool) -> int:
    """Tokens a worker holding (hit_pages, state_pages) of a prompt skips: the resume point."""
    pages = resume_pages(hit_pages, state_pages, recurrent)
    return max(0, min(pages * page_size, last_resumable_token(num_prompt_tokens)))


def score_resume_token(score: WorkerScore, num_prompt_tokens: int, page_size: int, recurrent: bool) -> int:
    """Where a worker scoring `score` resumes the prompt: `resume_at_token` of its pages, or a
    sub-page state deeper than that (a recurrent model), capped as every resume point is."""
    base = resume_at_token(score.hit_pages, score.state_pages, num_prompt_tokens, page_size, recurrent)
    if recurrent and score.sub_tokens > base:
        return min(score.sub_tokens, last_resumable_token(num_prompt_tokens))
    return base


def walk_scores(masks: Iterable[tuple[int, int, int, int]], trusted: int, bits: dict[str, int]
                ) -> dict[str, WorkerScore]:
    """Scores from the prompt's (page mask, state mask, host page mask, host state mask) per
    page, in prompt order (a host mask is the part of its mask in host memory); `bits` maps every
    known worker to its bit, `trusted` masks those that may score. Consumes `masks` only while
    some trusted worker still matches (a lazy iterable stops fetching there)."""
    alive = on_device = trusted  # on_device: alive workers whose run is still all on the device
    depth = 0
    ends: list[tuple[int, int]] = []          # (hit_pages, workers whose run ends there)
    device_ends: list[tuple[int, int]] = []   # (device_pages, workers whose device run ends there)
    marks: list[tuple[int, int, int]] = []    # (j, alive workers with a state at page j-1, those on host)
    if alive:
        for page_mask, state_mask, host_page_mask, host_state_mask in masks:
            here = page_mask & alive
            if here != alive:
                ends.append((depth, alive & ~here))
                alive = here
                if on_device & ~here:
                    device_ends.append((depth, on_device & ~here))
                    on_device &= here
                if not alive:
                    break
            if host_page_mask & on_device:
                device_ends.append((depth, host_page_mask & on_device))
                on_device &= ~host_page_mask
            depth += 1
            s = state_mask & alive
            if s:
                marks.append((depth, s, host_state_mask & s))
    if alive:
        ends.append((depth, alive))
    if on_device:
        device_ends.append((depth, on_device))
    out = {}
    for worker, bit in bits.items():
        m = 1 << bit
        hit = next((d for d, ended in ends if ended & m), 0)
        if not hit:
            out[worker] = ZERO
            continue
        device = next(d for d, ended in device_ends if ended & m)
        state, on_host = next(((j, bool(h & m)) for j, s, h in reversed(marks) if s & m), (0, False))
        out[worker] = WorkerScore(hit, state, device, on_host)
    return out


def held_states(masks: Iterable[tuple[int, int, int, int]], trusted: int, bits: dict[str, int]
                ) -> dict[str, list[tuple[int, bool]]]:
    """worker -> [(i, on host)] for each key i whose (page mask, state mask, host page mask, host
    state mask) says a trusted worker holds both a page and a state there: a sub-page state, which
    a worker announces as a page of its own after its floor with a state
    (`cairn.workers.cache.checkpoint_store.Checkpoint.index_key`)."""
    out: dict[str, list[tuple[int, bool]]] = {}
    for i, (page_mask, state_mask, _, host_state_mask) in enumerate(masks):
        held = page_mask & state_mask & trusted
        if held:
            for worker, bit in bits.items():
                if held >> bit & 1:
                    out.setdefault(worker, []).append((i, bool(host_state_mask >> bit & 1)))
    return out
