"""Image bytes become the same pixel patches and grid as transformers' processor makes for Qwen3.5
(`Qwen2VLImageProcessorPil`: what `AutoImageProcessor` picks for a `qwen3_5` checkpoint without
torchvision, which is not installed here), bit for bit: both resize with the same Pillow call and
rescale / normalize with the same numpy arithmetic, so no tolerance is needed. Bytes that are not
an image we decode, and an image over the caller's pixel limit, are an `ImageError`; the limit is
checked from the header, before the pixels are decoded."""

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from cairn.workers.vision.image_processing import (CheckpointError, ImageError, load_preprocessor_config, patch_grid,
                                                   preprocess_image, read_preprocessor_config)

# Qwen3.5's published layout (patch 16, mean/std 0.5) at toy sizes: patch 4, merge 2 (sides are
# multiples of 8 pixels), between 32x32 and 64x64 pixels after resizing.
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}, "patch_size": 4,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
LIMIT = 10 ** 6  # source pixels: far above every image here but the oversize ones


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("preprocessor")
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


@pytest.fixture(scope="module")
def transformers_processor(checkpoint):
    return Qwen2VLImageProcessorPil.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def cfg(checkpoint):
    return load_preprocessor_config(checkpoint)


def picture(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """Gradients with noise: every resampling tap matters."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x * 7 + y * 3) % 256,
                     255 - x * 200 // max(width - 1, 1)], axis=-1)
    noise = np.random.default_rng(seed).integers(0, 48, base.shape)
    rgba = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGBA")
    return rgba if mode == "RGBA" else rgba.convert(mode)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def assert_same_as_transformers(ours, reference) -> None:
    assert [list(ours.grid_thw)] == reference["image_grid_thw"].tolist()
    assert ours.pixel_values.dtype == reference["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values, reference["pixel_values"])


SIZES = {"upscaled_to_min_pixels": (20, 12), "rounded_within_the_limits": (45, 37),
         "downscaled_to_max_pixels": (150, 90)}


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP"])
@pytest.mark.parametrize("case", SIZES)
def test_pixels_and_grid_equal_transformers(case, fmt, cfg, transformers_processor):
    width, height = SIZES[case]
    data = encode(picture(width, height, mode="P" if fmt == "GIF" else "RGB"), fmt)
    ours = preprocess_image(data, cfg, max_source_pixels=LIMIT)
    reference = transformers_processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert_same_as_transformers(ours, reference)

    _, h, w = ours.grid_thw
    resized = h * w * 4 * 4
    assert {"upscaled_to_min_pixels": resized >= 32 * 32 > width * height,
            "rounded_within_the_limits": (h * 4, w * 4) == (40, 48),
            "downscaled_to_max_pixels": width * height > 64 * 64 >= resized}[case]
    assert ours.num_image_tokens == h * w // 4 == len(ours.pixel_values) // 4


def test_transparency_is_composited_onto_white_as_transformers_does(cfg, transformers_processor):
    png = encode(picture(30, 22, mode="RGBA"), "PNG")
    gif = encode(picture(30, 22, mode="P"), "GIF", transparency=0)
    for data in (png, gif):
        reference = transformers_processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")
        assert_same_as_transformers(preprocess_image(data, cfg, max_source_pixels=LIMIT), reference)


def test_an_animated_gif_gives_its_first_frame(cfg):
    first, second = picture(40, 24, seed=1, mode="P"), picture(40, 24, seed=2, mode="P")
    animated = encode(first, "GIF", save_all=True, append_images=[second], duration=100)
    assert Image.open(io.BytesIO(animated)).n_frames == 2
    got = preprocess_image(animated, cfg, max_source_pixels=LIMIT)
    np.testing.assert_array_equal(got.pixel_values,
                                  preprocess_image(encode(first, "GIF"), cfg, max_source_pixels=LIMIT).pixel_values)


def test_the_exif_orientation_is_applied_as_transformers_load_image_does(cfg, transformers_processor):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(picture(40, 24), "JPEG", exif=exif.tobytes())
    ours = preprocess_image(data, cfg, max_source_pixels=LIMIT)
    upright = load_image(base64.b64encode(data).decode())
    assert upright.size == (24, 40)
    assert_same_as_transformers(ours, transformers_processor(images=[upright], return_tensors="np"))


def test_the_grid_is_a_pure_function_of_the_size_and_counts_frames_for_video(cfg, transformers_processor):
    for width, height in [*SIZES.values(), (3, 3), (1000, 7)]:
        t, h, w = patch_grid(height, width, cfg)
        assert t == 1 and h * w == transformers_processor.get_number_of_image_patches(height, width)
    assert [patch_grid(90, 150, cfg, frames=n)[0] for n in (1, 2, 3, 4)] == [1, 1, 2, 2]


def truncated_png(width: int, height: int) -> bytes:
    """A PNG whose header is whole and whose pixel data is cut short."""
    data = encode(picture(width, height), "PNG")
    return data[:len(data) // 2]


@pytest.mark.parametrize("data", [b"", b"hello, world", json.dumps({"image": 1}).encode(), b"\x89PNG\r\n\x1a\n",
                                  truncated_png(30, 20), encode(picture(30, 20), "BMP")],
                         ids=["empty", "text", "json", "png_signature_only", "truncated_png", "bmp"])
def test_bytes_that_are_not_an_image_we_decode_raise_image_error(data, cfg):
    with pytest.raises(ImageError):
        preprocess_image(data, cfg, max_source_pixels=LIMIT)


def test_an_oversize_image_is_refused_from_its_header_before_its_pixels_are_decoded(cfg):
    data = truncated_png(300, 200)  # decoding it would fail: refusing it proves nothing was decoded
    with pytest.raises(ImageError, match="cannot decode"):
        preprocess_image(data, cfg, max_source_pixels=LIMIT)
    with pytest.raises(ImageError, match=r"300x200 = 60000 pixels; the limit is 59999"):
        preprocess_image(data, cfg, max_source_pixels=59_999)


def test_an_image_too_elongated_raises_image_error(cfg):
    with pytest.raises(ImageError, match="aspect ratio"):
        preprocess_image(encode(picture(402, 2), "PNG"), cfg, max_source_pixels=LIMIT)


def test_the_preprocessor_config_defaults_and_overrides_are_transformers(tmp_path):
    default, ours = Qwen2VLImageProcessorPil(), read_preprocessor_config({})
    assert (ours.patch_size, ours.temporal_patch_size, ours.merge_size) == \
        (default.patch_size, default.temporal_patch_size, default.merge_size)
    assert (ours.min_pixels, ours.max_pixels) == (default.size.shortest_edge, default.size.longest_edge)
    assert (list(ours.image_mean), list(ours.image_std)) == (list(default.image_mean), list(default.image_std))
    assert (ours.rescale_factor, ours.resample) == (default.rescale_factor, default.resample)

    raw = dict(PREPROCESSOR, min_pixels=16 * 16, max_pixels=128 * 128)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))
    theirs, ours = Qwen2VLImageProcessorPil.from_pretrained(tmp_path), load_preprocessor_config(tmp_path)
    assert (ours.min_pixels, ours.max_pixels) == (theirs.size.shortest_edge, theirs.size.longest_edge) == (256, 16384)


@pytest.mark.parametrize("change, field", [
    (dict(patch_size=0), "patch_size"), (dict(image_std=[0.5, 0.5]), "image_std"),
    (dict(image_std=[0.5, 0, 1]), "image_std"), (dict(do_resize=False), "do_resize"),
    (dict(min_pixels=10 ** 9), "min_pixels"), (dict(resample="bicubic"), "resample"),
    (dict(size={"shortest_edge": "big", "longest_edge": 4096}), "size.shortest_edge"),
    (dict(do_normalize="no"), "do_normalize"),
])
def test_a_bad_preprocessor_config_is_an_error_naming_the_field(change, field):
    with pytest.raises(CheckpointError, match=rf"field '{field}'"):
        read_preprocessor_config(dict(PREPROCESSOR, **change))
