"""When drafts pay (`EngineOptions.speculative_adaptive`): `SpeculationGate` measures decode steps
with drafts and without at each load and says, before each step, whether its sequences draft.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


class SpeculationGate:
    """Whether the running sequences draft for the next step (`speculative_adaptive`): drafts pay
    only where a verify step's tokens per second beat a plain decode step's at the same load. A
    verify step computes 1 + k rows a sequence and runs the head k times; where a step's cost grows
    with its rows (a CPU, or a GPU past its memory-bound batch sizes) that can cost more than the
    kept tokens give. Measured, not assumed: for each bucket of running sequences (a power of two),
    the tokens per second of decode-only steps with drafts and without, each way's rate the median
    of its last `WINDOW` steps (the first step of each left out: it pays the compiles of its
    shapes), so that one step slowed by something else (another process, a collection) decides
    nothing; a bucket lacking either tries it. Then the faster way is taken, and the other tried
    for `PROBE` steps after `REPROBE` steps, so that its rate follows the load and the acceptance
    as they change; each try that leaves the choice as it was doubles the wait before the next (up
    to `MAX_REPROBE`), one that changes it resets it. While the gate is closed, decode-only steps
    skip the head too (`Verifier.verify`): its K/V at their positions stays as it was, and drafting
    after them reads it so; the gate then measures what such drafts are worth."""
    REPROBE, MAX_REPROBE = 32, 1024
    WINDOW = 8  # steps a way's rate is the median of
    PROBE = 2  # steps a try of the other way takes

    def __init__(self):
        self._samples: dict[tuple[int, bool], deque] = {}  # (bucket, drafted) -> the last tokens/s
        self._seen: dict[tuple[int, bool], int] = {}  # (bucket, drafted) -> steps observed
        self._choices: dict[int, _Choice] = {}  # bucket -> its choice and when the other way is tried

    @staticmethod
    def _bucket(running: int) -> int:
        return 1 << max(running - 1, 0).bit_length()

    def rate(self, running: int, drafted: bool) -> float | None:
        """Tokens per second of decode-only steps at this load, with drafts or without (None:
        not measured yet)."""
        samples = self._samples.get((self._bucket(running), drafted))
        return statistics.median(samples) if samples else None

    def drafting(self, running: int) -> bool:
        bucket = self._bucket(running)
        drafted, plain = self.rate(running, True), self.rate(running, False)
        if drafted is None:
            return True
        if plain is None:
            return False
        better = drafted > plain
        choice = self._choices.get(bucket)
        if choice is None or (choice.trying == 0 and better != choice.drafting):
            # a first choice, or it changed: try the other way soon (again)
            choice = self._choices[bucket] = _Choice(better, self.REPROBE, self.REPROBE)
        if choice.trying > 0:
            choice.trying -= 1
            return not choice.drafting
        choice.until -= 1
        if choice.until > 0:
            return better
        choice.wait = min(2 * choice.wait, self.MAX_REPROBE)
        choice.until, choice.trying = choice.wait, self.PROBE - 1
        return not better

    def observe(self, running: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `running` sequences (`drafted`: it verified drafts) gave `tokens`
        in `seconds`."""
        if seconds <= 0 or not running:
            return
        key = self._bucket(running), drafted
        self._seen[key] = seen = self._seen.get(key, 0) + 1
        if seen == 1:  # the first such step at a new shape pays its compiles: not a measure
            return
        self._samples.setdefault(key, deque(maxlen=self.WINDOW)).append(tokens / seconds)


@dataclass
class _Choice:
    """A bucket's choice (`SpeculationGate`): drafting or not, the steps until the other way is
    tried, the wait that set them, and the steps of a try of the other way left."""
    drafting: bool
    until: int
    wait: int
    trying: int = 0
