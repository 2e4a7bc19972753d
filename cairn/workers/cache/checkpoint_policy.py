"""Where recurrent-state checkpoints go, and which kinds earn their keep (design rule 6).

Positions are token positions (a state after p tokens); under the `cairn` policy the first four
kinds below ask for their exact position, a sub-page checkpoint when it falls inside a page
(`cairn.workers.cache.checkpoint_store`), so that a prompt diverging there resumes at the divergence; the
baselines round them down to page boundaries (page j ends at token j * page_size). Kinds:
- `tail`: n - tail_guard of every prompt (the thinking-drop divergence lies a few tokens before
  the previous prompt's end, as in templates whose generation prompt opens a think block);
- `prompt_end`: n (templates that rewrite only what was generated, like Qwen3's: the
  divergence is the previous prompt's end itself);
- `hint`: positions the ingress passes (message starts, the first and the newest message's
  content, the generation prompt's start, and where the reply as the template writes it in
  history parts from the generation prompt), each also at the page boundary at or before it: a
  whole-page state, the one a peer's fetch exports (sub-page states move between the tiers, but
  a fetch carries whole-page ones);
- `content`: page boundaries inside the newest message's text (from the deepest hint before the
  prompt's tail to the tail), `content_pages` of them at most, evenly spread: a user who edits
  that message later parts from it at no position a template can name, and resumes at most a
  page short of the edit in a message of up to that many pages, a share of it in a longer one
  (a state per page of a long document would cost a slot per page);
- `finish`: the last boundary a sequence crossed before it finished, captured during decode
  (a client that echoes the whole turn extends it);
- `branch`: where a prompt's K/V hit (a partial page's included) runs deeper than its state hit,
  at the K/V hit: where it parted from the prompt it shares pages with;
- `interval`: every `interval_pages` pages of long prefills;
- `every` (baseline `all` only): every boundary, prefill and decode;
- `end` (baseline `exact` only): the request's end, usable only by a prompt that contains the
  whole finished sequence — today's "exact length or nothing" behaviour.

Each kind earns its keep under the `cairn` policy: hits served against checkpoints admitted,
decayed so a workload change shows, decide admission. A checkpoint is judged only once it has
settled (`settle_window` admission decisions later: `settle_after`, or how long nine in ten of
the recent hits took to come back, so that the next turns of the conversations in flight have
come back however many there are), so a kind is not refused while its first hits are still on
their way. A kind that does not pay is still admitted with a small exploration probability
(seeded, so runs repeat). Verdicts bind only under pressure: while the cache has a free slot that
no stored state would have to leave (`room`), every kind asked for is admitted, and judged all
the same, since a checkpoint there costs one state copy and evicts nothing. So one workload's
verdicts do not cost the next workload its hits while memory is to spare (a server running chats
with thinking dropped, then edits, kept refusing the kinds edits need). Baselines admit their
fixed kinds always. Before any is admitted, a prompt's targets are thinned (`thin`): near
positions of a hinted prompt fold into one, and under pressure only its end, its newest hint and
its branch points are taken. This module decides; it holds no slots and touches no tensor.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from cairn.workers.engine_options import CACHE_POLICIES

TAIL, PROMPT_END, HINT, CONTENT, FINISH, BRANCH, INTERVAL, EVERY, END = (
    "tail", "prompt_end", "hint", "content", "finish", "branch", "interval", "every", "end")
ALL_KINDS = (TAIL, PROMPT_END, HINT, CONTENT, FINISH, BRANCH, INTERVAL, EVERY, END)

# the kinds each of `cache_policy`'s values (engine_options.CACHE_POLICIES, every one) captures
POLICY_KINDS = {
    "cairn": frozenset({TAIL, PROMPT_END, HINT, CONTENT, FINISH, BRANCH, INTERVAL}),
    "exact": frozenset({END}),
    "all": frozenset({EVERY}),
    "interval": frozenset({INTERVAL, FINISH}),
    "end_branch": frozenset({FINISH, BRANCH}),
}
KNOWN = frozenset({HINT, BRANCH})  # kinds at a position where prompts are known to part
END_KINDS = frozenset({TAIL, PROMPT_END})  # a prompt's end: the next turn's resume
FINISH_KINDS = (FINISH, END)  # captured at decode crossings into one pending slot per sequence


@dataclass
class KindRecord:
    settled: float = 0.0  # admissions old enough to judge, decayed
    hits: float = 0.0  # decayed alongside
    total_admitted: int = 0
    total_hits: int = 0
    pending: deque[int] = field(default_factory=deque)  # clock of admissions not yet settled


@dataclass
class CheckpointPolicy:
    name: str = "cairn"
    tail_guard: int = 4  # tokens
    interval_pages: int = 32
    content_pages: int = 4  # `content` checkpoints a prompt asks for at most
    exploration: float = 0.05
    warmup: int = 8  # settled admissions of a kind before its hit rate is judged
    min_hit_rate: float = 0.1  # hits per settled checkpoint a kind must sustain
    decay: float = 0.98  # per settled admission of that kind: older evidence fades
    settle_after: int = 64  # admission decisions before a checkpoint's outcome is judged
    seed: int = 0
    records: dict[str, KindRecord] = field(default_factory=lambda: {k: KindRecord() for k in ALL_KINDS})

    def __post_init__(self) -> None:
        if self.name not in CACHE_POLICIES:
            raise ValueError(f"cache_policy must be one of {sorted(CACHE_POLICIES)}, got {self.name!r}")
        if not isinstance(self.tail_guard, int) or self.tail_guard < 0:
            raise ValueError(f"tail_guard must be an integer >= 0, got {self.tail_guard!r}")
        if not isinstance(self.interval_pages, int) or self.interval_pages < 1:
            raise ValueError(f"checkpoint_interval_pages must be an integer >= 1, got {self.interval_pages!r}")
        self.kinds = POLICY_KINDS[self.name]
        self._rng = random.Random(self.seed)
        self._clock = 0
        self._reuse: deque[int] = deque(maxlen=128)  # how long recent hits took to come back, in decisions
        self._window = 8 * self.settle_after  # settle_window, updated as hits come back

    @property
    def captures_finish(self) -> str | None:
        """The kind a finished sequence's last crossing is stored as (None: not captured)."""
        return next((k for k in FINISH_KINDS if k in self.kinds), None)

    def prompt_targets(self, n_tokens: int, page_size: int, resume_token: int, kv_tokens: int,
                       hints: tuple[int, ...] = ()) -> dict[int, set[str]]:
        """Token positions p (resume_token < p <= n_tokens) to checkpoint while this prompt is
        prefilled, with the kinds asking for each. Under `cairn`, `tail`, `prompt_end`, `hint`
        and `branch` ask for their exact position (sub-page checkpoints: a resume lands on the
        divergence, not on the page before it); the baselines round every one down to a page
        boundary, as the engines they stand for do."""
        exact = self.name == "cairn"
        wanted: dict[int, set[str]] = {}

        def want(pos: int, kind: str, exact_kind: bool = True) -> None:
            if not (exact and exact_kind):
                pos -= pos % page_size
            if kind in self.kinds and resume_token < pos <= n_tokens and pos > 0:
                wanted.setdefault(pos, set()).add(kind)

        tail = n_tokens - self.tail_guard
        want(tail, TAIL)
        want(n_tokens, PROMPT_END)
        for pos in hints:
            want(pos, HINT)
            want(pos, HINT, exact_kind=False)  # and its page boundary (module docstring)
        newest = max((pos for pos in hints if pos < tail), default=None)  # the newest message's text
        if newest is not None and exact:  # its pages, clear of the end and of what is wanted already
            pages = [j * page_size for j in range(newest // page_size + 1, (tail - self.tail_guard) // page_size + 1)
                     if j * page_size not in wanted]
            k = min(self.content_pages, len(pages))  # evenly spread, its first and last page among them
            for i in range(k):
                want(pages[round(i * (len(pages) - 1) / max(k - 1, 1))], CONTENT)
        if kv_tokens > resume_token:
            want(kv_tokens, BRANCH)
        for j in range(self.interval_pages, n_tokens // page_size + 1, self.interval_pages):
            want(j * page_size, INTERVAL)
        if EVERY in self.kinds:
            for j in range(resume_token // page_size + 1, n_tokens // page_size + 1):
                want(j * page_size, EVERY)
        return wanted

    def thin(self, targets: dict[int, set[str]], page_size: int, hinted: bool, pressure: bool) -> dict[int, set[str]]:
        """`targets` as they are worth taking. For a prompt with hints (the ingress knows its
        template), positions within `tail_guard` tokens of each other fold into one, kinds
        joined: at the deepest hint or branch point among them (where prompts are known to
        part: a message's content rather than its role header), else at the deepest (the
        template put its divergence elsewhere: the next prompt extends this one). So such a
        prompt's end is one checkpoint with the kinds of all that asked for it (`tail`,
        `prompt_end` and the reply's hint), which later prompts parting there keep warm
        (`PrefixCache`). A hint's page boundary stays apart (the whole-page state the host
        tier keeps and a fetch exports), with memory to spare, and so does a branch point asked
        for alone (a twin waits to resume exactly there); a position inside the first page is
        kept like any other (keyed by the chain's hash root: a new conversation parts from
        others past the first message's role header). Under `pressure` (each
        checkpoint then evicts about `slot_blocks` pages' worth of what is cached) only these
        are kept: the end (`tail` and `prompt_end`: the next turn's resume), the deepest other
        hint (the newest message's content: where users of one system prompt part, and where
        an edit of this turn will), and branch points; message starts further back, hints'
        page boundaries, the pages of the newest message's text and intervals go (those tokens cost a recompute when asked for, where
        keeping them costs the cached pages and states that the next turns of every
        conversation need). The baselines take their targets as they are."""
        if self.name != "cairn":
            return targets
        exact = [p for p, kinds in targets.items() if HINT in kinds and p % page_size]
        floors = {p for p, kinds in targets.items()
                  if kinds == {HINT} and not p % page_size and any(p < h < p + page_size for h in exact)}
        branches = {p for p, kinds in targets.items() if kinds == {BRANCH}}  # a twin waits there: exact
        contents = {p for p, kinds in targets.items() if kinds == {CONTENT}}  # apart, clear of the end
        order = sorted(p for p in targets if p not in floors and p not in branches and p not in contents and p > 0)
        folded: list[tuple[int, set[str]]] = [(p, targets[p]) for p in branches]
        i = 0
        while i < len(order):
            j = i
            while hinted and j + 1 < len(order) and order[j + 1] - order[i] <= self.tail_guard:
                j += 1
            cluster = order[i:j + 1]
            at = max((p for p in cluster if targets[p] & KNOWN), default=cluster[-1])
            folded.append((at, set().union(*(targets[p] for p in cluster))))
            i = j + 1
        if not pressure:
            return dict(folded + [(p, targets[p]) for p in floors | contents])
        ends = {pos for pos, kinds in folded if kinds & END_KINDS}
        newest = max((pos for pos, kinds in folded if pos not in ends and HINT in kinds), default=None)
        return {pos: kinds for pos, kinds in folded if pos in ends or pos == newest or BRANCH in kinds}

    def moves_on(self, kinds: set[str], position: int, hints: tuple[int, ...]) -> bool:
        """Whether a checkpoint of `kinds` at `position`, resumed from by a prompt with `hints`,
        goes cold once that prompt stores a deeper one (its conversation moved on). Under
        `cairn`, not one that is only a point where prompts part (a shared system prompt's end,
        a branch), nor one where the template says later prompts part too (an agent's query
        start); the baselines demote every one."""
        return self.name != "cairn" or (not kinds <= KNOWN and position not in hints)

    def reply_rewritten(self, num_prompt_tokens: int, hints: tuple[int, ...]) -> bool:
        """Under `cairn`: a hint at the prompt's end says the template rewrites the reply in
        history, so the next turn parts there, before anything decoded, and a finish capture
        under pressure is wasted. The baselines take their captures as ever."""
        return self.name == "cairn" and any(num_prompt_tokens - self.tail_guard <= h for h in hints)

    # ---- earning their keep ---------------------------------------------------------------
    def admit(self, kinds: set[str], room: bool = False) -> set[str]:
        """The subset of `kinds` admitted now; each admitted kind is charged one checkpoint.
        `room`: the cache has a free slot that evicts nothing (every kind is then admitted)."""
        self._clock += 1
        admitted = {k for k in kinds if self._admits(k) or (room and k in self.kinds)}
        for k in admitted:
            rec = self.records[k]
            rec.pending.append(self._clock)
            rec.total_admitted += 1
        return admitted

    def _admits(self, kind: str) -> bool:
        if self.name != "cairn":
            return kind in self.kinds
        rec = self.records[kind]
        while rec.pending and rec.pending[0] <= self._clock - self.settle_window:
            rec.pending.popleft()
            rec.settled = rec.settled * self.decay + 1.0
            rec.hits *= self.decay
        if rec.settled < self.warmup or rec.hits >= self.min_hit_rate * rec.settled:
            return True
        return self._rng.random() < self.exploration

    @property
    def clock(self) -> int:
        """Admission decisions so far (what a checkpoint is stamped with when stored)."""
        return self._clock

    @property
    def settle_window(self) -> int:
        """Admission decisions after which a checkpoint's outcome is judged: `settle_after`, or
        how long nine in ten of the last 128 hits took to come back if that is longer (64
        conversations in round robin come back later than a handful do; one old checkpoint hit
        late does not stretch it); before any hit has come back, eight times `settle_after`:
        nothing is refused for want of hits that cannot have arrived yet."""
        return self._window

    def record_hit(self, kinds: set[str], admitted_at: int | None = None) -> None:
        """A resume from a checkpoint of `kinds`, stamped `admitted_at` (`clock` when stored)."""
        if admitted_at is not None:  # the window moves here, not at each admission decision
            self._reuse.append(self._clock - admitted_at)
            self._window = max(self.settle_after, sorted(self._reuse)[len(self._reuse) * 9 // 10])
        for k in kinds:
            self.records[k].hits += 1.0
            self.records[k].total_hits += 1

    def summary(self) -> dict[str, dict[str, int]]:
        return {k: {"admitted": r.total_admitted, "hits": r.total_hits}
                for k, r in self.records.items() if k in self.kinds}
