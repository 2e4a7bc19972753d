"""A conversation with an image is routed to the replica holding it: two engines (the vision demo
model) hold the same token ids with different images behind them. The index hears each engine's
pages keyed by image content; a next turn's page hashes, keyed the same way by the ingress, score
the engine that saw its image past the image and the other only up to it; the ranker sends the
turn to the first, and it resumes there past the image, without running the tower again."""

import asyncio
import random

import numpy as np
import pytest

from cairn.cache_service.index import CacheIndex
from cairn.cluster.routing.ranker import AffinityRanker
from cairn.cluster.routing.routing_config import RoutingConfig
from cairn.workers import Engine, SamplingParams
from cairn.workers.demo import write_demo_model
from cairn.workers.request import GenerateRequest
from cairn.workers.vision.image_input import ImageInput, content_hash, prompt_keys
from tests.support.stepping import finish

SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
GRID = (1, 8, 8)  # 16 tokens at merge 2


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = write_demo_model(tmp_path_factory.mktemp("vl"), arch="qwen3_5", vision=True)
    return {w: Engine.from_pretrained(path, num_pages=256, dtype="float32", worker_id=w) for w in ("a", "b")}


def an_image(first: int, seed: int, patch_dim: int) -> ImageInput:
    pixels = np.random.default_rng(seed).standard_normal((64, patch_dim)).astype(np.float32)
    return ImageInput(first, GRID, pixels, content_hash(pixels, GRID))


def feed(index: CacheIndex, engine: Engine) -> None:
    while (batch := engine.drain_events()) is not None:
        assert index.apply(batch.encode())


def request(engine: Engine, rid: str, prompt: list[int], images: list[ImageInput]) -> GenerateRequest:
    spec, root = engine.spec, engine.spec.hash_root()
    keys = prompt_keys(prompt, images, engine.vision.spatial_merge_size)
    return GenerateRequest(rid, prompt, SHORT, hash_root=root, page_hashes=spec.page_hashes(keys, root),
                           images=images, prompt_keys=keys)


def test_a_turn_goes_to_the_engine_that_holds_its_image_and_resumes_past_it(engines):
    a, b = engines["a"], engines["b"]
    pad, dim = a.vision.image_token_id, a.vision.patch_dim
    index = CacheIndex()
    for e in engines.values():
        feed(index, e)
    prompt = list(range(10, 30)) + [pad] * 16 + list(range(40, 70))  # the image from token 20 to 36
    mine, other = an_image(20, seed=1, patch_dim=dim), an_image(20, seed=2, patch_dim=dim)
    for engine, image in ((a, mine), (b, other)):
        engine.add(request(engine, "t1", prompt, [image]))
        finish(engine, ["t1"])
        feed(index, engine)
    turn2 = prompt + list(range(80, 100))
    config = RoutingConfig(load_weight=0.0).for_engines(a.spec)

    for image, holder in ((mine, "a"), (other, "b")):
        req = request(a, "t2", turn2, [image])
        scores = index.score(req.page_hashes)
        assert scores[holder].hit_pages == len(prompt) // 16  # every whole page of turn 1
        assert max(s.hit_pages for w, s in scores.items() if w != holder) * 16 <= 20  # up to the image, no further

        async def first():
            ranker = AffinityRanker(config, rng=random.Random(0))
            return (await ranker.rank("t2", req, {"a": {}, "b": {}}, index.score, index.states_at)).order[0]
        assert asyncio.run(first()) == holder
    encoded = a.runner.encoder.encoded
    a.add(request(a, "t2", turn2, [mine]))
    assert finish(a, ["t2"])["t2"].cached_tokens >= len(prompt) - 2 and a.runner.encoder.encoded == encoded
