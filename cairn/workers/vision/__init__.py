"""Images for Qwen3.5 / Qwen3.6 vision-language checkpoints: from request bytes to the embeddings
the language model reads in place of an image's placeholder tokens.

The map:
- `vision_config`: the tower's shape and the image token ids, from `config.json` (no torch);
  None for a checkpoint without a vision tower.
- `image_processing`: bytes to pixel patches and the patch grid, exactly as transformers'
  Qwen2-VL PIL processor prepares them (no torch: the ingress can count image tokens); the
  decompression-bomb guard; `ImageError` for what the client must fix.
- `vision_tower`: the tower (`model.visual.*`), transformers' `Qwen3_5VisionModel` in plain torch,
  and its loader, which reads only the tower's tensors.
- `image_input`: an image as the engine takes it with a prompt (`ImageInput`: where its tokens
  start, its grid, pixels and content hash), and the prompt's cache keys (`prompt_keys`: image
  tokens keyed by the image's content, no torch).
- `image_encoder`: the tower as a step uses it, behind an LRU of its outputs by content hash.

The engine takes images (`GenerateRequest.images`; `Engine.use_vision` loads the tower), places
their embeddings and M-RoPE positions in a step (cairn.workers.execution.image_rows), bounds the
image tokens a step encodes (cairn.workers.image_budget) and keys the cache by them; the API
reads image parts (cairn.cluster.api.prompt_images); under tensor parallelism every rank encodes
them itself; a sequence with images does not draft under speculative decoding. Video is open in
the grid computation only.

Imported lazily (PEP 562), as `cairn.workers.model` is: the torch-free modules load without torch.
"""

from __future__ import annotations

from cairn.workers.lazy import lazy_exports

_PROCESSING = "cairn.workers.vision.image_processing"
_WHERE = {
    "VisionConfig": "cairn.workers.vision.vision_config", "read_vision_config": "cairn.workers.vision.vision_config",
    "load_vision_config": "cairn.workers.vision.vision_config",
    "ImageError": _PROCESSING, "PreprocessorConfig": _PROCESSING, "ProcessedImage": _PROCESSING,
    "preprocess_image": _PROCESSING, "read_preprocessor_config": _PROCESSING, "load_preprocessor_config": _PROCESSING,
    "patch_grid": _PROCESSING,
    "VisionTower": "cairn.workers.vision.vision_tower", "load_vision_tower": "cairn.workers.vision.vision_tower",
    "ImageInput": "cairn.workers.vision.image_input", "image_input": "cairn.workers.vision.image_input",
    "content_hash": "cairn.workers.vision.image_input", "prompt_keys": "cairn.workers.vision.image_input",
    "ImageEncoder": "cairn.workers.vision.image_encoder",
}
__all__ = sorted(_WHERE)


__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
