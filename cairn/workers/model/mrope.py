"""M-RoPE positions of a prompt with images (Qwen3.5 / 3.6's interleaved multimodal rotary), on the
host, in Python and numpy: `kernels.qk_norm_rope(..., rope_axes=)` applies them.

Axes: 0 temporal, 1 height, 2 width. `rope_axes(mrope_section, rotary_dim)`: for each of the
rotary_dim / 2 frequencies, the axis whose position it turns by. Interleaved, as transformers'
`Qwen3_5TextRotaryEmbedding` assigns them: frequency i is height where i % 3 == 1 and
i < 3 * section[1], width where i % 3 == 2 and i < 3 * section[2], temporal otherwise.

Positions (`PromptPositions`), as transformers' `Qwen3_5Model.get_rope_index` gives them:
- a text token has one position on all three axes: the first is at 0, the next one past it;
- an image (`ImageSpan`: its first placeholder token, its patch grid (t, h, w)) takes
  t * (h/m) * (w/m) tokens, m the spatial merge size, frame by frame, each frame row-major over
  the merged grid. With `start` the position a text token there would have had, token (f, r, c)
  is at (start + f * temporal_stride, start + r, start + c);
- text after an image goes on at start + max(h/m, w/m): t does not count (transformers 5.25; its
  images have t = 1, and it splits a video into frames of t = 1 between timestamp tokens);
- `delta` (tokens) = the prompt's largest position + 1 - its length (an image of more frames than
  merged rows or columns may hold that largest position in its last frame): a token at index
  i >= prompt length (decode, or generated tokens prefilled again on resume) is text at
  position i + delta on every axis — the plain rotary at a shifted position.
`rows(start_token, end_token)` gives the [3, end - start] int64 positions of tokens
[start, end) in O(end - start + log images): a chunk that cuts an image gets its part of the
image's rows, so no step needs the whole prompt's. `prompt_positions` is the whole prompt's.

Refuses, with ValueError at construction: an image that runs past the prompt, images that overlap
or come out of prompt order, a grid the merge size does not tile, a size below 1.
Where transformers cannot: two images with no text token between them are two images here
(transformers groups tokens by type, merges them into one and fails).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

TEMPORAL, HEIGHT, WIDTH = 0, 1, 2


def rope_axes(mrope_section: Sequence[int], rotary_dim: int) -> list[int]:
    """The axis of each of the rotary_dim / 2 frequencies (see the module doc)."""
    if len(mrope_section) != 3 or any(s < 0 for s in mrope_section):
        raise ValueError(f"expected mrope_section of three sizes >= 0, got {list(mrope_section)}")
    if rotary_dim % 2 or sum(mrope_section) != rotary_dim // 2:
        raise ValueError(f"expected mrope_section summing to rotary_dim / 2 = {rotary_dim / 2}, "
                         f"got {list(mrope_section)}")
    height, width = 3 * mrope_section[1], 3 * mrope_section[2]
    return [HEIGHT if i % 3 == 1 and i < height else WIDTH if i % 3 == 2 and i < width else TEMPORAL
            for i in range(rotary_dim // 2)]


@dataclass(frozen=True)
class ImageSpan:
    """An image's placeholder tokens in a prompt: from `first_token`, its patch grid's tokens."""
    first_token: int
    grid_thw: tuple[int, int, int]  # in patches, before the spatial merge
    temporal_stride: int = 1  # positions between frames: 1 for an image (open for video)


class PromptPositions:
    """The M-RoPE positions of one prompt, laid out once (O(images)), read by chunk."""

    def __init__(self, prompt_tokens: int, images: Sequence[ImageSpan], merge_size: int):
        if prompt_tokens < 0 or merge_size < 1:
            raise ValueError(f"expected prompt_tokens >= 0 and merge_size >= 1, got {prompt_tokens}, {merge_size}")
        self.prompt_tokens = prompt_tokens
        self._firsts: list[int] = []  # image k's tokens: [firsts[k], ends[k])
        self._ends: list[int] = []
        self._grids: list[tuple[int, int, int]] = []  # (frames, merged rows, merged columns)
        self._origins: list[int] = []  # the position `start` of image k
        self._strides: list[int] = []
        self._shifts: list[int] = [0]  # text between image k-1 and image k is at index + shifts[k]
        largest = -1
        for k, image in enumerate(images):
            t, h, w = image.grid_thw
            if min(t, h, w, image.temporal_stride) < 1 or h % merge_size or w % merge_size:
                raise ValueError(f"expected image {k}'s grid (t, h, w) >= 1 with h, w multiples of the merge "
                                 f"size {merge_size} and a stride >= 1, got {image.grid_thw}, "
                                 f"stride {image.temporal_stride}")
            rows, cols = h // merge_size, w // merge_size
            first, end = image.first_token, image.first_token + t * rows * cols
            if first < (self._ends[-1] if self._ends else 0):
                raise ValueError(f"expected images in prompt order without overlap, got image {k} at token "
                                 f"{first} before token {self._ends[-1] if self._ends else 0}")
            if end > prompt_tokens:
                raise ValueError(f"expected image {k}'s tokens [{first}, {end}) within the prompt of "
                                 f"{prompt_tokens} tokens, got one past its end")
            shift = self._shifts[-1]
            if first > (self._ends[-1] if self._ends else 0):  # text before it: its last token is the largest yet
                largest = max(largest, first - 1 + shift)
            origin = first + shift
            largest = max(largest, origin + max((t - 1) * image.temporal_stride, rows - 1, cols - 1))
            self._firsts.append(first)
            self._ends.append(end)
            self._grids.append((t, rows, cols))
            self._origins.append(origin)
            self._strides.append(image.temporal_stride)
            self._shifts.append(origin + max(rows, cols) - end)
        if prompt_tokens > (self._ends[-1] if self._ends else 0):
            largest = max(largest, prompt_tokens - 1 + self._shifts[-1])
        self.delta = largest + 1 - prompt_tokens

    def rows(self, start_token: int, end_token: int) -> np.ndarray:
        """Positions [3, end_token - start_token] (int64, rows t, h, w) of tokens [start, end);
        tokens past the prompt are text at index + delta."""
        if not 0 <= start_token <= end_token:
            raise ValueError(f"expected 0 <= start_token <= end_token, got {start_token}, {end_token}")
        out = np.empty((3, end_token - start_token), dtype=np.int64)
        at, k = start_token, bisect.bisect_right(self._ends, start_token)  # images [0, k) end by start_token
        while at < end_token:
            if k < len(self._firsts) and self._firsts[k] <= at:
                stop = min(self._ends[k], end_token)
                self._image_rows(k, at, stop, out[:, at - start_token:stop - start_token])
                k += 1
            elif at < self.prompt_tokens:
                stop = min(self._firsts[k] if k < len(self._firsts) else self.prompt_tokens, end_token)
                out[:, at - start_token:stop - start_token] = np.arange(at, stop) + self._shifts[k]
            else:
                stop = end_token
                out[:, at - start_token:] = np.arange(at, stop) + self.delta
            at = stop
        return out

    def _image_rows(self, k: int, start: int, stop: int, out: np.ndarray) -> None:
        _, rows, cols = self._grids[k]
        local = np.arange(start - self._firsts[k], stop - self._firsts[k])
        origin = self._origins[k]
        out[TEMPORAL] = origin + local // (rows * cols) * self._strides[k]
        out[HEIGHT] = origin + local // cols % rows
        out[WIDTH] = origin + local % cols


def prompt_positions(prompt_tokens: int, images: Sequence[ImageSpan], merge_size: int) -> tuple[np.ndarray, int]:
    """The whole prompt's positions [3, prompt_tokens] (int64) and its delta (see the module doc)."""
    layout = PromptPositions(prompt_tokens, images, merge_size)
    return layout.rows(0, prompt_tokens), layout.delta
