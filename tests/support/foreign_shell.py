"""A user's shell away from the checkout, where other distributions' packages take cairn's
folder names: the place where a bare `import kernels` went wrong (issue 37).

`foreign_shell(folder, env)` writes tiny top-level packages named `kernels`, `workers`,
`cluster`, `cache_service` and `configs` under `folder`, and returns the environment of a shell
there: those packages first on `PYTHONPATH` (ahead of site-packages, where Hugging Face's real
`kernels` also sits), the checkout nowhere on it. Each fake records its import in
`folder/imported.txt`, so a test can say that nothing of cairn's (Ray's workers and a TP rank's
processes included: they inherit the environment) reached one. `cairn_script()` is the console
script that `pip install` wrote, which puts its own bin folder first on `sys.path`, not the
working directory."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

SHADOWING = ("kernels", "workers", "cluster", "cache_service", "configs")


def foreign_shell(folder: Path, env: dict[str, str]) -> dict[str, str]:
    """Writes the shadowing packages into `folder/site` and returns `env` with them first on the path."""
    site = folder / "site"
    for name in SHADOWING:
        (site / name).mkdir(parents=True, exist_ok=True)
        (site / name / "__init__.py").write_text(
            f'"""Another distribution\'s `{name}`: not cairn\'s."""\n'
            f"with open({str(folder / 'imported.txt')!r}, 'a') as log:\n"
            f"    log.write({name!r} + '\\n')\n")
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not _is_checkout(p)]
    return dict(env, PYTHONPATH=os.pathsep.join([str(site), *rest]))


def shadowed_imports(folder: Path) -> list[str]:
    """The fakes some process imported, in order (none, where cairn imports only `cairn.*`)."""
    log = folder / "imported.txt"
    return log.read_text().split() if log.exists() else []


def cairn_script() -> str:
    """The `cairn` console script installed beside this interpreter (else the one on PATH)."""
    found = shutil.which("cairn", path=str(Path(sys.executable).parent)) or shutil.which("cairn")
    assert found, "no `cairn` console script: install cairn (bash .ci/setup)"
    return found


def _is_checkout(path: str) -> bool:
    return (Path(path) / "cairn" / "__init__.py").is_file()
