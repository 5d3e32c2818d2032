"""Matplotlib figures: attention heatmaps, learning curves, BLEU by source length. Each
function returns what it drew, read back from the figure (series and their point counts, or
the image's shape), so a report can say what its figures show."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

Fn = TypeVar("Fn", bound=Callable[..., Any])

# The largest side of an attention heatmap, in inches (at 120 dpi): a cell is 0.45 x 0.4 in
# up to ~60 pieces, smaller beyond. Uncapped, a 256-piece source drew a 14,000-pixel-wide
# image that took 1-3 GB of memory and 6-12 s.
MAX_INCHES = 30.0
COLUMN_INCHES, ROW_INCHES = 0.45, 0.4


def literal_text(fn: Fn) -> Fn:
    """Text drawn as given: a `$` in a sentence, a subword or a system's name is not
    matplotlib's math markup (a sentence such as "says $5 ... was $10" made it raise, and a
    figure was lost with whatever came after it)."""

    @functools.wraps(fn)
    def draw(*args, **kwargs):
        with plt.rc_context({"text.parse_math": False}):
            return fn(*args, **kwargs)

    return draw  # type: ignore[return-value]


def _save(fig, path) -> None:
    """At exactly `path`: in the format its suffix names (png, svg, pdf...), else PNG."""
    suffix = Path(path).suffix[1:].lower()
    fmt = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"
    fig.savefig(path, dpi=120, format=fmt)


@literal_text
def attention_heatmap(
    weights: np.ndarray, src: list[str], tgt: list[str], path: Path, title: str = "", ax: Any = None
) -> dict[str, Any]:
    """weights[T,S]: target rows, source columns, subword labels on both axes. Returns the
    drawn image's shape and its axis labels. Its own figure (no `ax`) is at most MAX_INCHES
    a side: the cells and labels of a long sentence shrink."""
    own = ax is None
    # cells and labels smaller where a side would pass the cap (2 in for the labels' margin)
    cells = max(COLUMN_INCHES * len(src), ROW_INCHES * len(tgt), 1e-9)
    scale = min(1.0, (MAX_INCHES - 2) / cells)
    font = max(2.0, 8 * scale)
    if own:
        width = max(4, scale * COLUMN_INCHES * len(src) + 2)
        fig, ax = plt.subplots(figsize=(width, max(3, scale * ROW_INCHES * len(tgt) + 1.5)))
    ax.imshow(weights, cmap="Greys", vmin=0.0, vmax=max(float(weights.max()), 1e-6), aspect="auto")
    ax.set_xticks(range(len(src)), src, rotation=90, fontsize=font)
    ax.set_yticks(range(len(tgt)), tgt, fontsize=font)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    if title:
        ax.set_title(title, fontsize=9)
    drawn = {
        "shape": list(ax.images[-1].get_array().shape),
        "x_labels": [t.get_text() for t in ax.get_xticklabels()],
        "y_labels": [t.get_text() for t in ax.get_yticklabels()],
    }
    if own:
        fig.tight_layout()
        _save(fig, path)
        plt.close(fig)
    return drawn


@literal_text
def curves(
    series: dict[str, list[tuple[float, float]]],
    xlabel: str,
    ylabel: str,
    path: Path,
    title: str = "",
) -> dict[str, int]:
    """One line per system: series[name] = [(x, y), ...]. Returns {label: points drawn}."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    drawn = {line.get_label(): len(line.get_xdata()) for line in ax.get_lines()}
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return drawn


@literal_text
def band_curves(
    series: dict[str, list[list[tuple[float, float]]]],
    xlabel: str,
    ylabel: str,
    path: Path,
    title: str = "",
) -> dict[str, Any]:
    """One line per system over its runs (seeds): series[name] = one [(x, y), ...] per run.
    With several runs, the line is their mean at the x values all runs share (the mean x
    when x differs, as wall-clock minutes do at a step) and a band spans their min and max.
    Returns {"series": {label: points drawn}, "bands": [labels with a band]}."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bands = []
    for name, runs in series.items():
        runs = [r for r in runs if r]
        if not runs:
            continue
        if len(runs) == 1:
            xs, ys = zip(*runs[0])
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
            continue
        n = min(len(r) for r in runs)  # the points every run has (same schedule of records)
        xs = np.mean([[x for x, _ in r[:n]] for r in runs], axis=0)
        ys = np.array([[y for _, y in r[:n]] for r in runs])
        (line,) = ax.plot(xs, ys.mean(0), marker="o" if n < 30 else None, markersize=3, label=name)
        ax.fill_between(xs, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2)
        bands.append(name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend()
    drawn = {
        "series": {line.get_label(): len(line.get_xdata()) for line in ax.get_lines()},
        "bands": [b for b in bands if len(ax.collections)],
    }
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return drawn


@literal_text
def grouped_bars(
    groups: list[str],
    values: dict[str, list[float]],
    xlabel: str,
    ylabel: str,
    path: Path,
    title: str = "",
) -> dict[str, int]:
    """Bars per group (e.g. source-length bucket), one colour per system. Returns {label:
    bars drawn}."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(values), 1)
    x = np.arange(len(groups))
    for k, (name, ys) in enumerate(values.items()):
        ax.bar(x + k * width - 0.4 + width / 2, ys, width, label=name)
    ax.set_xticks(x, groups)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    drawn = {bars.get_label(): len(bars) for bars in ax.containers}
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return drawn
