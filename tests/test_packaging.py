"""What `pip install .` installs: one import package, `cairn`, and its console script.

Issue 37: a wheel that installed `kernels/`, `workers/`, `cluster/`, ... at the top of
site-packages wrote cairn's `kernels` over Hugging Face's (transformers depends on it), file
over file. The wheel is built from a copy of the checkout with the setuptools installed here (no
index needed), then installed into a folder of its own and run from there, away from the
checkout and the editable install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.foreign_shell import foreign_shell, shadowed_imports
from tests.support.paths import REPO

IGNORED = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
                                 ".hypothesis", ".venv", ".whl", "out", "demo-models")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source, out = tmp_path_factory.mktemp("source") / "cairn", tmp_path_factory.mktemp("wheel")
    shutil.copytree(REPO, source, ignore=IGNORED)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-q", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (built,) = out.glob("cairn-*.whl")
    return built


def test_a_wheel_installs_cairn_and_nothing_else_at_the_top_level(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"cairn"}, sorted(tops)
    for shipped in ("cairn/__init__.py", "cairn/configs/local.yaml", "cairn/configs/routing.yaml",
                    "cairn/kernels/delta_rule/delta_rule.cpp", "cairn/kernels/common/native.h", "cairn/workers/demo/chat_template.jinja",
                    "cairn/cluster/cli.py"):
        assert shipped in names, f"the wheel lacks {shipped}"
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "docs/"))]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "cairn = cairn.cluster.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_wheel_generates_from_another_folder(wheel, tmp_path, tiny_model_dir):
    """`pip install .` then `cairn generate` in a shell where other distributions' `kernels`,
    `workers`, ... come first: cairn runs from the installed copy and imports none of them."""
    target, shell = tmp_path / "site", tmp_path / "shell"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q",
                           "--disable-pip-version-check", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = foreign_shell(shell, dict(os.environ, CAIRN_HOME=str(tmp_path / "home")))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(target)])  # the shadowing packages first
    where = subprocess.run([sys.executable, "-c", "import cairn.kernels, cairn.workers; "
                            "print(cairn.kernels.__file__)"], cwd=shell, env=env, capture_output=True, text=True)
    assert where.returncode == 0 and where.stdout.startswith(str(target)), where.stdout + where.stderr
    proc = subprocess.run([str(target / "bin" / "cairn"), "generate", "--model", str(tiny_model_dir),
                           "--prompt", "Hello there", "--max-tokens", "5"],
                          cwd=shell, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    assert shadowed_imports(shell) == [], f"the installed cairn imported {shadowed_imports(shell)}"
