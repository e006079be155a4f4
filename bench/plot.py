"""Bench results as bar charts in a picture (`--plot FILE.png`), drawn by matplotlib when it is installed.

matplotlib is no requirement of gymproxy or of its bench: `pip install matplotlib`, or the `plot`
extra (`pip install -e '.[plot]'`). The scripts call `problem` while they read their options, so
a missing matplotlib or an unusable path is said at once, not after a long run.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

INSTALL = "pip install matplotlib (or gymproxy's plot extra: pip install -e '.[plot]')"


class Bar(NamedTuple):
    median: float
    low: float  # the spread over rounds or runs: the least and the most
    high: float


class Panel(NamedTuple):
    title: str
    ylabel: str
    groups: Sequence[str]  # along the x axis ("" for one group without a label)
    series: Sequence[str]  # the bars of each group: one colour each, named in the figure's legend
    bars: Mapping[tuple[str, str], Bar]  # (group, series) -> its bar; no entry, no bar
    notes: Mapping[tuple[str, str], str] = {}  # a short text over a bar


def bar(values: Sequence[float | None]) -> Bar | None:
    """The median of `values` with their range, or None when there is none."""
    present = [v for v in values if v is not None]
    return Bar(statistics.median(present), min(present), max(present)) if present else None


def problem(path: str) -> str | None:
    """Why `path` cannot be drawn to (one line, with how to fix it), or None when it can."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return f"--plot needs matplotlib, which is not installed: {INSTALL}"
    kinds = FigureCanvasAgg.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix not in kinds:
        return f"--plot {path}: name a picture file: .png (or {', '.join(sorted(k for k in kinds if k != 'png'))})"
    if not Path(path).resolve().parent.is_dir():
        return f"--plot {path}: the directory {Path(path).resolve().parent} does not exist"
    return None


def write(path: str, title: str, panels: Sequence[Panel], *, columns: int = 3) -> None:
    """Draw `panels` in a grid, `columns` wide, with one legend, and save the picture to `path`."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    columns = max(1, min(columns, len(panels)))
    rows = (len(panels) + columns - 1) // columns
    bars = max(len(panel.groups) * len(panel.series) for panel in panels)
    width = max(4.6, 1.2 + 0.3 * bars)  # a panel: room for its bars, and the title above a one-panel figure
    figure = Figure(figsize=(width * columns, 3.4 * rows + 1.1), layout="constrained")
    axes = list(figure.subplots(rows, columns, squeeze=False).flat)
    series = list(dict.fromkeys(name for panel in panels for name in panel.series))
    colours = {name: f"C{i % 10}" for i, name in enumerate(series)}
    for ax, panel in zip(axes, panels, strict=False):  # more axes than panels: the rest are hidden
        _draw(ax, panel, colours)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    handles = [_swatch(colours[name]) for name in series]
    figure.legend(handles, series, loc="outside lower center", ncols=min(len(series), 5), frameon=False)
    figure.suptitle(title)
    figure.savefig(path, dpi=110)


def _swatch(colour: str) -> Any:
    from matplotlib.patches import Patch

    return Patch(color=colour)


def _draw(ax: Any, panel: Panel, colours: Mapping[str, str]) -> None:
    width = 0.8 / max(1, len(panel.series))
    for i, name in enumerate(panel.series):
        xs, heights, below, above, notes = [], [], [], [], []
        for g, group in enumerate(panel.groups):
            found = panel.bars.get((group, name))
            if found is None:
                continue
            xs.append(g - 0.4 + width * (i + 0.5))
            heights.append(found.median)
            below.append(found.median - found.low)
            above.append(found.high - found.median)
            notes.append(panel.notes.get((group, name), ""))
        if not xs:
            continue
        drawn = ax.bar(xs, heights, width * 0.9, color=colours[name], yerr=[below, above], capsize=3, ecolor="0.3")
        if any(notes):
            ax.bar_label(drawn, notes, padding=2, fontsize=7)
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel, fontsize=9)
    if any(panel.groups):
        ax.set_xticks(range(len(panel.groups)), panel.groups, fontsize=8, rotation=20 if len(panel.groups) > 3 else 0)
    else:
        ax.set_xticks([])
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
