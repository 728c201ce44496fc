"""The PNG of tools/convergence.py: each variant's training loss (smoothed), validation loss and
smoothed training loss relative to the reference, the mean over seeds with a ±1 std band.
"""
from __future__ import annotations

import math

import numpy as np


def smooth(values, window: int):
    """Trailing moving average (the first window-1 points average what there is)."""
    if window <= 1 or len(values) == 0:
        return values
    c = np.cumsum(np.insert(values, 0, 0.0))
    n = np.minimum(np.arange(1, len(values) + 1), window)
    return (c[1:] - c[np.arange(1, len(values) + 1) - n]) / n


def stacked(runs: list, part: str, key: str) -> tuple:
    """The steps every run of a variant logged and their values, one row per seed (NaN where a
    value was not finite)."""
    common = None
    for r in runs:
        steps = set(r[part]["step"])
        common = steps if common is None else common & steps
    steps = sorted(common or [])
    rows = []
    for r in runs:
        at = dict(zip(r[part]["step"], r[part][key]))
        rows.append([math.nan if at[s] is None else at[s] for s in steps])
    return np.array(steps), np.array(rows, dtype=float)


def band(ax, steps, rows, label, color):
    mean = np.nanmean(rows, axis=0)
    ax.plot(steps, mean, label=label, lw=1.2, color=color)
    if rows.shape[0] > 1:
        sd = np.nanstd(rows, axis=0, ddof=1)
        ax.fill_between(steps, mean - sd, mean + sd, color=color, alpha=0.18, lw=0)


def plot(path: str, data: dict, smoothing: int) -> None:
    """Training loss (moving average of `smoothing` steps), validation loss where the runs have
    it, and the smoothed training loss relative to the reference's, in %: the mean over seeds,
    the band ±1 std."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = data["meta"]["reference"]
    by_variant = {}
    for r in data["runs"]:
        by_variant.setdefault(r["variant"], []).append(r)
    has_eval = any(len(r["eval"]["step"]) > 1 for r in data["runs"])
    fig, axes = plt.subplots(1, 3 if has_eval else 2, figsize=(16 if has_eval else 11, 4.6))
    ref_runs = sorted(by_variant[ref], key=lambda r: r["seed"])
    ref_steps, ref_rows = stacked(ref_runs, "train", "loss")
    ref_smooth = np.array([smooth(row, smoothing) for row in ref_rows])
    for i, (name, rs) in enumerate(by_variant.items()):
        color = f"C{i % 10}"  # one colour a variant in every panel
        rs = sorted(rs, key=lambda r: r["seed"])
        steps, rows = stacked(rs, "train", "loss")
        sm = np.array([smooth(row, smoothing) for row in rows])
        band(axes[0], steps, sm, name, color)
        if has_eval:
            band(axes[1], *stacked(rs, "eval", "val_loss"), name, color)
        if name != ref and np.array_equal(steps, ref_steps):
            # Seed by seed where both have the same seeds (paired, as the table), else against
            # the reference's mean.
            paired = [r["seed"] for r in rs] == [r["seed"] for r in ref_runs]
            base = ref_smooth if paired else ref_smooth.mean(axis=0)
            band(axes[-1], steps, 100.0 * (sm - base) / base, name, color)
    axes[0].set_title("training loss" + (f" (moving average of {smoothing} steps)" if smoothing > 1 else ""))
    if has_eval:
        axes[1].set_title("validation loss")
    axes[-1].set_title(f"smoothed training loss vs {ref}, same seed (%)")
    axes[-1].axhline(0.0, color="k", lw=0.6)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{data['meta']['title']}: mean over seeds {data['meta']['seeds']}, band ±1 std", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
