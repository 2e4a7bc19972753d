"""`cairn.workers.cache.device_budget.sized`: the arena sized from a device's free memory is a
new `EngineOptions`; the options asked for are left as they were."""

import dataclasses

import pytest
import torch

from cairn.workers.cache.device_budget import arena_bytes, sized
from cairn.workers.engine_options import EngineOptions


def test_sized_returns_new_options_and_leaves_the_ones_asked_for_unchanged(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))  # CUDA, faked
    asked = EngineOptions(memory_utilization=0.9, max_num_seqs=8, warm_up=True)
    got = sized(asked, torch.device("cuda"), reserve=gib)
    assert got is not asked and asked == EngineOptions(memory_utilization=0.9, max_num_seqs=8, warm_up=True)
    assert got == dataclasses.replace(asked, memory_utilization=None,
                                      cache_memory_bytes=arena_bytes(60 * gib, 80 * gib, 0.9) - gib)
    assert sized(got, torch.device("cuda")) is got, "nothing left to size: the value given"
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.cache_memory_bytes = gib  # no one changes options once made
