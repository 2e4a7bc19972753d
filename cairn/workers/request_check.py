"""What a request must be before an engine queues it (`Engine.add`): everything that could make
it fail halfway is refused up front, with `RequestRejected` naming the field at fault.

`check(request, spec, layout, grammars)` returns the `Checked` request: its prompt, the tokens
it may reach (prompt + max_tokens, capped by the model's length), its hash root (the spec's
unsalted one when none is given) and its checkpoint hints (inside the prompt, sorted, once
each). Refused: an empty prompt; token ids outside the vocabulary (prompt, stop_token_ids,
logit_bias, a grammar's think tags); a prompt with no room left to generate; more KV pages than
the arena holds beside a state; a malformed hash root; page hashes that are not one per whole
page; a grammar on an engine without a tokenizer. `check_images` checks a prompt's images.
Plain Python and numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

from cairn.cache_service.hashing import DIGEST_BYTES
from cairn.workers.cache.arena import ArenaLayout
from cairn.workers.engine_errors import RequestRejected
from cairn.workers.request import GenerateRequest
from cairn.workers.spec import EngineSpec
from cairn.workers.model.mrope import ImageSpan, PromptPositions
from cairn.workers.vision.image_input import ImageInput


@dataclass(frozen=True)
class Checked:
    prompt: list[int]
    total_tokens: int  # the most it may reach: prompt + max_tokens, capped by max_model_len
    hash_root: bytes
    hints: tuple[int, ...]


def check(request: GenerateRequest, spec: EngineSpec, layout: ArenaLayout, has_grammars: bool) -> Checked:
    params, prompt = request.params, list(request.prompt_token_ids)
    if not prompt:
        raise RequestRejected("prompt must hold at least one token", "prompt")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < spec.vocab_size for t in prompt):
        raise RequestRejected(f"prompt token ids must be integers in [0, {spec.vocab_size})", "prompt")
    if any(t >= spec.vocab_size for t in params.stop_token_ids):
        raise RequestRejected(f"stop_token_ids must be in [0, {spec.vocab_size})", "stop_token_ids")
    if any(t >= spec.vocab_size for t, _ in params.logit_bias):
        raise RequestRejected(f"logit_bias token ids must be in [0, {spec.vocab_size})", "logit_bias")
    if len(prompt) >= spec.max_model_len:
        raise RequestRejected(f"prompt has {len(prompt)} tokens; this model allows at most "
                              f"{spec.max_model_len - 1} (max_model_len {spec.max_model_len} minus one to "
                              f"generate)", "prompt")
    total = min(len(prompt) + params.max_tokens, spec.max_model_len)
    pages = -(-total // spec.page_size)
    if pages > layout.page_capacity or pages + layout.slot_blocks > layout.num_blocks:
        raise RequestRejected(f"request needs {pages} KV pages for {total} tokens; the cache holds "
                              f"{min(layout.page_capacity, layout.num_blocks - layout.slot_blocks)} beside "
                              f"its state", "prompt")
    hash_root, page_hashes = request.hash_root, request.page_hashes
    if hash_root is None:
        hash_root = spec.hash_root()
    elif not isinstance(hash_root, bytes) or len(hash_root) != DIGEST_BYTES:
        raise RequestRejected(f"hash_root must be {DIGEST_BYTES} bytes (EngineSpec.hash_root)", "hash_root")
    whole = len(prompt) // spec.page_size
    if page_hashes is not None and (len(page_hashes) != whole or not all(
            isinstance(h, bytes) and len(h) == DIGEST_BYTES for h in page_hashes)):
        raise RequestRejected(f"page_hashes must be {whole} hashes of {DIGEST_BYTES} bytes, one per whole page",
                              "page_hashes")
    if params.grammar is not None:
        if not has_grammars:
            raise RequestRejected("this engine has no tokenizer to compile grammars with", "grammar")
        if any(not 0 <= t < spec.vocab_size for t in params.grammar.think or ()):
            raise RequestRejected(f"a grammar's think tags must be token ids in [0, {spec.vocab_size})", "grammar")
    hints = tuple(sorted({int(h) for h in request.checkpoint_hints or () if 0 < int(h) < len(prompt)}))
    return Checked(prompt, total, hash_root, hints)


def check_images(images: list, prompt: list[int], vision, refused: str | None):
    """A request's images against its prompt: None without images, else (the images in prompt
    order, their M-RoPE positions). Refused, naming `images`: images for a model without a vision
    tower or an engine that takes none (`refused` says why); an image that is not an
    `ImageInput`, whose pixel values do not fit its grid, or whose placeholder tokens are not
    the model's image token; images out of prompt order or overlapping; an image token of the
    prompt no image fills (it would be read as text)."""
    placeholders = [i for i, t in enumerate(prompt) if vision is not None and t == vision.image_token_id]
    if not images and not placeholders:
        return None
    if vision is None:
        raise RequestRejected("this model takes no images (its checkpoint has no vision tower)", "images")
    if refused:
        raise RequestRejected(f"this engine takes no images: it runs {refused}", "images")
    merge, covered, out = vision.spatial_merge_size, set(), []
    for k, image in enumerate(images):
        if not isinstance(image, ImageInput):
            raise RequestRejected(f"images[{k}]: expected an ImageInput, got {type(image).__name__}", "images")
        grid = image.grid_thw
        if len(grid) != 3 or min(grid) < 1 or grid[1] % merge or grid[2] % merge:
            raise RequestRejected(f"images[{k}]: grid {grid} is not (t, h, w) >= 1 with h and w multiples of "
                                  f"{merge}", "images")
        shape = (grid[0] * grid[1] * grid[2], vision.patch_dim)
        if tuple(image.pixel_values.shape) != shape:
            raise RequestRejected(f"images[{k}]: pixel values of shape {tuple(image.pixel_values.shape)}; its grid "
                                  f"needs {shape}", "images")
        span = range(image.first_token, image.first_token + image.num_tokens(merge))
        if image.first_token < 0 or span.stop > len(prompt) or any(prompt[i] != vision.image_token_id for i in span):
            raise RequestRejected(f"images[{k}]: prompt tokens [{span.start}, {span.stop}) must all be the image "
                                  f"token {vision.image_token_id}", "images")
        covered.update(span)
        out.append(image)
    out.sort(key=lambda image: image.first_token)
    if len(covered) != len(placeholders):
        raise RequestRejected(f"the prompt holds {len(placeholders)} image tokens; its images fill "
                              f"{len(covered)}", "images")
    try:
        rope = PromptPositions(len(prompt), [ImageSpan(i.first_token, tuple(i.grid_thw)) for i in out], merge)
    except ValueError as e:
        raise RequestRejected(f"images: {e}", "images") from None
    return tuple(out), rope
