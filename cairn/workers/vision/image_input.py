"""An image as the engine takes it with a prompt, and the prompt as the prefix cache keys it.

`ImageInput`: where the image's placeholder tokens start in the prompt, its patch grid, its pixel
values (laid out as cairn.workers.vision.image_processing writes them) and its content hash
(blake2b over the grid and the pixel values: equal hashes mean equal embeddings, so the encoder's
outputs and the cache's pages can be shared by it). `image_input(processed, first_token)` makes one.

`prompt_keys(prompt, images, merge_size)`: the prompt as every cache path hashes and compares it
(page hashes, partial pages, sub-page checkpoints' tails, the index's keys; a sequence reads it
through cairn.workers.cache_tokens.CacheTokens). Token k of an image (0-based) is the key
`IMAGE_KEYS + (h + k) mod 2^56`, h the first seven bytes of the image's hash: never a vocabulary
id (those are below 2^32), and another image's keys meet these only by a 2^-56 chance. So a page
that overlaps an image hashes the image's content with its tokens: the same tokens with a
different image share nothing from the image's first token on, and the same image resumes past
it. Text tokens, and every token past the prompt, key as themselves.
Plain Python and numpy: no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cairn.workers.vision.image_processing import ProcessedImage, image_tokens

IMAGE_KEYS = 1 << 32  # the first image key: above every vocabulary id
KEY_SPAN = 1 << 56


@dataclass(frozen=True, eq=False)
class ImageInput:
    first_token: int  # the prompt position of its first placeholder token
    grid_thw: tuple[int, int, int]  # in patches, before the spatial merge
    pixel_values: np.ndarray  # [t*h*w, C*T*P*P] float32
    content_hash: bytes  # 16 bytes (`content_hash`)

    def num_tokens(self, merge_size: int) -> int:
        return image_tokens(self.grid_thw, merge_size)


def content_hash(pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(grid_thw, np.int64).tobytes())
    h.update(np.ascontiguousarray(pixel_values, np.float32).tobytes())
    return h.digest()


def image_input(processed: ProcessedImage, first_token: int) -> ImageInput:
    pixels = np.ascontiguousarray(processed.pixel_values, np.float32)
    return ImageInput(first_token, tuple(processed.grid_thw), pixels, content_hash(pixels, processed.grid_thw))


def image_keys(image: ImageInput, count: int) -> list[int]:
    """The cache keys of the image's `count` tokens (see the module doc)."""
    base = int.from_bytes(image.content_hash[:7], "little")
    return [IMAGE_KEYS + (base + k) % KEY_SPAN for k in range(count)]


def prompt_keys(prompt: Sequence[int], images: Sequence[ImageInput], merge_size: int) -> list[int]:
    """The prompt's cache keys: its token ids, each image's tokens replaced by the image's keys."""
    keys = list(prompt)
    for image in images:
        n = image.num_tokens(merge_size)
        keys[image.first_token:image.first_token + n] = image_keys(image, n)
    return keys
