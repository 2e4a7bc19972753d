"""The demo tokenizer: a byte-level BPE trained locally, with Qwen3's control tokens.

Contract:
- `train_tokenizer(vocab_size)` returns a `tokenizers.Tokenizer` with exactly `vocab_size`
  tokens: 256 byte tokens, BPE merges learned from `corpus.training_corpus`, then the control
  tokens at the top of the id range in `CONTROL_TOKENS` order (as Qwen places them). It is a
  function of `vocab_size` alone — the same on every machine and in every process — and takes
  well under a second for 512 tokens. It raises `ValueError` if the corpus cannot fill the vocab.
- Pre-tokenization is Qwen2's split regex followed by byte-level mapping (`byte_level_bpe`, which
  the peer benchmark's Qwen2-vocabulary tokenizer shares); no normalizer, so any Unicode string
  (including non-NFC text) decodes back to itself. `add_control_tokens` adds the control tokens.
- `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are special (skipped by
  `decode(skip_special_tokens=True)`); the think / tool-call / tool-response tags are added but
  not special, so decoded model output keeps them for reasoning and tool-call parsers.
- `write_tokenizer_files` writes `tokenizer.json`, `tokenizer_config.json` (with the chat
  template inline) and `chat_template.jinja` (transformers 5 reads this one first): Qwen3's
  conventions for `qwen3_next`, Qwen3.5's (thinking opened by the generation prompt, XML tool
  calls) for the Qwen3.5 architectures.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from cairn.workers.demo.corpus import training_corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
)
CONTROL_TOKENS = SPECIAL_TOKENS + ADDED_TOKENS
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The chat template each demo architecture ships: Qwen3's conventions, or Qwen3.5's.
CHAT_TEMPLATES = {"qwen3_next": Path(__file__).with_name("chat_template.jinja"),
                  "qwen3_5": Path(__file__).with_name("chat_template_qwen3_5.jinja"),
                  "qwen3_5_moe": Path(__file__).with_name("chat_template_qwen3_5.jinja")}


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE with exactly `vocab_size` tokens, control tokens last."""
    n_learned = vocab_size - len(CONTROL_TOKENS)
    tokenizer = byte_level_bpe(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=n_learned, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_corpus(max(400, n_learned * 3)), trainer=trainer)
    if tokenizer.get_vocab_size() != n_learned:
        raise ValueError(f"expected {n_learned} learned tokens, got {tokenizer.get_vocab_size()}")
    add_control_tokens(tokenizer)
    return tokenizer


def byte_level_bpe(model: models.BPE) -> Tokenizer:
    """A tokenizer running `model` after Qwen2's split regex and the byte-level mapping."""
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def add_control_tokens(tokenizer: Tokenizer) -> None:
    """`SPECIAL_TOKENS` as special tokens, `ADDED_TOKENS` as added ones (kept in decoded text);
    each takes the id the vocabulary already gives it, else the next free one."""
    tokenizer.add_special_tokens([_control(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([_control(t, special=False) for t in ADDED_TOKENS])


def _control(content: str, special: bool) -> AddedToken:
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                      special=special)


def write_tokenizer_files(out_dir: Path, tokenizer: Tokenizer, model_max_length: int,
                          arch: str = "qwen3_next") -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja (the one `arch`
    ships) into `out_dir`."""
    template = CHAT_TEMPLATES[arch].read_text(encoding="utf-8")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
