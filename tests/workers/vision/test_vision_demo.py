"""`cairn demo-model --vision`: a Qwen3.5 vision-language checkpoint in the published layout that
transformers loads (model, tokenizer with its chat template, image processor), whose template
renders an image part as Qwen3.5's does, and on which the engine computes what transformers
computes for a chat with an image."""

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from cairn.workers import Engine, SamplingParams
from cairn.workers.demo import write_demo_model
from cairn.workers.request import GenerateRequest
from cairn.workers.vision.image_input import image_input
from cairn.workers.vision.image_processing import load_preprocessor_config, preprocess_image
from tests.support.stepping import finish


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo-vl"), arch="qwen3_5", vision=True)


def png(width: int, height: int, seed: int) -> bytes:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_the_text_keeps_its_ids_and_an_image_part_renders_as_qwen3_5s(demo, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(demo)
    text_only = transformers.AutoTokenizer.from_pretrained(write_demo_model(tmp_path / "text", arch="qwen3_5"))
    sample = "<|im_start|>user\nhello world, a <tool_call> and <think><|im_end|>"
    assert tok(sample)["input_ids"] == text_only(sample)["input_ids"]
    assert len(tok) == len(text_only) + 4
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}},
                                             {"type": "text", "text": "what is it?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is it?<|im_end|>")
    assert [len(tok.convert_tokens_to_ids([t])) for t in ("<|vision_start|>", "<|image_pad|>")] == [1, 1]


def test_a_chat_with_an_image_computes_what_transformers_computes(demo):
    tok = transformers.AutoTokenizer.from_pretrained(demo)
    image = preprocess_image(png(70, 50, seed=1), load_preprocessor_config(demo), max_source_pixels=10**6)
    reference_pixels = transformers.AutoImageProcessor.from_pretrained(demo)(
        Image.open(io.BytesIO(png(70, 50, seed=1))), return_tensors="np")
    np.testing.assert_array_equal(image.pixel_values, reference_pixels["pixel_values"])
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    at = ids.index(pad)
    ids = ids[:at] + [pad] * image.num_image_tokens + ids[at + 1:]
    model = transformers.AutoModelForImageTextToText.from_pretrained(demo).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x, pixel_values=torch.from_numpy(image.pixel_values),
                       image_grid_thw=torch.tensor([image.grid_thw]), mm_token_type_ids=(x == pad).long()).logits
    expected = torch.log_softmax(logits[0, -1].float(), -1)
    engine = Engine.from_pretrained(demo, num_pages=64, max_num_seqs=2, dtype="float32")
    engine.add(GenerateRequest("r", ids, SamplingParams(max_tokens=1, temperature=0, logprobs=3),
                               images=[image_input(image, at)]))
    out = finish(engine, ["r"])["r"]
    assert [t for t, _ in out.logprobs[0].top] == torch.topk(expected, 3).indices.tolist()
    torch.testing.assert_close(torch.tensor([lp for _, lp in out.logprobs[0].top]), torch.topk(expected, 3).values,
                               atol=2e-4, rtol=0)


def test_the_command_writes_a_vision_checkpoint_and_refuses_qwen3_next(tmp_path):
    run = [sys.executable, "-m", "cairn.cluster.cli", "demo-model"]
    done = subprocess.run(run + [str(tmp_path / "vl"), "--arch", "qwen3_5_moe", "--vision"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and (tmp_path / "vl" / "preprocessor_config.json").exists()
    assert transformers.AutoConfig.from_pretrained(tmp_path / "vl").architectures == [
        "Qwen3_5MoeForConditionalGeneration"]
    refused = subprocess.run(run + [str(tmp_path / "no"), "--vision"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "qwen3_5" in refused.stderr and not (tmp_path / "no").exists()
