"""What tools/convergence.py writes: the summary of each variant against the reference (mean ±
std over seeds, the difference with its 95% interval, NaN/skipped steps), the results JSON, the
markdown table and the PNG plots of the curves.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

import convergence_stats as stats


def summarize(variants: list, runs: list, reference: str, tolerance_pct: float) -> list:
    """One entry per variant, in the order given."""
    by_variant = {v.name: {r.seed: r for r in runs if r.variant.name == v.name} for v in variants}
    finals = {name: {seed: r.result["final_loss"] for seed, r in rs.items()} for name, rs in by_variant.items()}
    ref_ok = all(x is not None for x in finals[reference].values())
    out = []
    for v in variants:
        rs = by_variant[v.name]
        values = finals[v.name]
        bad = sorted(seed for seed, x in values.items() if x is None)
        entry = {"variant": v.name, "sets": v.sets, "seeds": sorted(values), "n": len(values),
                 "final_losses": {str(s): values[s] for s in sorted(values)},
                 "skipped_steps": sum(len(r.result["skipped_steps"]) for r in rs.values()),
                 "nonfinite_losses": sum(r.result["nonfinite_losses"] for r in rs.values()),
                 "nonfinite_final_seeds": bad, "identical_seeds": identical_curves(list(rs.values()))}
        if not bad:
            entry["mean"], entry["std"] = stats.mean_std(list(values.values()))
            if v.name != reference and ref_ok:
                entry["vs_reference"] = stats.compare(values, finals[reference], tolerance_pct)
        out.append(entry)
    return out


def identical_curves(runs: list) -> bool:
    """Two or more seeds whose training curves are the same value for value: the seed did not
    reach the run, and the spread over seeds is not noise but zero."""
    curves = [tuple(r.result["train"]["loss"]) for r in runs]
    return len(curves) > 1 and len(set(curves)) == 1


def results_json(meta: dict, runs: list, summary: list) -> dict:
    return {"meta": meta, "summary": summary,
            "runs": [{"variant": r.variant.name, "seed": r.seed, "folder": r.folder, "log": r.log,
                      "command": r.command, **r.result} for r in runs]}


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, allow_nan=False, default=str)
        f.write("\n")


# ---- the markdown table -----------------------------------------------------------------------

def _num(x: float | None, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}".replace("-", "−")


def table_row(e: dict, reference: str, tolerance_pct: float) -> str:
    health = "none" if not (e["skipped_steps"] or e["nonfinite_losses"]) else \
        f"{e['skipped_steps']} skipped, {e['nonfinite_losses']} non-finite"
    if "mean" not in e:
        return f"| {e['variant']} | {e['n']} | non-finite (seeds {e['nonfinite_final_seeds']}) | — | — | — | {health} |"
    ms = _num(e["mean"]) + ("" if e["std"] is None else f" ± {_num(e['std'])}")
    if e["identical_seeds"]:
        ms += " (seeds identical)"
    c = e.get("vs_reference")
    if e["variant"] == reference or c is None:
        return f"| {e['variant']} | {e['n']} | {ms} | — | — | — | {health} |"
    used = c["paired"] if c["used"] == "paired" else c["welch"]
    if used is None:
        diff, rel = _signed(c["diff"], 4), _signed(c["rel_pct"], 2) + "%"
    else:
        diff = f"{_signed(c['diff'], 4)} [{_signed(used['low'], 4)}, {_signed(used['high'], 4)}] {c['used']}"
        rel = f"{_signed(c['rel_pct'], 2)}% [{_signed(c['rel_low_pct'], 2)}, {_signed(c['rel_high_pct'], 2)}]"
    return f"| {e['variant']} | {e['n']} | {ms} | {diff} | {rel} | {c['verdict']} | {health} |"


def markdown(meta: dict, summary: list) -> str:
    ref, tol = meta["reference"], meta["tolerance_pct"]
    lines = [f"{meta['title']}: {meta['what']}; final loss = {meta['final_metric']}; seeds {meta['seeds']}.", "",
             f"| run | seeds | final loss (mean ± std) | Δ vs {ref} [95% CI] | Δ % [95% CI] | within ±{tol:g}% "
             "| NaN / skipped steps |",
             "|---|---|---|---|---|---|---|"]
    lines += [table_row(e, ref, tol) for e in summary]
    return "\n".join(lines) + "\n"


# ---- the plots --------------------------------------------------------------------------------

def smooth(values: np.ndarray, window: int) -> np.ndarray:
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


def band(ax, steps, rows, label):
    mean = np.nanmean(rows, axis=0)
    line, = ax.plot(steps, mean, label=label, lw=1.2)
    if rows.shape[0] > 1:
        sd = np.nanstd(rows, axis=0, ddof=1)
        ax.fill_between(steps, mean - sd, mean + sd, color=line.get_color(), alpha=0.18, lw=0)


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
    for name, rs in by_variant.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        steps, rows = stacked(rs, "train", "loss")
        sm = np.array([smooth(row, smoothing) for row in rows])
        band(axes[0], steps, sm, name)
        if has_eval:
            band(axes[1], *stacked(rs, "eval", "val_loss"), name)
        if name != ref and np.array_equal(steps, ref_steps):
            # Seed by seed where both have the same seeds (paired, as the table), else against
            # the reference's mean.
            paired = [r["seed"] for r in rs] == [r["seed"] for r in ref_runs]
            base = ref_smooth if paired else ref_smooth.mean(axis=0)
            band(axes[-1], steps, 100.0 * (sm - base) / base, name)
    axes[0].set_title(f"training loss (moving average of {smoothing} steps)")
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
