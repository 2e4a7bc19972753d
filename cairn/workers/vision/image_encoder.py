"""The vision tower as a step uses it: the embeddings of a step's image tokens, each image encoded
once while its outputs stay in an LRU keyed by content hash.

`ImageEncoder(tower, merge_size, max_bytes)`, or `ImageEncoder.load(model_dir, model)`.
`embeddings(parts)`, with `parts` the step's image
slices in row order ((image, first, end): tokens [first, end) of the image's, see
cairn.workers.execution.image_rows), returns their embeddings [sum of end - first, hidden]: the
images not held are encoded in one batched pass of the tower (every image of the step at once),
then kept, the least recently used leaving first once the outputs held pass `max_bytes` (an image
larger than that alone is encoded and not kept). A chunked prompt that cuts an image encodes it
in the first chunk and reads the rest from here. `encoded` counts the images the tower ran on
(what a cache hit past an image saves), `hits` the images found held.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from cairn.workers.vision.image_input import ImageInput
from cairn.workers.vision.vision_config import load_vision_config
from cairn.workers.vision.vision_tower import VisionTower, load_vision_tower


class ImageEncoder:
    def __init__(self, tower: VisionTower, merge_size: int, max_bytes: int = 256 << 20):
        self.tower, self.merge_size, self.max_bytes = tower, merge_size, max_bytes
        p = next(tower.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._held: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.encoded = self.hits = 0

    @classmethod
    def load(cls, model_dir, model) -> "ImageEncoder | None":
        """The checkpoint's tower behind an encoder, on `model`'s device in its dtype, where the
        checkpoint has one and `model` reads images (interleaved M-RoPE); else None."""
        vision = load_vision_config(model_dir)
        if vision is None or not model.config.mrope_interleaved:
            return None
        p = next(model.parameters())
        return cls(load_vision_tower(model_dir, vision, p.dtype, p.device), vision.spatial_merge_size)

    @torch.inference_mode()
    def embeddings(self, parts: list[tuple[ImageInput, int, int]]) -> torch.Tensor:
        wanted = list({image.content_hash: image for image, _, _ in parts}.values())
        missing = [image for image in wanted if image.content_hash not in self._held]
        self.hits += len(wanted) - len(missing)
        fresh = dict(zip((image.content_hash for image in missing), self._encode(missing))) if missing else {}
        out = []
        for image, first, end in parts:
            h = image.content_hash
            found = fresh.get(h)
            if found is None:
                found = self._held[h]
                self._held.move_to_end(h)
            out.append(found[first:end])
        for h, t in fresh.items():
            self._keep(h, t)
        return torch.cat(out)

    def _encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        pixels = torch.cat([torch.from_numpy(image.pixel_values) for image in images]).to(self.device, self.dtype)
        grid = torch.tensor([image.grid_thw for image in images], dtype=torch.long)
        self.encoded += len(images)
        return list(self.tower(pixels, grid).split([image.num_tokens(self.merge_size) for image in images]))

    def _keep(self, content_hash: bytes, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if size > self.max_bytes:
            return
        self._held[content_hash] = t
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._held.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        self._held.clear()
        self._bytes = 0
