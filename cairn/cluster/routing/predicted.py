"""Predicted holders: what this router sent where, standing in for what the index has not said.

Right after routing, the chosen replica is taken to hold the prompt's pages, and for a hybrid
model states where the request will leave them: the depths the ranker names (its message starts
and its end, past where it resumes there), never merely where another prompt parts from it; a
replica that resumed a prompt deep holds no state at the shallower message starts it skipped.
Two readers use that record (`cairn.cluster.routing.ranker`):
- for `predicted_holder_ttl_s`, always, so a burst sharing a new prefix sticks together before
  the replica's events reach the index;
- for `fallback_memory_s`, only while the index cannot answer (down, slow, restarting, a stale
  mirror), so a conversation's next turn still finds its replica.
The record is a guess: it cannot see evictions, which is why the long memory stands in only
while the index is unavailable. Plain Python; the clock is injectable.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence


class PredictedHolders:
    """What this router sent where: each replica recently sent a prompt is taken to hold its pages
    (and a state at their end). A hash names its whole prefix, so a replica's predicted depth for a
    prompt is the deepest of its hashes recorded for that replica. Records are kept for
    `keep_s` (at most `max_hashes` hashes in all, oldest dropped first); `pages` reads only those
    younger than the age it is given: the fresh ones (the index has not heard of them yet) or,
    when the index cannot answer, everything remembered. One flat dict per replica (hash -> time
    last recorded), so a large memory is a handful of objects for the garbage collector."""

    def __init__(self, keep_s: float, clock: Callable[[], float] = time.monotonic, max_hashes: int = 1_000_000):
        self.keep_s, self._clock, self._max = keep_s, clock, max_hashes
        self._at: dict[str, dict[bytes, float]] = {}  # replica -> hash -> when last recorded
        self._states: dict[str, dict[bytes, float]] = {}  # replica -> hash a state ends at -> when
        self._subs: dict[str, dict[bytes, float]] = {}  # replica -> a prompt end's sub-page state key -> when
        self._log: deque[tuple[float, str, list[bytes], list[bytes], list[bytes]]] = deque()
        self._size, self._last = 0, float("-inf")

    def record(self, replica: str, page_hashes: Sequence[bytes], state_pages: Iterable[int] | None = None,
               sub_keys: Sequence[bytes] = ()) -> None:
        """`replica` was sent a prompt of `page_hashes`; it will hold a state at each depth (pages)
        of `state_pages` (None: at every page, as a model without recurrent layers resumes), and
        the sub-page states named by `sub_keys` (its end, inside a page: `subs`)."""
        if self.keep_s <= 0 or not page_hashes or self._max <= 0:
            return
        at = self._last = max(self._clock(), math.nextafter(self._last, math.inf))  # distinct: a record's identity
        held = self._at.setdefault(replica, {})
        for h in page_hashes:
            held[h] = at
        ends = [] if state_pages is None else [page_hashes[j - 1] for j in set(state_pages)
                                                if 1 <= j <= len(page_hashes)]
        if ends:
            states = self._states.setdefault(replica, {})
            for h in ends:
                states[h] = at
        if sub_keys:
            subs = self._subs.setdefault(replica, {})
            for h in sub_keys:
                subs[h] = at
        self._log.append((at, replica, list(page_hashes), ends, list(sub_keys)))
        self._size += len(page_hashes)
        self._purge()

    def pages(self, page_hashes: Sequence[bytes], max_age_s: float, states: bool = False
              ) -> dict[str, tuple[int, int]]:
        """replica -> (predicted hit pages, predicted state pages) for this prompt from records
        younger than `max_age_s` (absent: none); without `states`, the state is taken to be at
        the hit. A record holds every page of its prompt and a newer one overwrites the time, so
        a replica's fresh pages along a prompt are a prefix of it: its depth is found by
        bisection, O(replicas x log pages); its deepest state by a walk back from there."""
        self._purge()
        if not page_hashes:
            return {}
        since, out = self._clock() - max_age_s, {}
        for replica, held in self._at.items():
            at = held.get(page_hashes[0])
            if at is None or at <= since:
                continue
            lo, hi = 1, len(page_hashes)  # fresh at depth lo; not beyond hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                at = held.get(page_hashes[mid - 1])
                if at is not None and at > since:
                    lo = mid
                else:
                    hi = mid - 1
            state = lo
            if states:
                ends = self._states.get(replica, {})
                while state and not ends.get(page_hashes[state - 1], since) > since:
                    state -= 1
            out[replica] = (lo, state)
        return out

    def subs(self, keys: Sequence[bytes], max_age_s: float) -> dict[str, list[int]]:
        """replica -> the indices of `keys` (sub-page state keys) it was sent a prompt ending at,
        in records younger than `max_age_s`."""
        self._purge()
        since, out = self._clock() - max_age_s, {}
        for replica, held in self._subs.items():
            found = [i for i, k in enumerate(keys) if held.get(k, since) > since]
            if found:
                out[replica] = found
        return out

    def forget(self, replica: str) -> None:
        self._at.pop(replica, None)  # its log entries are skipped as they age out
        self._states.pop(replica, None)
        self._subs.pop(replica, None)

    def _purge(self) -> None:
        since = self._clock() - self.keep_s
        while self._log and (self._log[0][0] <= since or self._size > self._max):
            at, replica, hashes, ends, subs = self._log.popleft()
            self._size -= len(hashes)
            for table, keys in ((self._at, hashes), (self._states, ends), (self._subs, subs)):
                held = table.get(replica)
                if held is None:
                    continue
                for h in keys:
                    if held.get(h) == at:
                        del held[h]
                if not held:
                    del table[replica]
