"""Training curves of a run directory (``metrics.jsonl``) drawn to a PNG with matplotlib's Agg canvas."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from polynets._io import atomic_write_bytes
from polynets.errors import DataError

__all__ = ["plot_run", "read_metrics"]


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of ``run_dir/metrics.jsonl`` (or of the given .jsonl file), skipping malformed lines."""
    from polynets.training.metrics import read_metrics_log

    path = Path(run_dir)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"no metrics log at {path}; expected a run directory written by `polynets train --out DIR`")
    records = read_metrics_log(path)
    if not records:
        raise DataError(f"{path} holds no metrics records yet")
    return records


def plot_run(run_dir: str | os.PathLike, out_png: str | os.PathLike | None = None) -> Path:
    """Draw loss (per step and per epoch), accuracy (per epoch) and learning rate to ``out_png``.

    ``out_png`` defaults to ``run_dir/curves.png``; the file is written atomically. Returns its path.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("kind") == "step"]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc, ax_lr = fig.subplots(1, 3)
    if steps:
        ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=1, alpha=0.6, label="train (steps)")
    for key, style in (("train_loss", "o-"), ("val_loss", "s-")):
        pts = [(r["step"], r[key]) for r in epochs if key in r]
        if pts:
            ax_loss.plot(*zip(*pts), style, label=key.replace("_", " "))
    losses = [y for line in ax_loss.get_lines() for y in line.get_ydata()]
    if losses and min(losses) > 0:  # polynomial nets can spike by orders of magnitude
        ax_loss.set_yscale("log")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    for key, style in (("train_accuracy", "o-"), ("val_accuracy", "s-"), ("val_ema_accuracy", "^--")):
        pts = [(r["epoch"], r[key]) for r in epochs if key in r]
        if pts:
            ax_acc.plot(*zip(*pts), style, label=key.replace("_", " "))
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    lr_pts = [(r["step"], r["lr"]) for r in steps + epochs if "lr" in r]
    if lr_pts:
        ax_lr.plot(*zip(*sorted(lr_pts)), lw=1)
    ax_lr.set(xlabel="step", ylabel="learning rate", title="learning rate")
    for ax in (ax_loss, ax_acc):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"run {Path(run_dir).resolve().name}")
    out = Path(out_png) if out_png is not None else (Path(run_dir) if Path(run_dir).is_dir() else Path(run_dir).parent) / "curves.png"
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    atomic_write_bytes(out, png.getbuffer())
    return out
