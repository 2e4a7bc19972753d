"""benchmarks/step_cost.py tells apart what it measured from what it assumed. kernel_speed.py
--check writes the calibration file (at tiny shapes, interpreted: it has no peaks, so the test
fills in each op's fraction), step_cost.py --calibrate projects a mixed step of 64 decodes and a
512-token prefill from it, and --measure --measure-device cpu times that step at tiny widths,
first and warm. Both run as children: the census needs triton compiled, this session has it
interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from benchmarks.step_limit import ASSUMED, KERNEL_CLASSES
from tests.support.paths import REPO


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return done


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("calibration") / "kernel_speed.json"
    run("benchmarks/kernel_speed.py", "--check", "--quick", "--json-out", str(path))
    data = json.loads(path.read_text())
    assert data["peaks"] is None and all(c["fraction_of_limit"] is None for cs in data["ops"].values() for c in cs)
    for i, cases in enumerate(data["ops"].values()):
        for case in cases:
            case["fraction_of_limit"] = 0.2 + 0.05 * i  # a different efficiency for each op
    path.write_text(json.dumps(data))
    return dict(data, path=str(path))


@pytest.fixture(scope="module")
def rows(calibration) -> tuple[dict, dict]:
    done = run("benchmarks/step_cost.py", "--json", "--shapes", "qwen3.5-35b-a3b", "--steps", "mixed 64+512",
               "--calibrate", calibration["path"], "--measure", "--measure-device", "cpu", "--repeats", "2")
    (counted, measured) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return counted, measured


def test_every_kernel_class_takes_the_efficiency_kernel_speed_measured_for_its_op(calibration, rows):
    counted, _ = rows
    taken = counted["efficiency"]
    # a mixed step does every kind of work but drafting (a verify step's)
    assert set(taken) == set(counted["work"]) == {*KERNEL_CLASSES, *ASSUMED} - {"mtp head"}
    for kind, efficiency in taken.items():
        if kind in ASSUMED:
            assert efficiency == dict(fraction=ASSUMED[kind], measured_at=None), kind
        else:
            (case,) = calibration["ops"][kind]  # --quick: one case an op
            assert efficiency == dict(fraction=case["fraction_of_limit"], measured_at=case["shape"]), kind


def test_the_calibrated_projection_is_each_class_limit_over_its_efficiency(rows):
    counted, _ = rows
    expected = sum(w["limit_s"] / counted["efficiency"][kind]["fraction"] for kind, w in counted["work"].items())
    assert counted["calibrated"] and counted["device_s"] == pytest.approx(expected)
    assert counted["device_s"] > counted["limit_s"]
    assert counted["projected_s"][0] >= counted["device_s"]


def test_a_measured_step_reports_its_first_run_and_its_warm_runs(rows):
    _, measured = rows
    assert measured["measured"] and measured["step"] == "mixed 64+512" and measured["warm_runs"] == 2
    assert measured["warm_up_s"] >= 0 and measured["first_s"] > 0
    assert measured["warm_min_s"] <= measured["warm_median_s"] <= measured["warm_max_s"]
    assert measured["first_over_warm"] == pytest.approx(measured["first_s"] / measured["warm_median_s"])
    assert measured["calibrated"] and measured["projected_s"] > 0
