"""Per-sequence token counts on the logits' device, for the penalties of `SamplingParams`.

Contract: a sequence with a penalty (`SamplingParams.penalised`) gets a row the first time it
samples, and keeps it until it finishes, preemptions included (its output tokens survive them,
and so do their counts). A row holds `counts` [vocab] int32, how often each token is in the
output, and `prompt` [vocab] bool, which tokens are in the prompt (for `repetition_penalty`).
The row is filled once, from the prompt and the output so far (one upload per sequence); after
that `add` counts each step's sampled ids on the device, so no step reads or rebuilds a row on
the host. A verify step's drafted row (speculative decoding) reads a scratch row: its
sequence's counts and the drafted tokens before it (`scratch`); the tokens such a step keeps
past its first row are counted from the host (`add_tokens`). Rows of finished sequences are
reused; the table grows by doubling, so its memory is (the most penalised sequences at once,
and the drafted rows of one step) x vocab x 5 bytes.
"""

from __future__ import annotations

import torch

from cairn.workers.sequence import Sequence


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu"):
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=self.device)
        self._rows: dict[int, tuple[Sequence, int]] = {}  # id(seq) -> (seq, row)
        self._free: list[int] = []
        self._scratch: list[int] = []  # rows lent for one draw (`scratch`)

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's row, assigned and filled on first sight; releases the rows of
        sequences that finished since the last call, and the last draw's scratch rows."""
        self.release_scratch()
        for key, (seq, row) in list(self._rows.items()):
            if seq.finished:
                del self._rows[key]
                self._free.append(row)
        out = []
        for seq in seqs:
            held = self._rows.get(id(seq))
            if held is None:
                held = (seq, self._fill(seq))
                self._rows[id(seq)] = held
            out.append(held[1])
        return out

    def scratch(self, row: int, tokens: list[int]) -> int:
        """A row lent until the next `rows` call: `row`'s counts and prompt, with `tokens` counted
        as output too (a verify step's drafted row: its sequence's output and the drafted tokens
        before it, cairn.workers.speculative)."""
        if not self._free:
            self._grow()
        lent = self._free.pop()
        self._scratch.append(lent)
        self.counts[lent] = self.counts[row]
        self.prompt[lent] = self.prompt[row]
        ids = torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
        self.counts[lent].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return lent

    def release_scratch(self) -> None:
        self._free += self._scratch
        self._scratch = []

    def add_tokens(self, seq: Sequence, tokens: list[int]) -> None:
        """Counts `tokens` (host ids) as `seq`'s output (its row must exist)."""
        row = self._rows[id(seq)][1]
        ids = torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
        self.counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def _fill(self, seq: Sequence) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        ids = torch.tensor(seq.token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        n_prompt = len(seq.prompt_token_ids)
        self.prompt[row].zero_()
        self.prompt[row, ids[:n_prompt]] = True
        self.counts[row].zero_()
        self.counts[row].index_add_(0, ids[n_prompt:], torch.ones_like(ids[n_prompt:], dtype=torch.int32))
        return row

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(4, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], prompt[:old] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt
        self._free.extend(range(new - 1, old - 1, -1))

    def add(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Counts the sampled `ids` [n] (on the device; -1 for a faulted row, not counted) into
        `rows` [n] int64."""
        ok = ids >= 0
        self.counts.index_put_((rows, ids.clamp(min=0)), ok.to(torch.int32), accumulate=True)
