"""What a partition looks like: per-client label counts as a text table and a PNG heatmap."""
from __future__ import annotations

import os

import numpy as np

from .datasets import Dataset
from .partition import Partition


def label_counts(dataset: Dataset, split: Partition) -> np.ndarray:
    """(n_clients, num_classes) int64 counts of the labels each client trains on (the
    partition's own labels where it overrides them); (n_clients, 0) for regression data."""
    counts = np.zeros((len(split.indices), dataset.num_classes), dtype=np.int64)
    if dataset.num_classes == 0:
        return counts
    for i, idx in enumerate(split.indices):
        y = dataset.y_train[idx] if split.labels is None else split.labels[i]
        counts[i] = np.bincount(y, minlength=dataset.num_classes)[:dataset.num_classes]
    return counts


def format_table(counts: np.ndarray, sizes: np.ndarray, class_names: tuple = ()) -> str:
    """Clients as rows, classes as columns, then a total column and an `all` row.

    Columns are headed by class index; a legend line maps indices to names when the names are
    not the indices themselves.
    """
    n_clients, n_classes = counts.shape
    header = ["client"] + [str(c) for c in range(n_classes)] + ["total"]
    rows = [[str(i)] + [str(v) for v in counts[i]] + [str(sizes[i])] for i in range(n_clients)]
    rows.append(["all"] + [str(v) for v in counts.sum(axis=0)] + [str(sizes.sum())])
    widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    if class_names and tuple(class_names) != tuple(header[1:-1]):
        lines.append("classes: " + ", ".join(f"{c}={name}" for c, name in enumerate(class_names)))
    return "\n".join(lines)


def save_heatmap(counts: np.ndarray, sizes: np.ndarray, path: str | os.PathLike,
                 title: str = "") -> None:
    """Write a PNG heatmap of `counts` (clients x classes; client sizes for regression data).

    Uses matplotlib's Agg canvas directly, so no display and no global pyplot state.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("the partition heatmap needs matplotlib "
                          "(pip install 'edgefl[plot]')") from exc
    grid = counts if counts.shape[1] else sizes[:, None]
    n_clients, n_cols = grid.shape
    fig = Figure(figsize=(min(2.0 + 0.6 * n_cols, 14.0), min(1.6 + 0.3 * n_clients, 24.0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="samples")
    ax.set_xlabel("class" if counts.shape[1] else "")
    ax.set_ylabel("client")
    ax.set_xticks(range(n_cols),
                  [str(c) for c in range(n_cols)] if counts.shape[1] else ["samples"])
    if n_clients <= 40:
        ax.set_yticks(range(n_clients))
    if n_clients * n_cols <= 400:
        threshold = grid.max() / 2 if grid.size else 0
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, str(v), ha="center", va="center", fontsize=7,
                    color="black" if v > threshold else "white")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=100)
