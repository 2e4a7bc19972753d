"""Host arrays onto the device in one copy: `PinnedUpload(device).upload({name: array})` packs
int64, int32 and float32 arrays into one host buffer, each at a byte offset aligned to
`UPLOAD_ALIGN` (so every view starts as aligned as a fresh allocation: a Triton kernel that
specialises on its pointers' alignment compiles once, not once per alignment a step's sizes
happen to give), copies it in one transfer and returns views by name: a handful of ops whatever
the number of arrays. On CUDA the host buffer is pinned and the copy does not block the host; two
pinned buffers alternate, so the one a copy may still read is not overwritten by the next upload
(the step after it reads back its sampled ids only after that copy). `into`: a device buffer of
`packed_bytes(arrays)` to copy into (a decode graph's fixed inputs) instead of a new one.

The runner uploads each step's arrays through one (cairn.workers.execution.runner), the sampler
its rows' parameters through another (cairn.workers.sampler).
"""

from __future__ import annotations

import numpy as np
import torch

UPLOAD_ALIGN = 16  # bytes: Triton specialises a pointer on 16-byte alignment
_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}


def _layout(arrays: dict[str, np.ndarray]) -> tuple[dict[str, int], int]:
    """Where each array goes in the packed buffer (byte offsets, multiples of UPLOAD_ALIGN), and
    the buffer's size."""
    offsets, end = {}, 0
    for name, a in arrays.items():
        if a.dtype not in _DTYPES:
            raise TypeError(f"uploaded arrays are int64, int32 or float32, got {a.dtype} for {name}")
        offsets[name] = end
        end += -(-a.nbytes // UPLOAD_ALIGN) * UPLOAD_ALIGN
    return offsets, max(UPLOAD_ALIGN, end)


def packed_bytes(arrays: dict[str, np.ndarray]) -> int:
    """The bytes `upload` packs `arrays` into."""
    return _layout(arrays)[1]


class PinnedUpload:
    def __init__(self, device: torch.device):
        self.device = device
        self._staging: list[torch.Tensor | None] = [None, None]  # CUDA: the pinned buffers that alternate

    def upload(self, arrays: dict[str, np.ndarray], into: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        offsets, size = _layout(arrays)
        packed = np.zeros(size, dtype=np.uint8)
        for name, a in arrays.items():
            packed[offsets[name]:offsets[name] + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        host = torch.from_numpy(packed)
        if self.device.type == "cuda":
            self._staging.reverse()
            if self._staging[0] is None or self._staging[0].numel() < host.numel():
                self._staging[0] = torch.empty(2 * host.numel(), dtype=torch.uint8, pin_memory=True)
            pinned = self._staging[0][:host.numel()]
            pinned.copy_(host)
            host = pinned
        if into is not None:
            into.copy_(host, non_blocking=True)
            host = into
        elif self.device.type == "cuda":
            host = host.to(self.device, non_blocking=True)
        return {name: host[offsets[name]:offsets[name] + a.nbytes].view(_DTYPES[a.dtype]).view(a.shape)
                for name, a in arrays.items()}
