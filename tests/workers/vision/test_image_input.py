"""The keys the cache reads for a prompt with images (`prompt_keys`, `CacheTokens`): image tokens
keyed by the image's content, above every vocabulary id, text as itself; a sequence's view reads
its generated tokens live and slices like a list; the router's sub-page keys take them."""

import random

import numpy as np

from cairn.cache_service.hashing import sub_state_keys
from cairn.workers.cache_tokens import CacheTokens
from cairn.workers.vision.image_input import IMAGE_KEYS, ImageInput, content_hash, prompt_keys

GRID = (1, 4, 4)  # 4 tokens at merge 2


def an_image(first: int, seed: int) -> ImageInput:
    pixels = np.random.default_rng(seed).standard_normal((16, 96)).astype(np.float32)
    return ImageInput(first, GRID, pixels, content_hash(pixels, GRID))


def test_image_tokens_key_by_content_and_text_keys_as_itself():
    prompt = [5, 6, 9, 9, 9, 9, 7, 9, 9, 9, 9, 8]
    a, b = an_image(2, seed=0), an_image(7, seed=1)
    keys = prompt_keys(prompt, [a, b], merge_size=2)
    assert [keys[i] for i in (0, 1, 6, 11)] == [5, 6, 7, 8]
    assert all(k >= IMAGE_KEYS for k in keys[2:6] + keys[7:11]) and len(set(keys[2:6] + keys[7:11])) == 8
    again = prompt_keys(prompt, [an_image(2, seed=0), an_image(7, seed=1)], merge_size=2)
    assert again == keys  # the same pixels: the same keys, in another request
    swapped = prompt_keys(prompt, [an_image(2, seed=1), an_image(7, seed=0)], merge_size=2)
    assert swapped[2:6] == keys[7:11] and swapped[7:11] == keys[2:6]  # keys follow the image, not its place
    assert content_hash(a.pixel_values, (1, 2, 8)) != a.content_hash  # the grid is part of the content


def test_a_sequences_cache_tokens_slice_like_the_list_they_stand_for():
    rng = random.Random(0)
    tokens = list(range(100, 120))
    keys = tokens[:5] + [IMAGE_KEYS + i for i in range(8)] + tokens[13:]  # a 20-token prompt
    view = CacheTokens(tokens, keys)
    tokens += [1, 2, 3]  # generated after the view was made
    expected = keys + [1, 2, 3]
    assert len(view) == 23 and [view[i] for i in range(-23, 23)] == expected + expected
    for _ in range(200):
        a, b = rng.randrange(-25, 26), rng.randrange(-25, 26)
        assert view[a:b] == expected[a:b]
    assert view[::2] == expected[::2]


def test_sub_page_keys_take_image_keys_and_keep_4_byte_tokens_keys():
    base = b"\x01" * 16
    text = sub_state_keys(base, [5, 6, 7])
    imaged = sub_state_keys(base, [5, IMAGE_KEYS + 3, 7])
    assert imaged[0] == text[0] and imaged[1] != text[1] and imaged[2] != text[2]
    assert sub_state_keys(base, [5, IMAGE_KEYS + 4, 7])[1] != imaged[1]
