"""`write_demo_model`: a random-weight hybrid checkpoint in Hugging Face layout.

Contract: `write_demo_model(out_dir, size, seed, arch)` creates `out_dir` (parents included) and
writes `config.json`, `model.safetensors` (fp32), `tokenizer.json`, `tokenizer_config.json`,
`chat_template.jinja` and `generation_config.json` (and, with `vision`, `preprocessor_config.json`),
overwriting those files and touching
nothing else. Both transformers (`AutoModelForCausalLM` / `AutoTokenizer`, offline) and our
engine load the result. `arch` is one of `ARCHS` (cairn.workers.demo.shape): `qwen3_next` (the
default), `qwen3_5` or `qwen3_5_moe`. The output is a pure function of (size, seed, arch): same
arguments, same bytes; the tokenizer depends on the size only. Writes only under `out_dir` and
prints nothing. Unknown sizes or architectures raise `ValueError`. A caller with a vocabulary of
its own passes `tokenizer` (a `tokenizers.Tokenizer` holding `EOS_TOKEN` and `PAD_TOKEN`) and
`vocab_size` (the embedding rows, at least its largest id + 1): the checkpoint is then `size`'s
shape with that vocabulary (the peer benchmark's model, benchmarks/peer_model.py).
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer

from cairn.workers.demo.shape import ARCHS, SIZES, hf_config
from cairn.workers.demo.demo_tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer, write_tokenizer_files
from cairn.workers.demo.vision_demo import (VISION_TOKENS, preprocessor_config, vision_language_config,
                                             vision_language_weights)
from cairn.workers.demo.weights import random_weights


def write_demo_model(out_dir: str | Path, size: str = "tiny", seed: int = 0, arch: str = "qwen3_next",
                     tokenizer: Tokenizer | None = None, vocab_size: int | None = None, mtp: bool = False,
                     vision: bool = False) -> Path:
    """Write the demo checkpoint of `size` ("tiny" or "bench") and `arch` into `out_dir`, with the
    demo tokenizer or `tokenizer` and `vocab_size`, and with `mtp` a random MTP head (`mtp.*`,
    `mtp_num_hidden_layers` 1); with `vision` (a Qwen3.5 arch, the demo tokenizer), the published
    vision-language layout with a random tower (cairn.workers.demo.vision_demo); return its path."""
    if size not in SIZES:
        raise ValueError(f"expected size in {sorted(SIZES)}, got {size!r}")
    if arch not in ARCHS:
        raise ValueError(f"expected arch in {list(ARCHS)}, got {arch!r}")
    if (tokenizer is None) != (vocab_size is None):
        raise ValueError("a tokenizer of the caller's comes with its vocab_size, and only with it")
    if vision and (arch == "qwen3_next" or tokenizer is not None):
        raise ValueError("a vision demo model is a Qwen3.5 architecture with the demo tokenizer")
    shape = SIZES[size] if vocab_size is None else dataclasses.replace(SIZES[size], vocab_size=vocab_size)
    if tokenizer is not None and max(tokenizer.get_vocab().values()) >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} leaves out ids of the tokenizer's")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = tokenizer or train_tokenizer(shape.vocab_size)
    if vision:  # its tokens after the control tokens: the text keeps its ids
        tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in VISION_TOKENS])
        shape = dataclasses.replace(shape, vocab_size=tokenizer.get_vocab_size())
    write_tokenizer_files(out, tokenizer, model_max_length=shape.max_position_embeddings, arch=arch)
    eos, pad = tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id(PAD_TOKEN)
    config = hf_config(shape, {"eos": eos, "bos": None, "pad": pad}, arch)
    if vision:
        config = vision_language_config(config, shape, {t: tokenizer.token_to_id(t) for t in VISION_TOKENS})
        _write_json(out / "preprocessor_config.json", preprocessor_config(size))
    if mtp:
        text = config.get("text_config", config)
        text["mtp_num_hidden_layers"] = 1
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {
        "eos_token_id": [eos, pad],  # <|im_end|> ends a turn; <|endoftext|> ends a document
        "pad_token_id": pad,
        "bos_token_id": None,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
    })
    weights = random_weights(shape, seed, arch, mtp)
    if vision:
        weights = vision_language_weights(weights, config["vision_config"], seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # readable like the other files, by other users too
    return out


def demo_model_dir(size: str = "tiny", arch: str = "qwen3_next", trained_mtp: bool = False) -> Path:
    """The demo checkpoint of `size` and `arch` under $CAIRN_HOME (default ~/.cache/cairn),
    written on first use. What `cairn serve` and `cairn generate` run when no --model is given.
    `trained_mtp`: the one trained for speculative decoding, with its MTP head
    (cairn.workers.demo.speculative_training: minutes on CPU, the first time)."""
    home = Path(os.environ.get("CAIRN_HOME") or Path.home() / ".cache" / "cairn")
    from cairn.workers.demo.speculative_training import RECIPE

    name = (f"demo-{size}" if arch == "qwen3_next" else f"demo-{arch}-{size}") + \
        (f"-mtp-trained{RECIPE}" if trained_mtp else "")
    out = home / name
    if not (out / "model.safetensors").exists():
        tmp = home / f".{name}-{os.getpid()}"
        write_demo_model(tmp, size=size, arch=arch)
        if trained_mtp:
            from cairn.workers.demo.speculative_training import train_for_speculation

            train_for_speculation(tmp)
        try:
            tmp.rename(out)  # atomic: a concurrent first use never sees half a checkpoint
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
