"""Images through the API with the official `openai` client, on `cairn demo-model --vision`: an
`image_url` part (a data: URL) in chat completions, streaming and not, computes what the engine
computes for the same prompt given directly; a 5-turn chat with an image in turn 1 resumes every
turn past the image; the same tokens with another image share nothing from the image on; bad
images are 400s naming their content part, and the server serves on; remote and file URLs are
off unless allowed, and an allowed directory's file is read; a text-only model answers 400."""

import base64
import io

import numpy as np
import openai
import pytest
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer

from cairn.cluster.api import APIOptions, build_app
from cairn.cluster.api.chat_template import ChatTemplate
from cairn.cluster.api.engine_client import LocalEngineClient
from cairn.cluster.api.server import BackgroundServer
from cairn.workers import EngineFront
from cairn.workers.demo import write_demo_model
from cairn.workers.vision.image_processing import load_preprocessor_config, preprocess_image

MODEL = "vl"


def png(width: int, height: int, seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, text: str = "What does this show?") -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo-vl"), arch="qwen3_5", vision=True)


@pytest.fixture(scope="module")
def server(vl_dir, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed-images")
    (allowed / "a.png").write_bytes(png(40, 40, seed=5))
    engine = EngineFront.from_pretrained(vl_dir, num_pages=512, dtype="float32")
    options = APIOptions(served_model_name=MODEL, image_url_allow=(allowed.as_uri() + "/",))
    with BackgroundServer(build_app(LocalEngineClient(engine), vl_dir, options)) as s:
        s.allowed = allowed
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def ask(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, **kw)


def test_an_image_streams_and_answers_as_it_does_whole(client):
    messages = [image_message(data_url(png(70, 50, seed=1)))]
    whole = ask(client, messages, logprobs=True)
    chunks = list(ask(client, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.usage.prompt_tokens > 8  # the image's tokens are prompt tokens
    other = ask(client, [image_message(data_url(png(70, 50, seed=2)))], logprobs=True)
    assert [t.logprob for t in other.choices[0].logprobs.content] != \
        [t.logprob for t in whole.choices[0].logprobs.content]  # the image is read, not its placeholder


def image_start(model_dir, messages) -> int:
    """Where the first image's tokens start in the prompt the server renders for `messages`."""
    shown = [dict(m, content=[p if p["type"] == "text" else {"type": "image"} for p in m["content"]])
             if isinstance(m["content"], list) else m for m in messages]
    text = ChatTemplate.from_dir(model_dir).render(shown)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    return ids.index(tok.token_to_id("<|image_pad|>"))


def rendered(model_dir, messages, image_tokens: int) -> list[int]:
    """The prompt the server renders for `messages` (one image): its pad token expanded."""
    start = image_start(model_dir, messages)
    shown = [dict(m, content=[p if p["type"] == "text" else {"type": "image"} for p in m["content"]])
             if isinstance(m["content"], list) else m for m in messages]
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(
        ChatTemplate.from_dir(model_dir).render(shown), add_special_tokens=False).ids
    return ids[:start] + ids[start:start + 1] * image_tokens + ids[start + 1:]


def shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_a_five_turn_chat_with_a_png_equals_transformers_and_resumes_each_turn_at_the_last_prompt(client, vl_dir):
    """The issue's Done-when, through the official client: a PNG in turn 1 of a 5-turn chat (the
    template drops each answer's thinking); each turn's tokens equal transformers' greedy tokens
    for the prompt the server rendered, turns 2-5 resume within 2 tokens of what they share with
    the previous prompt, and the same history with another picture in turn 1 resumes before it."""
    data = png(64, 64, seed=3)
    image = preprocess_image(data, load_preprocessor_config(vl_dir), max_source_pixels=10**6)
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl_dir).eval()
    tok = Tokenizer.from_file(str(vl_dir / "tokenizer.json"))
    pad = tok.token_to_id("<|image_pad|>")
    messages = [{"role": "system", "content": "You describe pictures."}, image_message(data_url(data))]
    last = None
    for turn in range(5):
        out = ask(client, messages, logprobs=True)
        ids = rendered(vl_dir, messages, image.num_image_tokens)
        assert out.usage.prompt_tokens == len(ids)
        cached = out.usage.prompt_tokens_details.cached_tokens
        if last is None:
            assert cached == 0
        else:
            assert shared(ids, last) - 2 <= cached <= shared(ids, last), (turn, cached, shared(ids, last))
        last = ids
        x = torch.tensor([ids])
        with torch.no_grad():
            expected = model.generate(x, pixel_values=torch.from_numpy(image.pixel_values),
                                      image_grid_thw=torch.tensor([image.grid_thw]), mm_token_type_ids=(x == pad).long(),
                                      max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
        got = b"".join(bytes(t.bytes) for t in out.choices[0].logprobs.content)
        assert got.decode("utf-8", "replace") == tok.decode(expected, skip_special_tokens=False), (turn, got)
        assert len(out.choices[0].logprobs.content) == len(expected) == 4
        messages += [{"role": "assistant", "content": out.choices[0].message.content or ""},
                     {"role": "user", "content": f"And what else, in turn {turn + 2}?"}]
    messages[1] = image_message(data_url(png(64, 64, seed=4)))
    swapped = ask(client, messages[:-2] + messages[-1:])
    assert 0 < swapped.usage.prompt_tokens_details.cached_tokens <= image_start(vl_dir, messages)


BAD = {
    "corrupt base64": "data:image/png;base64,@@@not-base64@@@",
    "not an image": data_url(b"plain text, not pixels", "image/png"),
    "a text data URL": data_url(b"hello", "text/plain"),
    "a remote URL": "https://example.com/cat.png",
    "a file outside the allowed directory": "file:///etc/hostname",
}


@pytest.mark.parametrize("url", BAD.values(), ids=BAD.keys())
def test_a_bad_image_is_a_400_naming_its_content_part_and_the_server_serves_on(client, url):
    messages = [{"role": "user", "content": "first"}, image_message(url)]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, messages)
    assert e.value.body["param"] == "messages[1].content[0]"
    assert ask(client, [image_message(data_url(png(20, 20, seed=9)))]).choices[0].finish_reason == "length"


def test_too_many_images_is_a_413_and_too_many_pixels_a_400(client):
    many = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(8, 8, 0))}}] * 17}]
    with pytest.raises(openai.APIStatusError) as e:
        ask(client, many)
    assert e.value.status_code == 413
    huge = Image.new("RGB", (9000, 9000))
    buf = io.BytesIO()
    huge.save(buf, format="PNG")
    with pytest.raises(openai.BadRequestError, match="pixels"):
        ask(client, [image_message(data_url(buf.getvalue()))])


def test_a_file_under_an_allowed_directory_is_read(client, server, vl_dir):
    """The same bytes as a file and as a data URL: the same image, so the second resumes past it."""
    by_file = ask(client, [image_message((server.allowed / "a.png").as_uri(), "a file")], logprobs=True)
    messages = [image_message(data_url(png(40, 40, seed=5)), "a file")]
    by_data = ask(client, messages, logprobs=True)
    assert by_data.usage.prompt_tokens_details.cached_tokens > image_start(vl_dir, messages)
    np.testing.assert_allclose([t.logprob for t in by_file.choices[0].logprobs.content],
                               [t.logprob for t in by_data.choices[0].logprobs.content], atol=1e-5)


def test_a_text_only_model_answers_400_for_an_image(tiny_model_dir):
    engine = EngineFront.from_pretrained(tiny_model_dir, num_pages=64)
    app = build_app(LocalEngineClient(engine), tiny_model_dir, APIOptions(served_model_name=MODEL))
    with BackgroundServer(app) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="no images") as e:
            ask(c, [image_message(data_url(png(20, 20, seed=1)))])
        assert e.value.body["param"] == "messages[0].content[0]"
