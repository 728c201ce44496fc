"""Statistics of tools/convergence.py: mean ± std over seeds and the difference of two variants'
final losses with a 95% confidence interval (Student t; Welch's for unpaired samples).

Pure Python (math only), so that the numbers can be checked by hand: the t quantile comes from
the regularised incomplete beta function (a continued fraction, Numerical Recipes' betacf),
inverted by bisection.
"""
from __future__ import annotations

import math

CONFIDENCE = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df (real, > 0) degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t value below which a fraction p (0.5 <= p < 1) of Student's t(df) lies."""
    if not 0.5 <= p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for a single value)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_std of no values")
    mean = sum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def _interval(diff: float, se: float, df: float | None) -> dict:
    if df is None or se == 0.0:  # identical samples: no spread to scale a t quantile by
        half = 0.0
    else:
        half = t_quantile(0.5 + CONFIDENCE / 2.0, df) * se
    return {"diff": diff, "se": se, "df": df, "low": diff - half, "high": diff + half}


def welch_interval(a: list[float], b: list[float]) -> dict | None:
    """mean(a) - mean(b) with Welch's 95% interval (unequal variances); None below 2 values each."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, sa = mean_std(a)
    mb, sb = mean_std(b)
    va, vb = sa * sa / len(a), sb * sb / len(b)
    se = math.sqrt(va + vb)
    df = None if se == 0.0 else (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    return {"method": "welch", "n": [len(a), len(b)], **_interval(ma - mb, se, df)}


def paired_interval(a: dict, b: dict) -> dict | None:
    """Mean of a[seed] - b[seed] over the seeds both have, with its 95% t interval (n - 1
    degrees of freedom); None below 2 shared seeds. a, b: {seed: final loss}."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    diffs = [a[s] - b[s] for s in seeds]
    mean, sd = mean_std(diffs)
    return {"method": "paired", "n": len(seeds), "seeds": seeds, **_interval(mean, sd / math.sqrt(len(seeds)),
                                                                               len(seeds) - 1)}


def compare(variant: dict, reference: dict, tolerance_pct: float) -> dict:
    """variant, reference: {seed: final loss}. The difference, relative to the reference's mean,
    with the paired interval when every seed of both is shared (same seed = same data and
    initial weights), else Welch's; and whether the interval lies within ±tolerance_pct."""
    ref_mean, _ = mean_std(list(reference.values()))
    var_mean, _ = mean_std(list(variant.values()))
    paired = paired_interval(variant, reference)
    welch = welch_interval(list(variant.values()), list(reference.values()))
    all_paired = paired is not None and set(variant) == set(reference)
    used = paired if all_paired else welch
    out = {"diff": var_mean - ref_mean, "rel_pct": 100.0 * (var_mean - ref_mean) / ref_mean,
           "paired": paired, "welch": welch, "used": used["method"] if used else None}
    if used:
        out["rel_low_pct"] = 100.0 * used["low"] / ref_mean
        out["rel_high_pct"] = 100.0 * used["high"] / ref_mean
        out["verdict"] = verdict(out["rel_low_pct"], out["rel_high_pct"], tolerance_pct)
    else:
        out["verdict"] = "too few seeds"
    return out


def verdict(low_pct: float, high_pct: float, tolerance_pct: float) -> str:
    """'within' when the whole interval lies inside ±tolerance, 'outside' when none of it does,
    else 'undecided' (more seeds or steps needed)."""
    if -tolerance_pct <= low_pct and high_pct <= tolerance_pct:
        return "within"
    if low_pct > tolerance_pct or high_pct < -tolerance_pct:
        return "outside"
    return "undecided"
