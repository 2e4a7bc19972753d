"""M-RoPE positions of prompts with images (cairn.workers.model.mrope) against transformers'
Qwen3.5: the axis of each frequency against `Qwen3_5TextRotaryEmbedding`, the position rows and
delta against `Qwen3_5Model.get_rope_index`, decode positions against `compute_3d_position_ids`,
every chunk of a prompt against its whole rows, and the rotation `kernels.qk_norm_rope` makes with
those axes against transformers' `apply_rotary_pos_emb` (fp32, a tiny config)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from cairn import kernels
from cairn.kernels.norms import reference as norms_ref
from cairn.workers.model.mrope import ImageSpan, PromptPositions, prompt_positions, rope_axes
from tests.support.checkpoints import Q35_TEXT, Q35_VISION

MERGE = 2  # Q35_VISION's spatial merge size (transformers' default)

# prompt length, images: one in the middle, two of different grids, one at the very start, one at
# the very end, images of more frames than merged rows or columns (their frames do not move the
# text after them; at the end, the last frame is the prompt's largest position), none
PROMPTS = {
    "one image": (14, [ImageSpan(3, (1, 4, 6))]),
    "two images of different grids": (40, [ImageSpan(2, (1, 4, 6)), ImageSpan(12, (1, 8, 2))]),
    "an image first": (11, [ImageSpan(0, (1, 6, 4))]),
    "an image last": (10, [ImageSpan(4, (1, 2, 12))]),
    "an image first and one last": (17, [ImageSpan(0, (1, 2, 2)), ImageSpan(5, (1, 4, 6))]),
    "three frames": (15, [ImageSpan(1, (3, 2, 4)), ImageSpan(11, (1, 2, 4))]),
    "four frames last": (10, [ImageSpan(1, (1, 2, 4)), ImageSpan(6, (4, 2, 2))]),
    "no image": (6, []),
}


def text_config(mrope_section: list[int], head_dim: int) -> Qwen3_5TextConfig:
    rope = dict(Q35_TEXT["rope_parameters"], mrope_section=mrope_section)
    return Qwen3_5TextConfig(**dict(Q35_TEXT, head_dim=head_dim, rope_parameters=rope))


@pytest.fixture(scope="module")
def hf_model() -> hf.Qwen3_5Model:
    config = Qwen3_5Config(text_config=Q35_TEXT, vision_config=Q35_VISION)
    assert config.vision_config.spatial_merge_size == MERGE
    return hf.Qwen3_5Model(config)


def hf_rope_index(model, prompt_tokens: int, images: list[ImageSpan]) -> tuple[np.ndarray, int]:
    """get_rope_index's rows [3, T] and delta for a prompt whose image tokens are marked as images."""
    types = torch.zeros(1, prompt_tokens, dtype=torch.int32)
    for image in images:
        t, h, w = image.grid_thw
        types[0, image.first_token:image.first_token + t * (h // MERGE) * (w // MERGE)] = 1
    grids = torch.tensor([list(image.grid_thw) for image in images]) if images else None
    rows, deltas = model.get_rope_index(torch.zeros(1, prompt_tokens, dtype=torch.long), types, image_grid_thw=grids)
    return rows[:, 0].numpy(), int(deltas[0, 0])


@pytest.mark.parametrize("section, rotary_dim", [([11, 11, 10], 64), ([2, 1, 1], 8), ([24, 20, 20], 128), ([4, 1, 3], 16)])
def test_each_frequency_turns_by_the_axis_transformers_gives_it(section, rotary_dim):
    rotary = hf.Qwen3_5TextRotaryEmbedding(text_config(section, head_dim=4 * rotary_dim))
    assert rotary.inv_freq.shape[0] == rotary_dim // 2
    by_axis = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, rotary_dim // 2).clone()
    want = rotary.recomposition_frequencies(by_axis)[0, 0, : rotary_dim // 2].long().tolist()
    assert rope_axes(section, rotary_dim) == want


@pytest.mark.parametrize("case", PROMPTS)
def test_rows_and_delta_are_transformers_get_rope_index(hf_model, case):
    prompt_tokens, images = PROMPTS[case]
    rows, delta = prompt_positions(prompt_tokens, images, MERGE)
    want_rows, want_delta = hf_rope_index(hf_model, prompt_tokens, images)
    assert rows.dtype == np.int64
    np.testing.assert_array_equal(rows, want_rows)
    assert delta == want_delta


@pytest.mark.parametrize("case", ["two images of different grids", "an image last", "four frames last"])
def test_tokens_past_the_prompt_are_decoded_at_their_index_plus_delta_as_transformers(hf_model, case):
    prompt_tokens, images = PROMPTS[case]
    hf_model.rope_deltas = torch.tensor([[hf_rope_index(hf_model, prompt_tokens, images)[1]]])  # as its prefill keeps it
    cache = SimpleNamespace(get_seq_length=lambda: prompt_tokens + 2)  # two tokens decoded already
    want = hf_model.compute_3d_position_ids(input_ids=torch.zeros(1, 3, dtype=torch.long),
                                            inputs_embeds=torch.zeros(1, 3, 8), cache=cache)
    got = PromptPositions(prompt_tokens, images, MERGE).rows(prompt_tokens + 2, prompt_tokens + 5)
    np.testing.assert_array_equal(got, want[:, 0].numpy())


@pytest.mark.parametrize("case", PROMPTS)
def test_every_chunk_even_one_cutting_an_image_is_its_part_of_the_whole_rows(case):
    prompt_tokens, images = PROMPTS[case]
    layout = PromptPositions(prompt_tokens, images, MERGE)
    whole = layout.rows(0, prompt_tokens + 4)  # and four decoded tokens
    for start in range(prompt_tokens + 5):
        for end in range(start, prompt_tokens + 5):
            np.testing.assert_array_equal(layout.rows(start, end), whole[:, start:end])
    for size in range(1, prompt_tokens + 1):  # chunked prefill: the chunks put together are the prompt's rows
        chunks = [layout.rows(at, min(at + size, prompt_tokens)) for at in range(0, prompt_tokens, size)]
        np.testing.assert_array_equal(np.concatenate(chunks, axis=1), whole[:, :prompt_tokens])


def test_two_images_with_no_text_between_are_two_images():
    rows, delta = prompt_positions(8, [ImageSpan(0, (1, 2, 2)), ImageSpan(4, (1, 2, 2))], merge_size=1)
    assert rows.tolist() == [[0, 0, 0, 0, 2, 2, 2, 2], [0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 0, 1, 2, 3, 2, 3]]
    assert delta == 4 - 8


def test_a_text_only_prompt_counts_on_and_has_no_delta():
    rows, delta = prompt_positions(5, [], MERGE)
    assert rows.tolist() == [list(range(5))] * 3 and delta == 0


@pytest.mark.parametrize("images, why", [
    ([ImageSpan(8, (1, 4, 4))], "within the prompt"),  # tokens [8, 12) of a 10-token prompt
    ([ImageSpan(0, (1, 4, 4)), ImageSpan(3, (1, 2, 2))], "without overlap"),
    ([ImageSpan(6, (1, 2, 2)), ImageSpan(0, (1, 2, 2))], "in prompt order"),
    ([ImageSpan(0, (1, 3, 4))], "multiples of the merge size"),
    ([ImageSpan(0, (0, 2, 2))], "grid"),
    ([ImageSpan(0, (1, 2, 2), temporal_stride=0)], "stride >= 1"),
])
def test_a_layout_that_cannot_be_is_refused(images, why):
    with pytest.raises(ValueError, match=f"expected .*{why}.*, got"):
        PromptPositions(10, images, MERGE)


@pytest.mark.parametrize("section, rotary_dim", [([2, 1], 8), ([2, 1, 2], 8), ([2, 1, 1], 7), ([3, -1, 2], 8)])
def test_a_section_that_does_not_split_the_rotary_frequencies_is_refused(section, rotary_dim):
    with pytest.raises(ValueError, match="expected mrope_section"):
        rope_axes(section, rotary_dim)


def test_a_chunk_backwards_is_refused():
    with pytest.raises(ValueError, match="expected 0 <= start_token <= end_token"):
        PromptPositions(10, [], MERGE).rows(5, 4)


@pytest.mark.parametrize("op", [kernels.qk_norm_rope, norms_ref.qk_norm_rope], ids=["entry point", "reference"])
@pytest.mark.parametrize("case", ["two images of different grids", "three frames"])
def test_the_rotation_at_image_positions_is_transformers_apply_rotary_pos_emb(case, op):
    torch.manual_seed(0)
    config = text_config([2, 1, 1], head_dim=32)  # rotary dim 8: every axis has a frequency
    rotary = hf.Qwen3_5TextRotaryEmbedding(config)
    prompt_tokens, images = PROMPTS[case]
    positions = torch.from_numpy(prompt_positions(prompt_tokens, images, MERGE)[0])  # [3, T]
    q, k = torch.randn(prompt_tokens, 4, 32), torch.randn(prompt_tokens, 2, 32)
    zeros = torch.zeros(32)  # a zero-centred norm's weight: the norm alone, then the rotation
    axes = torch.tensor(rope_axes([2, 1, 1], 8))
    got_q, got_k = op(q, k, zeros, zeros, positions, rotary.inv_freq, 1e-6, rope_axes=axes)

    cos, sin = rotary(q, positions[:, None, :])  # [1, T, 8]
    normed = [torch.nn.functional.rms_norm(x, (32,), eps=1e-6).transpose(0, 1)[None] for x in (q, k)]  # [1, H, T, D]
    want_q, want_k = hf.apply_rotary_pos_emb(*normed, cos, sin)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=2e-5, rtol=1e-4)
