"""What a tenant's earlier prompts share with a new one, in the model's tokens: the most a resume
may reuse without reading another tenant's cache (or inventing a state)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_ids(model_dir: Path | str, messages: list[dict]) -> list[int]:
    """The prompt the server renders for `messages` (its chat template, the generation prompt on)."""
    return list(_tokenizer(str(model_dir)).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])


def shared_prefix(model_dir: Path | str, messages: list[dict], earlier: list[list[dict]]) -> int:
    """The longest prefix of tokens `messages` shares with any of the `earlier` chats (0: none)."""
    ids = chat_ids(model_dir, messages)
    best = 0
    for other in earlier:
        theirs = chat_ids(model_dir, other)
        n = next((i for i, (a, b) in enumerate(zip(ids, theirs)) if a != b), min(len(ids), len(theirs)))
        best = max(best, n)
    return best
