"""What every benchmark's plot shares: headless matplotlib, and where the PNG goes.

    plt = pyplot()            # None (and a line saying so) when matplotlib is missing
    if plt is not None:
        fig, ax = plt.subplots()
        ...
        save(fig, "name.png")  # benchmarks/out/name.png, and a line naming it
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "out"


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
    OUT.mkdir(exist_ok=True)
    path = OUT / name
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    print(f"\nplot: {path}")
    return path
