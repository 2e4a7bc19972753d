"""A chat's images at the ingress: read, checked, preprocessed, and placed in its token ids.

`PromptImages.from_dir(model_dir, options)` holds what the ingress needs of the checkpoint: its
vision config (the image token, the merge size) and `preprocessor_config.json`; for a text-only
model it holds none, and any image part is a 400 naming it.
- `load(req, stop)`: each image part of a chat request, in prompt order, as (its parameter name,
  the `ProcessedImage`): bytes from `image_sources` (data: URLs; allowed URLs), decoded with the
  request limits' pixel bound and preprocessed exactly as transformers does
  (cairn.workers.vision.image_processing). A bad image (corrupt base64, not an image, too large,
  a URL not allowed) is a 400 naming its content part, `messages[i].content[j]`.
- `place(ids, positions, loaded)`: the chat template renders each image as one image token
  (Qwen3.5's `<|vision_start|><|image_pad|><|vision_end|>`); each is expanded to the image's
  token count, and token positions (checkpoint hints, the public prefix's end) past it move with
  it. Returns (ids, positions, the `ImageInput`s). Image tokens other than the images' (a client's
  own, where special tokens in content are allowed) are a 400: they would be read as text.
- `keys(ids, images)`: the prompt as the cache keys it (cairn.workers.vision.image_input), which
  the ingress hashes and the router reads, as every engine does.
"""

from __future__ import annotations

import threading
from pathlib import Path

from cairn.cluster.api.api_errors import bad_request
from cairn.cluster.api.api_options import APIOptions
from cairn.cluster.api.image_sources import ImageSources
from cairn.cluster.api.prep_pool import check
from cairn.cluster.api.protocol import ChatCompletionRequest
from cairn.workers.vision.image_input import ImageInput, image_input, prompt_keys
from cairn.workers.vision.image_processing import (ImageError, PreprocessorConfig, ProcessedImage,
                                                   load_preprocessor_config, preprocess_image)
from cairn.workers.vision.vision_config import VisionConfig, load_vision_config


class PromptImages:
    def __init__(self, vision: VisionConfig | None, preprocessor: PreprocessorConfig | None,
                 sources: ImageSources, max_pixels: int):
        self.vision, self.preprocessor, self.sources, self.max_pixels = vision, preprocessor, sources, max_pixels

    @classmethod
    def from_dir(cls, model_dir: str | Path, options: APIOptions) -> "PromptImages":
        has_config = (Path(model_dir) / "config.json").exists()  # a tokenizer's folder alone: text only
        vision = load_vision_config(model_dir) if has_config else None
        limits = options.api_limits
        return cls(vision, load_preprocessor_config(model_dir) if vision is not None else None,
                   ImageSources(options.image_url_allow, limits.max_image_bytes, options.image_fetch_timeout_s),
                   limits.max_image_pixels)

    def load(self, req: ChatCompletionRequest, stop: threading.Event | None = None) -> list[tuple[str, ProcessedImage]]:
        out = []
        for param, url in req.image_parts():
            if self.vision is None:
                raise bad_request(f"{param}: this model takes no images (its checkpoint has no vision tower)", param)
            check(stop)
            try:
                out.append((param, preprocess_image(self.sources.read(url, param), self.preprocessor,
                                                    max_source_pixels=self.max_pixels)))
            except ImageError as e:
                raise bad_request(f"{param}: {e}", param) from None
        return out

    def place(self, ids: list[int], positions: list[int], loaded: list[tuple[str, ProcessedImage]]
              ) -> tuple[list[int], list[int], list[ImageInput]]:
        if self.vision is None:
            return ids, positions, []
        pad = self.vision.image_token_id
        at = [i for i, t in enumerate(ids) if t == pad]
        if len(at) != len(loaded):
            raise bad_request(f"the prompt holds {len(at)} image tokens for {len(loaded)} images (the chat template "
                              f"renders one per image part; image tokens written in messages are not images)",
                              "messages")
        out, images, moved = [], [], []
        last = 0
        for where, (_, image) in zip(at, loaded):
            out += ids[last:where]
            images.append(image_input(image, len(out)))
            out += [pad] * image.num_image_tokens
            moved.append((where, image.num_image_tokens - 1))
            last = where + 1
        out += ids[last:]
        shifted = [p + sum(extra for where, extra in moved if where < p) for p in positions]
        return out, shifted, images

    def keys(self, ids: list[int], images: list[ImageInput]) -> list[int]:
        return prompt_keys(ids, images, self.vision.spatial_merge_size) if images else ids
