"""How many image tokens one step may encode (`EngineOptions.max_image_tokens_per_step`): the
vision tower runs before the language model in the step that first computes an image's tokens,
so one request with many images would otherwise hold every other sequence's decode behind them.

`ImageBudget(limit)`, one per step plan: `cut(seq, start, n)` returns how many of the `n` tokens
from `start` the step may compute. Each image of `seq` whose first token falls in the chunk takes
its token count from the step's budget; the chunk ends before the first image that does not fit.
The step's first image always fits, however large (a step must make progress). Images a chunk
begins past (cut earlier: the encoder holds them) take nothing. Plain Python.
"""

from __future__ import annotations


class ImageBudget:
    def __init__(self, limit: int, merge_size: int):
        self.left, self.merge_size, self.used = limit, merge_size, False

    def cut(self, seq, start: int, n: int) -> int:
        for image in seq.images:
            first = image.first_token
            if first < start:
                continue
            if first >= start + n:
                break
            tokens = image.num_tokens(self.merge_size)
            if self.used and tokens > self.left:
                return first - start
            self.left -= tokens
            self.used = True
        return n
