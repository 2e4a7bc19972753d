"""Image bytes to the vision tower's input, exactly as transformers' `Qwen2VLImageProcessorPil` (what
`AutoImageProcessor` picks for a `qwen3_5` / `qwen3_5_moe` checkpoint without torchvision) prepares
them. No torch: the ingress can count an image's tokens, or prepare it, without loading a model.

Contract:
- `decode_image` opens PNG, JPEG, WebP or GIF bytes (a GIF's or animated WebP's first frame) and
  reads the size from the header first: an image over the caller's `max_source_pixels` is refused
  before one pixel is decoded. It applies the EXIF orientation (as transformers' `load_image` does),
  then converts to RGB, compositing any transparency onto white (as the processor does).
- `smart_resize` / `patch_grid` are pure: a size in pixels gives the resized size, the patch grid
  (t, h, w) and so the image token count (t*h*w / merge^2). Frames are a parameter, for video.
- `preprocess_image` resizes with Pillow (bicubic unless the config says otherwise) to multiples
  of patch*merge within [min_pixels, max_pixels], rescales (in float64, then float32), normalizes,
  and lays the patches out as the tower reads them: frame by frame, each frame in merge-window
  order, each patch flattened as (channel, frame, row, column); a still image fills the temporal
  patch by repetition. Same Pillow, same arithmetic: the values equal transformers' bit for bit.
- `ImageError` (a ValueError; the client must act): bytes that are not an image we decode, an image
  too large, too small or too elongated (aspect ratio over 200, as transformers refuses).
  A bad `preprocessor_config.json` is a `CheckpointError` naming the field.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from cairn.workers.model.model_config import CheckpointError, ConfigReader, read_json

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' defaults for this processor
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names; nothing else is even identified
MAX_ASPECT_RATIO = 200
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC
# Fields of published preprocessor configs that do not change what an image becomes.
BOOKKEEPING = ("image_processor_type", "processor_class", "auto_map", "_processor_class", "data_format",
               "input_data_format", "default_to_square", "return_tensors")


class ImageError(ValueError):
    """An image a request carries that cannot be used; the message says why."""


@dataclass(frozen=True)
class PreprocessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56  # after resizing
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = BICUBIC
    source: str = field(default="preprocessor_config.json", compare=False)

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this many pixels: one merge window."""
        return self.patch_size * self.merge_size


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: np.ndarray  # [t*h*w, C*T*P*P] float32, in the order the tower reads
    grid_thw: tuple[int, int, int]  # in patches
    num_image_tokens: int  # t*h*w / merge^2: the placeholders the prompt holds for it


def read_preprocessor_config(raw: dict[str, Any], source: str = "preprocessor_config.json") -> PreprocessorConfig:
    """A `preprocessor_config.json` (as a dict); absent fields take transformers' defaults, and
    `min_pixels` / `max_pixels` win over `size.shortest_edge` / `size.longest_edge`, as there."""
    r = ConfigReader(raw, source)
    r.ignore(*BOOKKEEPING)
    for name in ("do_resize", "do_convert_rgb"):
        r.expect(name, (True,), "cairn always resizes and converts to RGB, as the checkpoint was trained")
    size = r.opt("size", None) or {}
    if not isinstance(size, dict):
        raise r.bad("size", f"must be an object, got {size!r}")
    default = PreprocessorConfig()

    def pixels(name: str, size_key: str, fallback: int) -> int:
        if raw.get(name) is not None or size.get(size_key) is None:
            return r.opt_int(name, fallback, minimum=1)
        value = size[size_key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise r.bad(f"size.{size_key}", f"must be a positive integer, got {value!r}")
        return value

    def flag(name: str) -> bool:
        value = r.opt(name, True)
        if not isinstance(value, bool):
            raise r.bad(name, f"must be true or false, got {value!r}")
        return value

    min_pixels = pixels("min_pixels", "shortest_edge", default.min_pixels)
    max_pixels = pixels("max_pixels", "longest_edge", default.max_pixels)
    if min_pixels > max_pixels:
        raise r.bad("min_pixels", f"({min_pixels}) exceeds max_pixels ({max_pixels})")
    stats = {}
    for name in ("image_mean", "image_std"):
        value = r.opt(name, getattr(default, name))
        value = [value] * 3 if isinstance(value, (int, float)) else value
        numbers = isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value)
        if not (numbers and len(value) == 3):
            raise r.bad(name, f"must be 3 numbers (R, G, B), got {value!r}")
        stats[name] = tuple(float(v) for v in value)
    if 0 in stats["image_std"]:
        raise r.bad("image_std", f"must not hold 0, got {list(stats['image_std'])}")
    rescale = r.opt("rescale_factor", default.rescale_factor)
    if isinstance(rescale, bool) or not isinstance(rescale, (int, float)) or rescale <= 0:
        raise r.bad("rescale_factor", f"must be a positive number, got {rescale!r}")
    resample = r.opt_int("resample", BICUBIC)
    if resample > 5:
        raise r.bad("resample", f"is {resample}; expected a Pillow resampling filter (0-5)")
    cfg = PreprocessorConfig(
        patch_size=r.opt_int("patch_size", default.patch_size, minimum=1),
        temporal_patch_size=r.opt_int("temporal_patch_size", default.temporal_patch_size, minimum=1),
        merge_size=r.opt_int("merge_size", default.merge_size, minimum=1),
        min_pixels=min_pixels, max_pixels=max_pixels, **stats, rescale_factor=float(rescale),
        do_rescale=flag("do_rescale"), do_normalize=flag("do_normalize"),
        resample=resample, source=source)
    r.warn_unread()
    return cfg


def load_preprocessor_config(model_dir: str | Path) -> PreprocessorConfig:
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: not found (a vision-language checkpoint needs it to prepare images)")
    return read_preprocessor_config(read_json(path), str(path))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled into [min_pixels, max_pixels]
    keeping the aspect ratio as well as the rounding allows (transformers' arithmetic: Python's
    round-half-even, floor when shrinking, ceil when growing)."""
    if min(height, width) < 1:
        raise ImageError(f"image is {width}x{height} pixels; expected both sides >= 1")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image is {width}x{height} pixels: aspect ratio "
                         f"{max(height, width) / min(height, width):.1f} exceeds {MAX_ASPECT_RATIO}")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def patch_grid(height: int, width: int, cfg: PreprocessorConfig, frames: int = 1) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of `frames` frames of `height` x `width` pixels (before resizing);
    frames are padded to a whole temporal patch, a still image by repetition."""
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return -(-frames // cfg.temporal_patch_size), h // cfg.patch_size, w // cfg.patch_size


def image_tokens(grid_thw: tuple[int, int, int], merge_size: int) -> int:
    t, h, w = grid_thw
    return t * h * w // merge_size ** 2


def decode_image(data: bytes, max_source_pixels: int) -> Image.Image:
    """The first frame of `data` as an upright RGB image; its header is checked before decoding."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ImageError(f"image: expected bytes, got {type(data).__name__}")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError(f"image is too large to decode ({e})") from None
    except Exception as e:  # Pillow's identify step raises several types for foreign bytes
        raise ImageError(f"not a PNG, JPEG, WebP or GIF image ({type(e).__name__}: {e})") from None
    width, height = image.size
    if width * height > max_source_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels; the limit is {max_source_pixels}")
    try:
        image.load()  # the first frame only
        image = ImageOps.exif_transpose(image)
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image.convert("RGB")
    except Exception as e:  # truncated or corrupt pixel data: Pillow's decoders raise several types
        raise ImageError(f"cannot decode the {image.format} image ({type(e).__name__}: {e})") from None


def patchify(frames: np.ndarray, cfg: PreprocessorConfig) -> np.ndarray:
    """[F, C, H, W] (F a multiple of the temporal patch; H, W of patch*merge) to
    [t*h*w, C*T*P*P]: frame groups in order, each in merge-window order."""
    F, C, H, W = frames.shape
    T, P, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    t, h, w = F // T, H // P, W // P
    x = frames.reshape(t, T, C, h // m, m, P, w // m, m, P)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, h/m, w/m, m, m, C, T, P, P]
    return x.reshape(t * h * w, C * T * P * P)


def preprocess_image(data: bytes, cfg: PreprocessorConfig, *, max_source_pixels: int) -> ProcessedImage:
    """Image bytes as the tower's input; refuses (ImageError) what `decode_image` refuses."""
    image = decode_image(data, max_source_pixels)
    height, width = smart_resize(image.height, image.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    x = np.asarray(image.resize((width, height), resample=cfg.resample))  # [H, W, 3] uint8
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = x.astype(np.float32, copy=False)
    if cfg.do_normalize:
        x = (x - np.array(cfg.image_mean, np.float32)) / np.array(cfg.image_std, np.float32)
    still = np.broadcast_to(x.transpose(2, 0, 1)[None], (cfg.temporal_patch_size, 3, height, width))
    grid = (1, height // cfg.patch_size, width // cfg.patch_size)
    return ProcessedImage(pixel_values=patchify(still, cfg), grid_thw=grid,
                          num_image_tokens=image_tokens(grid, cfg.merge_size))
