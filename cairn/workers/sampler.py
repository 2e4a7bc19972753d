"""Turns the logits of one step into one token per sampling sequence, batched on their device.

Contract (`Sampler.sample`): one result per row, and the only read of the device is the sampled
ids (with the logprobs asked, in the same copy). `Sampler.draw` is `sample` left on the device:
the ids there (they feed the next step under async scheduling) and their copy to the host
started; `Draw.read()` waits for that copy alone. No Python runs per row on the logits: the host
builds each row's parameters into a few arrays (one aligned upload, pinned and non-blocking on
CUDA: cairn.workers.execution.pinned_upload),
and every step below is a batched op over the rows that need it.

1. Logprobs, when asked, are log_softmax of the raw logits (before anything below), for the
   chosen token and the `logprobs` most likely alternatives.
2. The logits change, in vLLM's order: `logit_bias` is added; while a row has fewer than
   `min_tokens` outputs its EOS and stop ids are masked; the penalties apply from the row's token
   counts on the device (cairn.workers.token_counts): `repetition_penalty` over prompt and output
   tokens, then `frequency_penalty` x count and `presence_penalty` over output tokens; a row
   with a grammar (structured outputs, cairn.workers.grammar) keeps only the tokens its grammar allows
   next: the host fills a packed bitmask per such row (`Grammars.mask`), which goes up with the
   row parameters and is unpacked on the device.
3. Greedy rows (temperature 0 or top_k 1) take the argmax of the changed logits.
4. Sampled rows draw with `kernels.sample_rows` (its rules in cairn/kernels/sample/torch_ops.py:
   temperature, then min-p, top-k and top-p each only where a row asks, by radix selects over
   the weights' float bits instead of sorts; an overflowing temperature is greedy). On CPU it is
   one C++ pass per row (cairn/kernels/sample/sample.cpp), on CUDA batched torch ops.
   The draw takes one uniform per row, from a counter-based hash (cairn.workers.uniforms) of
   (seed, output index) on the device: a seeded request draws the same tokens alone, batched, chunked or preempted, and successive indices are
   independent draws. A request without a seed gets a key of its own from the engine's
   generator at its first sampled row (`Sequence.sample_key`).
5. A speculating engine's drafts are drawn by the same rules from the MTP head's logits
   (`draft_tokens`): a seeded row's with the uniform its verify row will draw with, an unseeded
   sampled row's apart and tested by rejection sampling in its verify row
   (cairn.workers.speculative.draft_sampling).

Faults stay in their row: a row whose logits are not finite, or whose parameters cannot be
prepared (its grammar's mask included), yields a `SequenceFault` in its place; every other row
is sampled as if it were alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cairn import kernels
from cairn.workers.engine_errors import SequenceFault
from cairn.workers.execution.pinned_upload import PinnedUpload
from cairn.workers.grammar import Grammars
from cairn.workers.sequence import Sequence, TokenLogprob
from cairn.workers.speculative.draft_sampling import SampledRows, draw_apart, keep_or_resample
from cairn.workers.token_counts import TokenCounts
from cairn.workers.uniforms import uniforms

log = logging.getLogger(__name__)

@dataclass
class Draw:
    """One step's tokens, drawn on the device and not yet read by the host (`Sampler.draw`)."""
    ids: torch.Tensor  # [rows] int64 on the device: each row's token, -1 where the row faulted
    read: Callable[[], list]  # waits for the copy of this draw alone; one result per row, as `sample`


class _Rows:
    """The host's arrays of one step's rows that took part (faulted ones left out)."""

    def __init__(self):
        self.pos: list[int] = []  # row in the step
        self.temperature: list[float] = []  # 0: greedy
        self.top_k: list[int] = []  # 0: off
        self.top_p: list[float] = []
        self.min_p: list[float] = []
        self.seed: list[int] = []  # -1: unseeded
        self.index: list[int] = []
        self.logprobs: list[int] = []  # -1: not asked
        self.penalised: list[int] = []  # positions (in these rows) with penalties
        self.penalties: list[tuple[float, float, float]] = []  # (repetition, frequency, presence)
        self.drafted: list[list[int]] = []  # per penalised position, the drafted tokens before its own
        self.seqs: list[Sequence] = []
        self.bias: list[tuple[int, int, float]] = []  # (position, token, bias)
        self.masked: list[tuple[int, int]] = []  # (position, token): EOS and stop ids under min_tokens
        self.constrained: list[int] = []  # positions with a grammar's mask
        self.masks: list[np.ndarray] = []  # their allowed tokens, int32 words
        # speculative decoding, rows of sampled sequences without a seed (cairn.workers.speculative):
        self.apart: list[tuple[int, Sequence, int]] = []  # drafting: (position, sequence, draft index)
        self.verified: list[tuple[int, int, torch.Tensor]] = []  # verifying: (position, its draft, q)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: frozenset[int] | tuple[int, ...] = ()):
        self._generator = torch.Generator().manual_seed(seed)
        self.eos = tuple(sorted(eos_token_ids))
        self.counts: TokenCounts | None = None  # made for the first penalised row
        self._uploads: PinnedUpload | None = None  # the rows' parameters, in one aligned copy
        # pinned read-back buffers on CUDA, two a dtype: a draw's copy lands in one while the last
        # draw's, maybe unread yet (async scheduling), stays in the other
        self._readback: dict[torch.dtype, list[torch.Tensor | None]] = {}
        self.grammars: Grammars | None = None  # the engine's, for rows with a grammar

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence], offsets: list[int] | None = None
               ) -> list[tuple[int, TokenLogprob | None] | SequenceFault]:
        """logits: [N, vocab] fp32, one row per sequence in `seqs`; one result per row. `offsets`
        (a verify step's rows, cairn.workers.speculative): per row, the output tokens before its
        own past those its sequence has (its drafted ones): the row is sampled as the sequence's
        output token of that index (its seeded draw, `min_tokens`); 0 for all when None."""
        return self.draw(logits, seqs, offsets).read()

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, seqs: list[Sequence], offsets: list[int] | None = None) -> Draw:
        """`sample`, left on the device: the tokens are drawn (every op queued), and their copy to
        the host started, but not waited for. `Draw.ids` can feed the next step's inputs at once;
        `Draw.read()` waits for the copy alone and gives `sample`'s results."""
        offsets = offsets or [0] * len(seqs)
        if all(self._plain_greedy(s, o) for s, o in zip(seqs, offsets)):  # argmax on the device
            # a row with a NaN or an infinity has its maximum there: it reads back as -1 (a fault)
            ids = kernels.argmax_rows(logits)
            return Draw(ids, self._tokens(ids))
        vocab = logits.shape[-1]
        out: list[tuple[int, TokenLogprob | None] | SequenceFault | None] = [None] * len(seqs)
        rows = self._rows(seqs, vocab, out, offsets)
        unsampled = torch.full((len(seqs),), -1, dtype=torch.long, device=logits.device)
        if not rows.pos:
            return Draw(unsampled, lambda: out)

        def failed(e: Exception) -> list[SequenceFault]:  # a batched op failed: the rows it held
            log.exception("sampling %d row(s) failed", len(rows.pos), exc_info=e)  # fail, the engine goes on
            return [SequenceFault(f"sampling failed: {type(e).__name__}")] * len(rows.pos)

        try:
            ids, finish = self._sample_rows(logits, rows)
        except Exception as e:
            results = failed(e)
            return Draw(unsampled, lambda: self._place(out, rows.pos, results))

        def read() -> list:
            try:
                results = finish()
            except Exception as e:
                results = failed(e)
            return self._place(out, rows.pos, results)
        return Draw(ids, read)

    @torch.inference_mode()
    def draft_tokens(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> torch.Tensor:
        """The drafter's next tokens (cairn.workers.speculative): from its logits [n, vocab], one
        row per sequence in `seqs`, each drawn as the sequence's output token of the next index
        would be after its output and its tokens drafted so far (`drafts`): its bias, `min_tokens`,
        penalties and grammar, its temperature, top-k/p and min-p; a greedy or seeded row with
        its uniform at (key, that index), the very uniform the verify step's row draws with (so
        where the head's distribution is the target's, the draft is the target's token), an
        unseeded sampled row with a uniform of another stream, its distribution kept in
        `Sequence.draft_q` for the verify row's rejection test (module doc, 5). No token is
        counted; [n] int64 on the device, -1 where a row drafts nothing (its parameters or its
        grammar cannot say, or its logits are not finite)."""
        offsets = [len(d) for d in drafts]
        if all(self._plain_greedy(s, o) for s, o in zip(seqs, offsets)):
            return kernels.argmax_rows(logits)
        rows = self._rows(seqs, logits.shape[-1], [None] * len(seqs), offsets, drafts, drafting=True)
        if not rows.pos:
            return torch.full((len(seqs),), -1, dtype=torch.long, device=logits.device)
        rows.logprobs = [-1] * len(rows.pos)
        try:
            return self._sample_rows(logits, rows, count=False)
        except Exception:  # drafts are proposals: none this round (a tensor-parallel rank must not fail on it)
            log.exception("drawing drafts for %d row(s) failed", len(rows.pos))
            return torch.full((len(seqs),), -1, dtype=torch.long, device=logits.device)

    @torch.inference_mode()
    def count_kept(self, seq: Sequence, tokens: list[int]) -> None:
        """Counts, for a penalised sequence's next rows, the tokens a verify step kept past its
        first row's (which the draw counted: a drafted row's count went to a scratch row)."""
        if tokens and seq.params.penalised and self.counts is not None:
            self.counts.add_tokens(seq, tokens)

    @staticmethod
    def _place(out: list, pos: list[int], results: list) -> list:
        for i, result in zip(pos, results):
            out[i] = result
        return out

    def _tokens(self, ids: torch.Tensor) -> Callable[[], list]:
        """Reads rows' ids back (`_read_back`) as results without logprobs: -1, a row whose logits
        were not finite, is that row's fault."""
        read = self._read_back(ids)
        return lambda: [(t, None) if t >= 0 else self._not_finite() for t in read()]

    def _read_back(self, values: torch.Tensor) -> Callable[[], list]:
        """Starts copying `values` (1-D) to the host; returns what waits for that copy alone and
        gives them as a list. On CUDA the copy goes into a pinned buffer behind an event, so later
        work queued on the device (the next step) is not waited for; elsewhere it is a plain read."""
        if values.device.type != "cuda":
            return lambda: values.tolist()
        pair = self._readback.setdefault(values.dtype, [None, None])
        pair.reverse()
        buffer = pair[0]
        if buffer is None or buffer.numel() < values.numel():
            buffer = pair[0] = torch.empty(max(2 * values.numel(), 64), dtype=values.dtype, pin_memory=True)
        host = buffer[:values.numel()]
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> list:
            done.synchronize()
            return host.tolist()
        return wait

    @torch.inference_mode()
    def adjusted_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits after step 2 (bias, min_tokens, penalties), one row per sequence, on a copy:
        what greedy rows take the argmax of and sampled rows scale. For tests and benchmarks."""
        rows = self._rows(seqs, logits.shape[-1], [None] * len(seqs))
        if len(rows.pos) < len(seqs):
            raise ValueError("a row's sampling parameters could not be prepared")
        return self._sample_rows(logits.clone(), rows, adjusted_only=True)

    def _rows(self, seqs: list[Sequence], vocab: int, out: list, offsets: list[int] | None = None,
              drafted: list[list[int]] | None = None, drafting: bool = False) -> _Rows:
        """Every row's parameters; a row that cannot be prepared gets its fault in `out`.
        `drafted`: each row's tokens before its own past its sequence's output (default: the
        first `offsets` of its draft); `drafting`: the rows are the drafter's (`draft_tokens`)."""
        rows = _Rows()
        for i, seq in enumerate(seqs):
            offset = offsets[i] if offsets else 0
            try:
                self._row_params(rows, seq, vocab, offset, drafted[i] if drafted is not None else seq.draft[:offset],
                                 drafting)
                rows.pos.append(i)
            except Exception as e:  # this row's preparation only: the others go on
                out[i] = SequenceFault(f"sampling failed: {type(e).__name__}")
        return rows

    @staticmethod
    def _plain_greedy(seq: Sequence, offset: int = 0) -> bool:
        p = seq.params
        return (p.greedy and p.logprobs is None and not p.logit_bias and not p.penalised and p.grammar is None
                and len(seq.output_token_ids) + offset >= p.min_tokens)

    def _row_params(self, rows: _Rows, seq: Sequence, vocab: int, offset: int = 0, drafted: list[int] = (),
                    drafting: bool = False) -> None:
        """Appends one row's parameters to `rows`, or raises (that row alone faults, and nothing
        of it is appended). `offset`: see `sample`; `drafted`: the tokens before the row's own
        past the sequence's output (`offset` of them); `drafting`: see `_rows`."""
        p, at = seq.params, len(rows.seqs)
        n_out = len(seq.output_token_ids) + offset
        if any(token >= vocab for token, _ in p.logit_bias):
            raise ValueError("a logit_bias token is outside the vocabulary")
        masked = []
        mask: np.ndarray | None = None
        if p.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine has no tokenizer to compile grammars with")
            mask = self.grammars.mask(seq, list(drafted))
        if n_out < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos))
            masked = [(at, t) for t in sorted(stops) if t < vocab]
        rows.temperature.append(0.0 if p.greedy else float(p.temperature))
        rows.top_k.append(p.top_k if 0 < p.top_k < vocab else 0)
        rows.top_p.append(float(p.top_p))
        rows.min_p.append(float(p.min_p))
        rows.seed.append(-1 if p.seed is None else p.seed)
        rows.index.append(n_out)
        rows.logprobs.append(-1 if p.logprobs is None else p.logprobs)
        if p.penalised:
            rows.penalised.append(at)
            rows.penalties.append((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
            rows.drafted.append(list(drafted))
        if not p.greedy and p.seed is None:  # a sampled row without a seed: its drafts are drawn apart
            if drafting:
                rows.apart.append((at, seq, offset))
            elif offset < len(seq.draft) and offset < len(seq.draft_q):
                rows.verified.append((at, seq.draft[offset], seq.draft_q[offset]))
        rows.bias.extend((at, token, bias) for token, bias in p.logit_bias)
        rows.masked.extend(masked)
        if mask is not None:
            rows.constrained.append(at)
            rows.masks.append(mask)
        rows.seqs.append(seq)

    def _sample_rows(self, logits: torch.Tensor, rows: _Rows, adjusted_only: bool = False, count: bool = True):
        """The rows' adjusted logits (`adjusted_only`), or their draw: (every row's id on the
        device, -1 where it faulted; what reads the results back); without `count` (a draft),
        the ids alone, and the penalised rows' counts are left as they were."""
        n, vocab, device = len(rows.pos), logits.shape[-1], logits.device
        temperature = np.array(rows.temperature, np.float32)
        sampled = np.flatnonzero(temperature > 0)
        unseeded = np.array(rows.seed) < 0
        keys = np.array(rows.seed, np.int64)
        if not adjusted_only:  # (a sequence's key is drawn at its first draw, not by a look at its logits)
            for i in np.flatnonzero(unseeded[sampled]):  # a sequence's own key, from the engine's generator
                keys[sampled[i]] = self._key(rows.seqs[sampled[i]])
        asked = np.flatnonzero(np.array(rows.logprobs) >= 0)
        k_top = int(max((rows.logprobs[i] for i in asked), default=0))
        counts_rows = []
        if rows.penalised:
            if self.counts is None:
                self.counts = TokenCounts(vocab, device)
            counts_rows = self.counts.rows([rows.seqs[i] for i in rows.penalised])
            # a drafted row counts its sequence's output and the drafted tokens before it
            counts_rows = [self.counts.scratch(row, drafted) if drafted else row
                           for row, drafted in zip(counts_rows, rows.drafted)]
        bias = np.array(rows.bias, np.float64).reshape(-1, 3)
        masked = np.array(rows.masked, np.int64).reshape(-1, 2)
        pen = np.array(rows.penalties, np.float32).reshape(-1, 3)
        if self._uploads is None or self._uploads.device != device:
            self._uploads = PinnedUpload(device)
        up = self._uploads.upload(dict(
            pos=np.array(rows.pos, np.int64), samp=sampled.astype(np.int64), key=keys[sampled],
            index=np.array(rows.index, np.int64)[sampled], top_k=np.array(rows.top_k, np.int64)[sampled],
            asked=asked.astype(np.int64), pen_pos=np.array(rows.penalised, np.int64),
            pen_rows=np.array(counts_rows, np.int64), bias_at=bias[:, :2].astype(np.int64).reshape(-1),
            masked_at=masked.reshape(-1), cons_at=np.array(rows.constrained, np.int64),
            temp=temperature[sampled], top_p=np.array(rows.top_p, np.float32)[sampled],
            min_p=np.array(rows.min_p, np.float32)[sampled], bias_val=bias[:, 2].astype(np.float32),
            pen_val=pen.reshape(-1), words=np.stack(rows.masks) if rows.masks else np.zeros((0, 0), np.int32)))
        (pos, samp, key, index, top_k, asked_t, pen_pos, pen_rows, bias_at, masked_at, cons_at,
         temp, top_p, min_p, bias_val, pen_val, words) = up.values()
        x = logits.float()
        if n < logits.shape[0]:  # some rows faulted before: the others, compacted
            x = x.index_select(0, pos)
        finite = torch.isfinite(x.sum(-1))  # a NaN or an infinity anywhere in the row
        logprobs = torch.log_softmax(x.index_select(0, asked_t), dim=-1) if len(asked) else None

        if len(bias):
            b = bias_at.view(-1, 2)
            x.index_put_((b[:, 0], b[:, 1]), bias_val, accumulate=True)
        if len(masked):
            m = masked_at.view(-1, 2)
            x.index_put_((m[:, 0], m[:, 1]), torch.tensor(float("-inf"), device=device))
        if rows.penalised:
            self._penalise(x, pen_pos, pen_rows, pen_val.view(-1, 3))
        if rows.constrained:
            kernels.mask_rows(x, cons_at, words)
        if adjusted_only:
            return x
        if len(sampled) < n:  # greedy rows
            ids = torch.max(x, dim=-1)[1]
        else:
            ids = torch.zeros(n, dtype=torch.long, device=device)
        if len(sampled):
            drawn = kernels.sample_rows(
                x if len(sampled) == n else x.index_select(0, samp), temp, top_k, top_p, min_p, uniforms(key, index),
                host=([rows.top_k[i] for i in sampled], [rows.top_p[i] for i in sampled],
                      [rows.min_p[i] for i in sampled]))
            ids = ids.index_copy(0, samp, drawn)
        if rows.apart or rows.verified:  # unseeded sampled rows' drafts, and their keep tests
            params = SampledRows(sampled, samp, temp, top_k, top_p, min_p, key, index,
                                 (rows.top_k, rows.top_p, rows.min_p))
            if rows.apart:
                ids = draw_apart(ids, x, params, rows.apart)
            if rows.verified:
                ids = keep_or_resample(ids, x, params, rows.verified)
        ids = torch.where(finite, ids, -1)
        every = ids if n == logits.shape[0] else torch.full((logits.shape[0],), -1, dtype=ids.dtype,
                                                            device=device).index_copy(0, pos, ids)
        if not count:
            return every
        if rows.penalised:
            self.counts.add(pen_rows, ids.index_select(0, pen_pos))  # a drafted row's into its scratch row
        if logprobs is None:
            return every, self._tokens(ids)
        chosen = logprobs.gather(1, ids.index_select(0, asked_t).clamp(min=0)[:, None])[:, 0]
        top_vals, top_ids = torch.topk(logprobs, k_top, dim=-1) if k_top else (logprobs[:, :0], logprobs[:, :0].long())
        # one read: ids, chosen logprobs, alternatives (token ids are exact in fp64)
        read = self._read_back(torch.cat((ids.double(), chosen.double(), top_vals.double().reshape(-1),
                                          top_ids.double().reshape(-1))))
        return every, lambda: self._results(read(), rows, asked, k_top)

    def _results(self, host: list[float], rows: _Rows, asked: np.ndarray, k_top: int) -> list:
        """The rows' results from the one read of ids, chosen logprobs and alternatives."""
        n = len(rows.pos)
        id_list, chosen_list = [int(t) for t in host[:n]], host[n:n + len(asked)]
        vals, alts = host[n + len(asked):n + len(asked) * (1 + k_top)], host[n + len(asked) * (1 + k_top):]
        results: list = []
        where = {int(r): j for j, r in enumerate(asked)}
        for r, t in enumerate(id_list):
            if t < 0:
                results.append(self._not_finite())
                continue
            j = where.get(r)
            if j is None:
                results.append((t, None))
                continue
            k = rows.logprobs[r]
            pairs = [(int(alts[j * k_top + c]), vals[j * k_top + c]) for c in range(k)]
            results.append((t, TokenLogprob(t, chosen_list[j], pairs)))
        return results

    def _key(self, seq: Sequence) -> int:
        """An unseeded sequence's key: drawn from the engine's generator at its first sampled
        row, then kept (`Sequence.sample_key`), so that its draws follow (key, output index) as a
        seeded one's do: a draft drawn ahead of its verify step draws with the same uniform."""
        if seq.sample_key is None:
            seq.sample_key = int(torch.randint(0, 2**62, (1,), generator=self._generator))
        return seq.sample_key

    @staticmethod
    def _not_finite() -> SequenceFault:
        return SequenceFault("the model's logits for this request were not finite")

    def _penalise(self, x: torch.Tensor, at: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
        """vLLM's penalties on rows `at` of x, from their token-count rows."""
        kernels.penalise_rows(x, at, rows, self.counts.counts, self.counts.prompt, values)
