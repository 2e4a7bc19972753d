"""The runner's upload: a step's arrays arrive by name with their values, each starting 16-byte
aligned whatever the other arrays' sizes (a kernel specialises on its pointers' alignment: an
array placed where a step's sizes happen to put it would compile it again), and a decode graph's
fixed buffer holds the same layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cairn.workers.engine import Engine
from cairn.workers.execution.pinned_upload import packed_bytes


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, max_num_seqs=2, max_model_len=128).runner


@pytest.mark.parametrize("sizes", [(1, 3, 5), (7, 2, 9), (0, 1, 0), (4, 4, 4)])
def test_every_uploaded_array_keeps_its_values_and_starts_16_byte_aligned(runner, sizes):
    rng = np.random.default_rng(sum(sizes))
    arrays = {"a": rng.integers(-9, 9, sizes[0]).astype(np.int32),
              "b": rng.integers(-9, 9, (sizes[1], 3)).astype(np.int64),
              "c": rng.integers(-9, 9, sizes[2]).astype(np.int32),
              "d": rng.standard_normal(sizes[0]).astype(np.float32)}
    for into in (None, torch.empty(packed_bytes(arrays), dtype=torch.uint8)):
        out = runner.upload(arrays, into=into)
        for name, a in arrays.items():
            assert out[name].shape == a.shape and np.array_equal(out[name].numpy(), a)
            assert out[name].data_ptr() % 16 == 0, (name, sizes)


def test_arrays_of_another_dtype_are_refused(runner):
    with pytest.raises(TypeError, match="int64, int32 or float32"):
        runner.upload({"x": np.zeros(3, dtype=np.float64)})
