"""Curves from a metrics JSONL file, drawn as PNG (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinkerq.errors import UserError
from tinkerq.recipes.jsonl import read_objects

METRICS_FORMAT = "the metrics.jsonl a tinkerq sft / rl run wrote (one JSON object per line)"


def read_metrics(jsonl: Path) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file, or a UserError naming the file, the line and what it must hold."""
    return [row for _, row in read_objects(jsonl, where=str(jsonl), needs=METRICS_FORMAT)]


def numeric_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Columns holding a number in at least one row, in the order they first appear."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update({k: None for k, v in row.items() if _is_number(v)})
    return list(columns)


def check_columns(jsonl: Path, rows: list[dict[str, Any]], keys: list[str], x: str) -> None:
    """Refuse ``keys`` or ``x`` the rows do not hold (nothing is drawn, so no PNG is overwritten with an empty
    one); the message lists the columns there are."""
    columns = numeric_columns(rows)
    missing = [k for k in keys if k not in columns]
    if missing:
        raise UserError(f"{jsonl} has no column {', '.join(map(repr, missing))} (--keys); its columns: "
                        f"{', '.join(columns)}")
    if x not in columns:
        raise UserError(f"{jsonl} has no column {x!r} (--x); its columns: {', '.join(columns)}")


def plot_metrics(jsonl: Path, png: Path, *, keys: list[str], title: str, x: str = "step",
                 smooth: int = 10) -> Path:
    """One panel per key: the raw values and a moving average over ``smooth`` points."""
    rows = read_metrics(jsonl)
    check_columns(jsonl, rows, keys, x)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        points = [(r[x], r[key]) for r in rows if _is_number(r.get(x)) and _is_number(r.get(key))]
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
