"""What images change in a step's arrays (a vision-language model): the rotary positions, and the
rows whose embeddings the vision tower gives.

`step_images(decodes, prefills, positions, encoder)` -> (rotary positions, image rows, image parts),
with `positions` the step's token indices ([T], decode rows first, then each prefill segment's)
and `encoder` the runner's image encoder (its merge size counts an image's tokens):
- no sequence of the step has images: (positions, None, ()), the step as before;
- only decodes of sequences with images: [T], each such row at its index plus its prompt's shift
  (M-RoPE's delta: a token past the prompt is text, its three positions equal), so a decode
  graph runs it as any decode (a one-token chunk inside such a prompt is a prefill segment:
  `Sequence.decodes_at`);
- a prefill segment of a sequence with images: [3, T] (rows t, h, w): that segment's rows from
  its `PromptPositions` (a chunk that cuts an image gets its part), other rows their index (plus
  the shift for decodes) on all three;
- image rows: [N] int64, the step's rows that are image tokens, in row order; parts: for each
  image a prefill segment overlaps, (image, first, end): the image's tokens [first, end) those
  rows hold (cairn.workers.vision.image_encoder reads them).
`decodes` are the decode rows' segments, or with verify rows (speculative decoding) their
(segment, j) rows: a sequence with images never drafts (cairn.workers.speculative.verifier), so
its one row is a decode beside others' verify rows. Plain numpy.
"""

from __future__ import annotations

import numpy as np


def step_images(decodes, prefills, positions: np.ndarray, encoder):
    imaged = [seg for seg in prefills if seg.seq.rope is not None]
    shifts = [(row[0] if isinstance(row, tuple) else row).seq.rope_shift() for row in decodes]
    if not imaged and not any(shifts):
        return positions, None, ()
    nd = len(decodes)
    flat = positions.copy()
    flat[:nd] += np.array(shifts, np.int64)
    if not imaged:
        return flat, None, ()
    out = np.repeat(flat[None], 3, axis=0)
    rows, parts, at = [], [], nd
    for seg in prefills:
        seq, start, end = seg.seq, seg.start, seg.start + seg.num_tokens
        if seq.rope is not None:
            out[:, at:at + seg.num_tokens] = seq.rope.rows(start, end)
            for image in seq.images:
                first, n = image.first_token, image.num_tokens(encoder.merge_size)
                lo, hi = max(start, first), min(end, first + n)
                if lo < hi:
                    rows.append(np.arange(lo, hi) - start + at)
                    parts.append((image, lo - first, hi - first))
        at += seg.num_tokens
    return out, (np.concatenate(rows).astype(np.int64) if rows else None), tuple(parts)
