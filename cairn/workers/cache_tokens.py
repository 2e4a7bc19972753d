"""A sequence's tokens as the prefix cache keys them, when its prompt has images: `token_ids`
with each image token replaced by its key (cairn.workers.vision.image_input.prompt_keys), read
live, since generated tokens append to `token_ids` and key as themselves. A sequence without
images is keyed by its token list itself (`Sequence.cache_tokens`: no copy). Plain Python.
"""

from __future__ import annotations


class CacheTokens:
    """A sequence's tokens as the cache keys them: `token_ids` with the prompt's image tokens
    replaced by their keys. Reads `token_ids` live (generated tokens append to it); supports
    `len`, an index and a slice (a list)."""

    def __init__(self, token_ids: list[int], prompt_keys: list[int]):
        self.token_ids, self.prompt_keys = token_ids, prompt_keys

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, at):
        n = len(self.prompt_keys)
        if isinstance(at, slice):
            start, stop, step = at.indices(len(self.token_ids))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if stop <= n:
                return self.prompt_keys[start:stop]
            return self.prompt_keys[start:n] + self.token_ids[max(start, n):stop] if start < n else \
                self.token_ids[start:stop]
        i = at + len(self.token_ids) if at < 0 else at
        return self.prompt_keys[i] if 0 <= i < n else self.token_ids[at]
