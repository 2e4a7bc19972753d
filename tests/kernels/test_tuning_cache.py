"""tuning_cache: autotune choices written to disk come back into a new process's tuners (here:
tuners reset in place), keyed by GPU, torch and Triton versions in the file name; a choice whose
config is no longer a candidate, or a damaged file, costs a retune, never a start."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import triton

from cairn.kernels.common import tuning_cache


def fake_tuner(name: str, configs: list) -> SimpleNamespace:
    """What tuning_cache reads of a triton Autotuner: its kernel's name, candidates and choices."""
    fn = SimpleNamespace(fn=SimpleNamespace(fn=SimpleNamespace(__module__="cairn.kernels.x", __qualname__=name)))
    return SimpleNamespace(fn=fn.fn, configs=configs, cache={})


@pytest.fixture
def tuners(monkeypatch, tmp_path):
    monkeypatch.setenv("CAIRN_TUNING_DIR", str(tmp_path))
    small, big = triton.Config({"BLOCK": 32}, num_warps=4, num_stages=3), triton.Config({"BLOCK": 64}, num_warps=8,
                                                                                           num_stages=4)
    made = [fake_tuner("_a_kernel", [small, big]), fake_tuner("_b_kernel", [small, big])]
    monkeypatch.setattr(tuning_cache, "TUNED", made)
    return made, small, big


def test_choices_saved_come_back_into_fresh_tuners(tuners):
    (a, b), small, big = tuners
    a.cache[(2048, 512, 64, "torch.bfloat16")] = big
    b.cache[(16,)] = small
    assert tuning_cache.save() == 2
    assert "torch" in tuning_cache.path().name and "triton" in tuning_cache.path().name
    a.cache.clear()
    b.cache.clear()
    assert tuning_cache.load() == 2
    assert a.cache == {(2048, 512, 64, "torch.bfloat16"): big} and b.cache == {(16,): small}
    assert tuning_cache.load() == 0  # what a tuner holds already is not overwritten


def test_a_choice_no_longer_a_candidate_or_a_damaged_file_is_skipped(tuners):
    (a, _), small, big = tuners
    a.cache[(1,)] = big
    tuning_cache.save()
    a.cache.clear()
    a.configs = [small]  # the candidates changed since
    assert tuning_cache.load() == 0 and a.cache == {}
    tuning_cache.path().write_text("{not json")
    assert tuning_cache.load() == 0
    a.cache[(2,)] = small
    tuning_cache.save()  # over the damaged file
    assert json.loads(tuning_cache.path().read_text())["cairn.kernels.x._a_kernel"] == {
        "[2]": dict(kwargs={"BLOCK": 32}, num_warps=4, num_stages=3)}
