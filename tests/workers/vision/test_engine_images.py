"""Prompts with images through the engine, on vision-language checkpoints transformers wrote
(Qwen3.5 dense and MoE): greedy tokens and their logprobs equal transformers'
`Qwen3_5ForConditionalGeneration`'s for images of three sizes, two images in one prompt, a prefill
chunked through an image, and an image in the first turn of a two-turn chat; the prefix cache
keys image tokens by the image's content (the same tokens with another image resume before the
image, the same image resumes past it without running the tower again), and a peer fetch
carries an image conversation's resume point; a step encodes at most its image budget; a
request with images that the engine cannot take is refused, naming `images`, and changes
nothing."""

import numpy as np
import pytest
import torch

from cairn.workers import Engine, SamplingParams
from cairn.workers.engine_errors import RequestRejected
from cairn.workers.request import GenerateRequest
from cairn.workers.vision.image_input import ImageInput, content_hash
from tests.support.checkpoints import Q35_VISION_IDS, hf_reference_model
from tests.support.stepping import finish

START, END, IMAGE = (Q35_VISION_IDS[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id"))
PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal patch x patch^2 (tests.support.checkpoints.Q35_VISION)
VISION_IDS = sorted(Q35_VISION_IDS.values())
# The random model may pick a vision token: transformers would read a generated one as an image's.
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1,
                        logit_bias={t: -100.0 for t in VISION_IDS})


def image(grid, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(grid[0] * grid[1] * grid[2], PATCH_DIM, generator=g).numpy()


def text(n: int, seed: int) -> list[int]:
    return torch.randint(0, 190, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def with_images(parts) -> tuple[list[int], list[ImageInput]]:
    """A prompt from text runs and (grid, seed) images, each image between start and end tokens."""
    prompt, images = [], []
    for part in parts:
        if isinstance(part, list):
            prompt += part
            continue
        grid, seed = part
        pixels = image(grid, seed)
        prompt.append(START)
        images.append(ImageInput(len(prompt), grid, pixels, content_hash(pixels, grid)))
        prompt += [IMAGE] * (grid[0] * grid[1] * grid[2] // 4) + [END]
    return prompt, images


def run(engine, prompt, images, params=GREEDY, rid="r", salt=None):
    root = engine.spec.hash_root(salt) if salt is not None else None
    engine.add(GenerateRequest(rid, prompt, params, images=images, hash_root=root))
    return finish(engine, [rid])[rid]


@torch.no_grad()
def reference(model, prompt, images, steps: int):
    """transformers' greedy tokens after `prompt` (never a vision token, as GREEDY's bias has it), and
    the logprob of each, one full forward a token."""
    ids, logprobs = list(prompt), []
    pixels = torch.cat([torch.from_numpy(i.pixel_values) for i in images]) if images else None
    grids = torch.tensor([i.grid_thw for i in images]) if images else None
    for _ in range(steps):
        x = torch.tensor([ids])
        kw = dict(pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=(x == IMAGE).long()) if images else {}
        lp = torch.log_softmax(model(input_ids=x, **kw).logits[0, -1].float(), -1)
        choice = int(lp.index_fill(0, torch.tensor(VISION_IDS), -torch.inf).argmax())
        ids.append(choice)
        logprobs.append(float(lp[choice]))
    return ids[len(prompt):], logprobs


CASES = {
    "one_image": [text(5, 1), ((1, 4, 6), 1), text(4, 2)],
    "a_larger_image_over_pages": [text(3, 3), ((1, 10, 8), 2), text(6, 4)],
    "a_one_window_image_last": [text(9, 5), ((1, 2, 2), 3)],
    "two_images": [text(4, 6), ((1, 4, 4), 4), text(3, 7), ((1, 6, 2), 5), text(2, 8)],
}


@pytest.fixture(scope="module", params=["q35_vision", "q35_moe_vision"])
def vl(request, hf_checkpoint):
    path = hf_checkpoint(request.param)
    return path, hf_reference_model(path)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_greedy_tokens_and_logprobs_with_images_match_transformers(vl, case):
    path, model = vl
    prompt, images = with_images(case)
    engine = Engine.from_pretrained(path, num_pages=32, max_num_seqs=2)
    out = run(engine, prompt, images)
    tokens, logprobs = reference(model, prompt, images, GREEDY.max_tokens)
    assert out.token_ids == tokens
    np.testing.assert_allclose([lp.logprob for lp in out.logprobs], logprobs, atol=2e-4)
    assert engine.runner.encoder.encoded == len(images)


def test_a_prefill_chunked_through_an_image_computes_what_one_chunk_computes(vl):
    path, model = vl
    prompt, images = with_images(CASES["a_larger_image_over_pages"])  # the image's 20 tokens start at 4
    engine = Engine.from_pretrained(path, num_pages=32, max_num_seqs=2, max_num_batched_tokens=8)
    out = run(engine, prompt, images)
    assert out.token_ids == reference(model, prompt, images, GREEDY.max_tokens)[0]
    assert engine.runner.encoder.encoded == 1  # encoded in the first chunk, read from the encoder's cache after


def test_the_cache_keys_image_tokens_by_the_image(vl):
    """Turn 2 extends turn 1 (an image in it) and its reply. With the same image it resumes past
    the image, the tower not run again, and computes transformers' tokens at the right positions;
    with another image of the same size (the same token ids) it resumes before the image's first
    token and computes what a cold engine computes."""
    path, model = vl
    engine = Engine.from_pretrained(path, num_pages=64, max_num_seqs=2, cache_policy="all")
    prompt, images = with_images([text(20, 9), ((1, 4, 6), 7), text(14, 10)])
    first = run(engine, prompt, images, rid="turn1")
    second = prompt + first.token_ids + text(9, 11)
    out = run(engine, second, images, rid="turn2")
    assert out.cached_tokens > images[0].first_token + 6 and engine.runner.encoder.encoded == 1
    assert out.token_ids == reference(model, second, images, GREEDY.max_tokens)[0]

    other_pixels = image((1, 4, 6), seed=99)
    other = [ImageInput(images[0].first_token, (1, 4, 6), other_pixels, content_hash(other_pixels, (1, 4, 6)))]
    swapped = run(engine, second, other, rid="swapped")
    assert 0 < swapped.cached_tokens <= images[0].first_token
    cold = Engine.from_pretrained(path, num_pages=64, max_num_seqs=2)
    assert swapped.token_ids == run(cold, second, other).token_ids
    assert swapped.token_ids != out.token_ids or swapped.logprobs != out.logprobs


def test_requests_with_images_an_engine_cannot_take_are_refused_naming_images(vl, hf_checkpoint):
    path, _ = vl
    engine = Engine.from_pretrained(path, num_pages=32, max_num_seqs=2)
    prompt, images = with_images(CASES["one_image"])
    bad = {
        "no image for the placeholders": (prompt, []),
        "an image over text tokens": (prompt, [ImageInput(0, (1, 4, 6), images[0].pixel_values, b"x" * 16)]),
        "pixels that do not fit the grid": (prompt, [ImageInput(images[0].first_token, (1, 4, 4),
                                                                 images[0].pixel_values, b"x" * 16)]),
        "not an ImageInput": (prompt, [images[0].pixel_values]),
    }
    for why, (p, i) in bad.items():
        with pytest.raises(RequestRejected, match="images") as e:
            engine.add(GenerateRequest("bad", p, GREEDY, images=i))
        assert e.value.param == "images", why
    assert not engine.has_unfinished() and "bad" not in engine._requests
    text_only = Engine.from_pretrained(hf_checkpoint("q35_dense"), num_pages=32, max_num_seqs=2)
    with pytest.raises(RequestRejected, match="no images"):
        text_only.add(GenerateRequest("bad", [1, 2, 3], GREEDY, images=images))
    assert run(engine, prompt, images).finish_reason == "length"  # the engine still serves


def test_a_step_encodes_at_most_its_image_budget_and_computes_the_same(vl):
    """Two images of 6 tokens in one prompt, a budget of 8 image tokens a step: the first step's
    chunk ends before the second image (its first image always fits), the next takes it; a
    decode running beside it is not held back; the tokens equal an unbudgeted engine's."""
    path, model = vl
    prompt, images = with_images(CASES["two_images"])  # images of 4 and 3 tokens, a budget of 5
    engine = Engine.from_pretrained(path, num_pages=64, max_num_seqs=2, max_image_tokens_per_step=5)
    other = engine.add_request(text(6, 20), GREEDY)
    engine.step()  # `other` is decoding from here on
    engine.add(GenerateRequest("r", prompt, GREEDY, images=images))
    plan = engine.scheduler.schedule()
    chunk = next(seg for seg in plan.prefills if seg.seq.request_id == "r")
    assert chunk.num_tokens == images[1].first_token and [s.seq.request_id for s in plan.decodes] == [other]
    engine.scheduler.abandon(plan)
    out = finish(engine, ["r"])["r"]
    assert out.token_ids == reference(model, prompt, images, GREEDY.max_tokens)[0]


def test_a_peer_fetch_brings_an_image_conversations_resume_point(vl):
    """A holder served turn 1 (an image in it); a receiver fetches its resume point by the pages'
    keyed hashes, resumes turn 2 past the image without running its tower, and computes what it
    computes cold."""
    from cairn.workers.vision.image_input import prompt_keys

    path, _ = vl
    holder, receiver = (Engine.from_pretrained(path, num_pages=64, max_num_seqs=2, cache_policy="all", worker_id=w)
                        for w in ("holder", "receiver"))
    prompt, images = with_images([text(20, 30), ((1, 4, 6), 31), text(24, 32)])
    first = run(holder, prompt, images, rid="t1")
    turn2 = prompt + first.token_ids + text(7, 33)
    root = receiver.spec.hash_root()
    hashes = receiver.spec.page_hashes(prompt_keys(turn2, images, 2), root)
    depth = len(prompt) // 16
    plan = receiver.fetches.plan(hashes, len(turn2), depth)
    export = holder.fetches.export(hashes, plan.first, plan.depth)
    assert export is not None and receiver.fetches.import_(export, hashes, plan.first) == depth
    receiver.add(GenerateRequest("t2", turn2, GREEDY, images=images, page_hashes=hashes, hash_root=root))
    got = finish(receiver, ["t2"])["t2"]
    assert got.cached_tokens >= depth * 16 > images[0].first_token + 6 and receiver.runner.encoder.encoded == 0
    cold = run(receiver, turn2, images, rid="cold", salt="cold")
    assert cold.cached_tokens == 0 and cold.token_ids == got.token_ids
    np.testing.assert_allclose([lp.logprob for lp in got.logprobs], [lp.logprob for lp in cold.logprobs], atol=1e-4)


@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_under_speculative_decoding_a_sequence_with_images_does_not_draft_and_computes_the_same(tmp_path, exact):
    """An image chat beside a text one that drafts (the MTP head's drafts, verified): the image
    sequence drafts nothing and decodes at its positions beside verify rows; both compute what an
    engine without speculative decoding computes."""
    from cairn.workers.demo import write_demo_model
    from cairn.workers.vision.image_input import image_input
    from cairn.workers.vision.image_processing import load_preprocessor_config, preprocess_image
    from tests.api.test_api_images import png

    path = write_demo_model(tmp_path / "vl-mtp", arch="qwen3_5", vision=True, mtp=True)
    pad = Engine.from_pretrained(path, num_pages=64, dtype="float32").vision.image_token_id
    image = preprocess_image(png(64, 48, seed=3), load_preprocessor_config(path), max_source_pixels=10**6)
    prompt = list(range(5, 25)) + [pad] * image.num_image_tokens + list(range(30, 40))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    outs = []
    for k in (0, 2):
        engine = Engine.from_pretrained(path, num_pages=128, dtype="float32", num_speculative_tokens=k,
                                        speculative_exact=exact, speculative_adaptive=False)
        engine.add(GenerateRequest("image", prompt, params, images=[image_input(image, 20)]))
        engine.add(GenerateRequest("text", list(range(50, 90)), params))
        outs.append(finish(engine, ["image", "text"]))
        if k:
            assert engine.speculation.draft_tokens > 0  # the text sequence drafted
            assert engine.speculation.draft_tokens <= 2 * params.max_tokens  # ... and only it
    for rid in ("image", "text"):
        assert outs[1][rid].token_ids == outs[0][rid].token_ids
        np.testing.assert_allclose([lp.logprob for lp in outs[1][rid].logprobs],
                                   [lp.logprob for lp in outs[0][rid].logprobs], atol=1e-4)


@pytest.mark.parametrize("tiers", ["spare, host off", "spare, host on", "pressure, host on"])
def test_a_five_turn_chat_with_an_image_resumes_each_turn_at_the_last_prompt_on_every_tier(vl, tiers):
    """Each turn extends the last prompt and its reply; between turns two other conversations with
    images of their own run. With memory to spare (host tier off or on), and with a device cache
    too small to keep the conversation beside them but a host tier, every turn resumes within 2
    tokens of the last prompt and computes what a cold engine computes."""
    path, _ = vl
    sizes = dict(num_pages=256) if tiers.startswith("spare") else dict(cache_memory_bytes=30 * 4096)  # 30 blocks
    if tiers.endswith("host on"):
        sizes["host_cache_bytes"] = 2000 * 4096
    engine = Engine.from_pretrained(path, max_num_seqs=2, cache_policy="cairn", **sizes)
    cold = Engine.from_pretrained(path, num_pages=256, max_num_seqs=2)
    prompt, images = with_images([text(20, 40), ((1, 4, 6), 41), text(10, 42)])
    for turn in range(5):
        out = run(engine, prompt, images, rid=f"turn{turn}")
        if turn:
            assert out.cached_tokens >= last - 2, (turn, out.cached_tokens, last)
        reference = run(cold, prompt, images, rid=f"cold{turn}", salt=f"cold{turn}")
        assert out.token_ids == reference.token_ids
        for k in range(2):  # other conversations, each with its own picture
            other, pictures = with_images([text(30, 50 + 10 * turn + k), ((1, 6, 6), 60 + 10 * turn + k), text(20, 7)])
            run(engine, other, pictures, rid=f"other{turn}-{k}")
        last = len(prompt)
        prompt = prompt + out.token_ids + text(12, 70 + turn)
    if tiers.startswith("pressure"):
        assert engine.cache.stats.pages_demoted > 0 and engine.metrics().checkpoints_from_host_total > 0
    engine.check()


def test_one_token_chunks_through_images_compute_what_one_chunk_computes(vl):
    """A step of one token (the token budget, a tenant's share or the image budget can leave one)
    inside a prompt with images runs as a prefill row: image tokens get their embeddings and
    M-RoPE positions, text between images its shift."""
    path, model = vl
    prompt, images = with_images(CASES["two_images"])
    engine = Engine.from_pretrained(path, num_pages=32, max_num_seqs=2, max_num_batched_tokens=1)
    out = run(engine, prompt, images)
    tokens, logprobs = reference(model, prompt, images, GREEDY.max_tokens)
    assert out.token_ids == tokens
    np.testing.assert_allclose([lp.logprob for lp in out.logprobs], logprobs, atol=2e-4)
    assert engine.runner.encoder.encoded == len(images)
