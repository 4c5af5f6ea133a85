"""Loss curves laid over each other in one PNG (matplotlib, as scripts/lib/comparison.py draws its charts).

    write_loss_plot(path, [("torchtitan compiled", losses_a), ("this repo full_compiled", losses_b)])

Each curve in its own colour of ``COLOURS`` (matplotlib's first ten, in order), step on x, loss on y, a legend
naming each run. ``write_loss_plot`` also returns each label's colour and the axes' ranges, for the Markdown
that names the file.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

COLOURS: List[Tuple[str, str]] = [
    ("blue", "tab:blue"), ("orange", "tab:orange"), ("green", "tab:green"), ("red", "tab:red"),
    ("purple", "tab:purple"), ("brown", "tab:brown"), ("pink", "tab:pink"), ("grey", "tab:gray"),
    ("olive", "tab:olive"), ("cyan", "tab:cyan"),
]


def write_loss_plot(path: Path, curves: Sequence[Tuple[str, Sequence[Optional[float]]]]) -> Dict[str, object]:
    """Draws ``curves`` (label, one loss per step from step 1; None or NaN where a step has none: a gap) into a
    PNG at ``path``; returns each label's colour name and the axes' ranges."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scripts.lib.comparison import save_figure

    points = [(i + 1, v) for _, losses in curves for i, v in enumerate(losses) if _finite(v)]
    if not points:
        raise ValueError("no finite loss to plot")
    fig, ax = plt.subplots(figsize=(9, 5))
    legend = {}
    for n, (label, losses) in enumerate(curves):
        name, colour = COLOURS[n % len(COLOURS)]
        legend[label] = name
        ax.plot(range(1, len(losses) + 1), [v if _finite(v) else math.nan for v in losses], color=colour,
                label=label, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return {"colours": legend, "steps": [1, max(x for x, _ in points)],
            "loss": [min(y for _, y in points), max(y for _, y in points)]}


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)
