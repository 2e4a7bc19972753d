"""What the benchmarks replay and what they measure it against: conversation text and the oracle.

Shared by multiturn.py (one engine, in process) and routing.py (a Serve cluster, over HTTP).

- `WORDS`: the vocabulary of generated text, plain words the demo tokenizer knows;
  `MULTITURN_WORDS`: all but the last two, the ones multiturn.py's traces draw from.
- `sentence(rng, n_words, vocabulary)`: `n_words` words drawn uniformly from `vocabulary`,
  capitalized, ending in a full stop. `rng` is a `random.Random` (routing.py) or a
  `torch.Generator` (multiturn.py). Each script keeps its own generator and vocabulary, so its
  traces, and so its numbers, are the ones it always measured.
- `text_of_tokens(tokenizer, rng, tokens, head)`: `head`, then 20-word sentences until the text
  is at least `tokens` tokens long, counted by `tokenizer.encode`: a system prompt of a size.
- `AGENT_TOOLS`, `tool_round(rng, round_index, content, vocabulary)`: an agent loop's tools and
  one round of it as the client sends it back: the assistant turn (the model's `content` and a
  call of `look_up` whose arguments the client makes up) and the tool's result, a sentence.
- `Oracle(page_tokens)`: the cache of a server with unlimited memory and a recurrent state at
  every token. `hit_tokens(prompt)` is what a request arriving now could reuse: the longest common
  prefix, in tokens, of its prompt with every sequence inserted so far, capped at len(prompt) - 1
  (a request computes at least its last prompt token); the prompt then counts as seen
  (`lcp_tokens(ids)`: the prefix alone, uncapped, nothing inserted). `insert(ids)` adds a
  sequence, e.g. a finished request's prompt and answer as its next turn renders them. Sequences
  are indexed in runs of `page_tokens` tokens. With 1 (multiturn.py) the answer is exact. With a
  page (routing.py: 16) it is exact to within a page: a prefix shorter than one page counts 0, and
  past the deepest matching page only the first sequence that reached it is compared; the index is
  that many times smaller.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

WORDS = tuple(("stone cairn ridge trail summit marker path weather snow rock pile guide north map river valley "
               "build stack wide flat base tall lasting winter storm hikers route visible balance moss lichen"
               ).split())
MULTITURN_WORDS = WORDS[:-2]


def sentence(rng: Any, n_words: int, vocabulary: Sequence[str] = WORDS) -> str:
    """`rng`: a random.Random or a torch.Generator."""
    if isinstance(rng, random.Random):
        picks = [rng.randrange(len(vocabulary)) for _ in range(n_words)]  # the stream of rng.choice
    else:
        import torch

        picks = torch.randint(0, len(vocabulary), (n_words,), generator=rng).tolist()
    return " ".join(vocabulary[i] for i in picks).capitalize() + "."


def text_of_tokens(tokenizer: Any, rng: Any, tokens: int, head: str = "",
                   vocabulary: Sequence[str] = WORDS) -> str:
    text = head
    while len(tokenizer.encode(text)) < tokens:
        text += " " + sentence(rng, 20, vocabulary)
    return text


AGENT_TOOLS = [{"type": "function", "function": {
    "name": "look_up", "description": "Reads the trail guide about a place and a topic.",
    "parameters": {"type": "object", "properties": {"place": {"type": "string"}, "topic": {"type": "string"},
                                                   "page": {"type": "integer"}},
                   "required": ["place", "topic"]}}}]


def tool_round(rng: Any, round_index: int, content: str, vocabulary: Sequence[str] = WORDS) -> list[dict]:
    """[assistant turn with one `look_up` call, the tool message answering it]."""
    call_id = f"call_{round_index}"
    arguments = {"place": sentence(rng, 2, vocabulary), "topic": sentence(rng, 3, vocabulary), "page": round_index}
    return [{"role": "assistant", "content": content, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "look_up", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "content": sentence(rng, 16, vocabulary)}]


class Oracle:
    def __init__(self, page_tokens: int = 1):
        self.page_tokens = page_tokens
        self._runs: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent run, its tokens) -> run
        self._first: list[int] = []  # run -> the first sequence that reached it
        self._seqs: list[list[int]] = []

    def hit_tokens(self, prompt: list[int]) -> int:
        hit = min(self.lcp_tokens(prompt), max(len(prompt) - 1, 0))
        self.insert(prompt)
        return hit

    def lcp_tokens(self, ids: list[int]) -> int:
        p, run, depth = self.page_tokens, -1, 0
        for k in range(len(ids) // p):
            run = self._runs.get((run, tuple(ids[k * p:(k + 1) * p])), -1)
            if run < 0:
                break
            depth, last = k + 1, run
        if depth == 0:
            return 0
        other, i = self._seqs[self._first[last]], depth * p
        while i < len(ids) and i < len(other) and ids[i] == other[i]:
            i += 1
        return i

    def insert(self, ids: list[int]) -> None:
        self._seqs.append(ids)
        p, run = self.page_tokens, -1
        for k in range(len(ids) // p):
            key = (run, tuple(ids[k * p:(k + 1) * p]))
            run = self._runs.setdefault(key, len(self._first))
            if run == len(self._first):
                self._first.append(len(self._seqs) - 1)
