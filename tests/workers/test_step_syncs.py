"""An engine step never waits on the GPU inside its forward pass: from the step's inputs to its
sampled ids, the host reads nothing back from the device, and the step's metadata goes up in one
copy. Counted through the real engine path (scheduler, runner, model, every Triton launcher's host
code, sampler) at Qwen3-Next-80B and Qwen3.5-35B-A3B shapes, by `benchmarks/step_cost.py` in a
child process (the census needs triton imported compiled; this session imported it interpreted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tests.support.paths import REPO

ROOT = REPO


# decode-only and prefill-with-checkpoints steps at both shapes; a mixed step (64 decodes warmed up
# by real CPU steps, the slow part) at one
RUNS = ((("qwen3-next-80b", "qwen3.5-35b-a3b"), ("decode x1", "prefill 4k")), (("qwen3-next-80b",), ("mixed 64+512",)))


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = []
    for shapes, steps in RUNS:
        done = subprocess.run([sys.executable, "benchmarks/step_cost.py", "--json", "--shapes", ",".join(shapes),
                               "--steps", ",".join(steps)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-6000:]
        out += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {(r["shape"], r["step"]) for r in out} == {(s, t) for shapes, steps in RUNS for s in shapes for t in steps}
    return out


def test_the_forward_reads_nothing_back_and_uploads_nothing(rows):
    for r in rows:
        forward = r["phases"]["forward"]
        assert forward["syncs"] == 0, (r["shape"], r["step"], r["busiest_syncs"])
        assert forward["uploads"] == 0, (r["shape"], r["step"])
        assert forward["launches"] > 100  # the census saw the model run


def test_a_step_makes_one_upload_and_one_read_of_its_sampled_ids(rows):
    for r in rows:
        assert r["uploads"] == 1, (r["shape"], r["step"], r["phases"])
        assert r["syncs"] == 1, (r["shape"], r["step"], r["busiest_syncs"])
        assert r["busiest_syncs"][0][0].startswith("workers/sampler.py"), r["busiest_syncs"]


def test_prefill_steps_saved_checkpoints_without_a_sync(rows):
    """The prefill steps counted above did save recurrent-state checkpoints."""
    for r in rows:
        if r["step"] != "decode x1":
            assert r["checkpoints"] > 0, (r["shape"], r["step"])


SERIES, SERIES_RUNNING = 200, 64


@pytest.fixture(scope="module")
def series() -> list[dict]:
    """`step_cost.py --series`: 200 warm decode steps of 64 sequences at the Qwen3.5-35B-A3B
    shape over the decode graphs' fixed buffers, each counted alone, async scheduling off then on."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "benchmarks/step_cost.py", "--json", "--shapes", "qwen3.5-35b-a3b",
                           "--series", str(SERIES), "--series-running", str(SERIES_RUNNING)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["async_scheduling"] for r in rows] == [False, True]
    return rows


@pytest.mark.slow
def test_200_warm_decode_steps_each_read_once_upload_once_and_make_no_input_buffer(series):
    """Every step of the series: one read of sampled ids, nothing read inside the forward, a token
    for all 64, one upload into the bucket's fixed buffer (no input buffer is made), and the same
    launches as every other step, except the steps that copy checkpoints at a page boundary: their
    copies are their cost (with async scheduling, planned after the step launched, their slot
    pairs go up in a second small copy). With async scheduling, steps are planned before the last
    one's ids are read, the page boundaries' steps included."""
    for row in series:
        steps, mode = row["steps"], row["async_scheduling"]
        assert len(steps) == SERIES and row["new_input_buffers"] == 0
        for i, step in enumerate(steps):
            assert (step["syncs"], step["forward_syncs"], step["outputs"]) == (1, 0, SERIES_RUNNING), (mode, i)
            assert step["uploads"] == 1 or (mode and step["captures"] and step["uploads"] == 2), (mode, i)
        plain = {s["launches"] for s in steps if not s["captures"]}
        assert len(plain) == 1, f"steps without a checkpoint copy launch alike: {sorted(plain)}"
        assert any(s["captures"] for s in steps)  # page boundaries were crossed
    off, on = series
    assert off["overlapped_steps"] == 0 and on["overlapped_steps"] >= SERIES
