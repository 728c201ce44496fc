"""What tools/convergence.py writes: the summary of each variant against the reference (mean ±
std over seeds, the difference with its 95% interval, NaN/skipped steps), the results JSON and
the markdown table (standard library only; the plots are convergence_plot.py's).
"""
from __future__ import annotations

import json
import math

import convergence_stats as stats


def summarize(variants: list, runs: list, reference: str, tolerance_pct: float) -> list:
    """One entry per variant, in the order given."""
    by_variant = {v.name: {r.seed: r for r in runs if r.variant.name == v.name} for v in variants}
    finals = {name: {seed: r.result["final_loss"] for seed, r in rs.items()} for name, rs in by_variant.items()}
    ref_ok = all(x is not None for x in finals[reference].values())
    ref_identical = identical_curves(list(by_variant[reference].values()))
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
                c = stats.compare(values, finals[reference], tolerance_pct)
                if entry["identical_seeds"] or ref_identical:  # a zero-width interval, not a measurement
                    c["verdict"] = "seeds identical"
                entry["vs_reference"] = c
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
    """+0.0123, or +1.2e-07 where the fixed digits would show only zeros."""
    text = f"{x:+.{digits}f}" if x == 0 or abs(x) >= 0.5 * 10 ** -digits else f"{x:+.1e}"
    return text.replace("-", "−")


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
