"""Curves from a metrics JSONL file, drawn as PNG (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_metrics(jsonl: Path, png: Path, *, keys: list[str], title: str, x: str = "step",
                 smooth: int = 10) -> Path:
    """One panel per key: the raw values and a moving average over ``smooth`` points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(jsonl).read_text().splitlines() if line.strip()]
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        xs = [r[x] for r in rows if key in r]
        ys = [r[key] for r in rows if key in r]
        ax.plot(xs, ys, alpha=0.35, label=key)
        if len(ys) >= smooth:
            avg = [sum(ys[max(0, i - smooth + 1): i + 1]) / len(ys[max(0, i - smooth + 1): i + 1])
                   for i in range(len(ys))]
            ax.plot(xs, avg, label=f"{key} ({smooth}-step mean)")
        ax.set_xlabel(x)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
