"""What every benchmark's plot shares: headless matplotlib, and where the PNG goes.

    plt = pyplot()            # None (and a line saying so) when matplotlib is missing
    if plt is not None:
        fig, ax = plt.subplots()
        ...
        save(fig, "name.png")  # OUT/name.png, and a line naming it

OUT, where benchmarks write what they produce, is benchmarks/out/ (ignored by git), or
$CAIRN_BENCH_OUT when set (tests point it at a temporary folder, so that a check of a script
never overwrites the results of a real run).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("CAIRN_BENCH_OUT") or Path(__file__).parent / "out")


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib missing: no plot)")
        return None
    return plt


def save(fig: Any, name: str, dpi: int = 110) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    print(f"\nplot: {path}")
    return path
