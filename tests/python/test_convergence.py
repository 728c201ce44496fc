#!/usr/bin/env python3
"""The FP8 convergence harness (tools/convergence.py) at smoke size on the CPU.

    python3 tests/python/test_convergence.py <flux8 binary> <source dir>

Needs numpy and matplotlib (scripts/install_deps.sh installs them; exit 77 when they are
missing). Checks:
  1. The statistics against numbers worked out by hand: mean and sample std, Student t
     quantiles, Welch's and the paired 95% interval, the within/outside/undecided verdict.
  2. Reading a run: skipped steps (a step record's `skipped` and the run's `skipped_step`
     events), non-finite losses, an unfinished run; a bench run's final loss (the mean of the
     last window); seeds that gave the same curve.
  3. The demo tier: configs/demo.yaml with its model shrunk, 2 seeds, 6 steps, BF16 and FP8
     delayed/blockwise x e4m3/hybrid: results.json (every run's curves, the summary equal to the
     statistics of the validation losses in each metrics.jsonl), table.md, curves.png,
     timings.tsv.
  4. A second call reruns nothing; a call with another variant runs only that one; --reference
     compares against another row and leaves bf16 out; an unfinished run is rerun; a folder
     made with other arguments, or resolving to other settings, is refused.
  5. A failing run (a misspelt key) is an error naming the run and its log; --set seed and more
     jobs than --gpus are refused.
  6. The bench tier (flux8 bench --data structured) on the shrunk demo model, its runs spread
     over --gpus.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

try:
    import matplotlib  # noqa: F401
    import numpy as np
except ImportError as e:
    print(f"SKIP: {e}: install numpy and matplotlib (scripts/install_deps.sh)")
    sys.exit(77)

FLUX8, SRC = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
sys.path.insert(0, os.path.join(SRC, "tools"))
import convergence_runs as runs  # noqa: E402
import convergence_stats as st  # noqa: E402
from convergence_report import identical_curves  # noqa: E402

# The demo config shrunk (one block of each kind, 8x8 images): about a second a run.
SHRINK = ["backend=cpu", "hidden_size=24", "num_attention_heads=2", "axes_dim=[2,4,6]", "num_double_blocks=1",
          "num_single_blocks=1", "context_dim=8", "vec_dim=8", "text_seq_len=4", "image_size=8",
          "micro_batch_size=2"]
TRAIN_SETS = SHRINK + ["demo_train_samples=32", "demo_val_samples=8", "data_shuffle_buffer=8", "eval_interval=2",
                       "lr_warmup_iters=2", "save_interval=0", "keep_last_checkpoints=1", "tensorboard_dir=none"]


def close(a, b, tol=1e-9):
    return abs(a - b) <= tol * max(1.0, abs(b))


def check_statistics():
    m, s = st.mean_std([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and close(s, math.sqrt(5.0 / 3.0)), (m, s)  # squares 2.25+0.25+0.25+2.25 = 5, / 3
    assert st.mean_std([0.7]) == (0.7, None)
    # Student t 97.5% quantiles (printed tables): df 1, 2, 4, 10.
    for df, t in [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281)]:
        assert abs(st.t_quantile(0.975, df) - t) < 1e-4, (df, st.t_quantile(0.975, df))
    a, b = {1: 1.0, 2: 2.0, 3: 4.0}, {1: 0.5, 2: 1.0, 3: 3.0}
    # Paired: differences 0.5, 1, 1 -> mean 5/6, sd sqrt(1/12), se sqrt(1/12)/sqrt(3) = 1/6,
    # half-width t(0.975, 2) / 6 = 0.717109.
    p = st.paired_interval(a, b)
    assert p["n"] == 3 and p["df"] == 2 and close(p["diff"], 5 / 6) and close(p["se"], 1 / 6), p
    assert abs(p["low"] - 0.116225) < 1e-6 and abs(p["high"] - 1.550442) < 1e-6, p
    # Welch: means 7/3 and 1.5, variances 7/3 and 1.75, se^2 = 7/9 + 7/12 = 49/36, se = 7/6,
    # df = (49/36)^2 / ((7/9)^2/2 + (7/12)^2/2) = 3.92, t(0.975, 3.92) = 2.79894.
    w = st.welch_interval(list(a.values()), list(b.values()))
    assert close(w["diff"], 5 / 6) and close(w["se"], 7 / 6) and abs(w["df"] - 3.92) < 1e-9, w
    assert abs(w["low"] + 2.432091) < 1e-6 and abs(w["high"] - 4.098757) < 1e-6, w
    assert st.paired_interval({1: 1.0}, {1: 2.0}) is None and st.welch_interval([1.0], [1.0, 2.0]) is None
    c = st.compare(a, b, 1.0)
    assert c["used"] == "paired" and close(c["rel_pct"], 100 * (5 / 6) / 1.5) and c["verdict"] == "outside", c
    assert st.compare({1: 1.0, 2: 2.0}, {3: 1.0, 4: 2.0}, 1.0)["used"] == "welch"
    assert st.verdict(-0.5, 0.9, 1.0) == "within"
    assert st.verdict(1.2, 3.0, 1.0) == "outside" and st.verdict(-3.0, -1.1, 1.0) == "outside"
    assert st.verdict(0.5, 1.5, 1.0) == "undecided"


def write_lines(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def check_reading(tmp):
    run = runs.Run(runs.Variant("x", []), 1, os.path.join(tmp, "read"), os.path.join(tmp, "read.log"))
    recs = [{"kind": "eval", "step": 0, "val_loss": 2.0, "when": "start"},
            {"kind": "step", "step": 1, "loss": 1.9, "skipped": False},
            {"kind": "run", "step": 2, "event": "skipped_step"},  # a step between two logged ones
            {"kind": "step", "step": 3, "loss": None, "skipped": True},  # NaN is written as null
            {"kind": "step", "step": 4, "loss": 1.7, "skipped": False}]
    write_lines(os.path.join(run.folder, "metrics.jsonl"), recs)
    assert runs.read_train_metrics(run) is None, "a run without its end-of-run validation is unfinished"
    write_lines(os.path.join(run.folder, "metrics.jsonl"),
                recs + [{"kind": "eval", "step": 4, "val_loss": 1.8, "when": "end"}])
    r = runs.read_train_metrics(run)
    assert r["final_loss"] == 1.8 and r["final_step"] == 4 and r["skipped_steps"] == [2, 3], r
    assert r["nonfinite_losses"] == 1 and r["train"]["step"] == [1, 3, 4] and r["eval"]["step"] == [0, 4], r
    with open(os.path.join(run.folder, "bench.json"), "w", encoding="utf-8") as f:
        json.dump({"steps": [{"losses": [4.0, 3.0, 2.0, 1.0], "non_finite_steps": 0}]}, f)
    b = runs.read_bench_json(run, 4, 3)
    assert b["final_loss"] == 2.0 and b["train"]["step"] == [1, 2, 3, 4], b
    assert runs.read_bench_json(run, 5, 3) is None, "fewer losses than steps: unfinished"
    same = [runs.Run(None, s, "", "", result={"train": {"loss": [1.0, 0.5]}}) for s in (1, 2)]
    assert identical_curves(same) and not identical_curves(same[:1])


def harness(out, *args, expect_ok=True):
    cmd = [sys.executable, os.path.join(SRC, "tools", "convergence.py"), "--flux8", FLUX8, "--out", out,
           "--seeds", "1,2", "--jobs", "2", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=SRC)
    assert (res.returncode == 0) == expect_ok, f"{' '.join(cmd)}\nstatus {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def demo_args(*extra):
    args = ["--steps", "6", "--recipes", "delayed,blockwise", "--formats", "e4m3,hybrid", *extra]
    for kv in TRAIN_SETS:
        args += ["--set", kv]
    return args


VARIANTS = ["bf16", "delayed_e4m3", "delayed_hybrid", "blockwise_e4m3", "blockwise_hybrid"]


def end_loss(folder):
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as f:
        ends = [r["val_loss"] for r in map(json.loads, f) if r["kind"] == "eval" and r.get("when") == "end"]
    assert len(ends) == 1, folder
    return ends[0]


def check_demo_outputs(out, stdout):
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        data = json.load(f)
    assert data["meta"]["seeds"] == [1, 2] and data["meta"]["steps"] == 6 and data["meta"]["reference"] == "bf16"
    assert [e["variant"] for e in data["summary"]] == VARIANTS
    assert len(data["runs"]) == 10
    finals = {}
    for r in data["runs"]:
        assert r["train"]["step"] == [1, 2, 3, 4, 5, 6] and r["eval"]["step"] == [0, 2, 4, 6], r["folder"]
        assert r["final_loss"] == end_loss(r["folder"]) and r["skipped_steps"] == [], r["folder"]
        assert r["folder"] == os.path.join(out, f"{r['variant']}_seed{r['seed']}") and os.path.exists(r["log"])
        finals[(r["variant"], r["seed"])] = r["final_loss"]
    ref = np.array([finals[("bf16", 1)], finals[("bf16", 2)]])
    for e in data["summary"]:
        v = np.array([finals[(e["variant"], 1)], finals[(e["variant"], 2)]])
        assert close(e["mean"], v.mean()) and close(e["std"], v.std(ddof=1)), e
        if e["variant"] == "bf16":
            assert "vs_reference" not in e
            continue
        c = e["vs_reference"]
        d = v - ref  # same seed = same data and initial weights: paired, t(0.975, 1) = 12.7062
        half = 12.706205 * d.std(ddof=1) / math.sqrt(2)
        assert c["used"] == "paired" and close(c["diff"], d.mean()), c
        assert abs(c["paired"]["low"] - (d.mean() - half)) < 1e-6 and abs(c["paired"]["high"] - (d.mean() + half)) < 1e-6
        assert close(c["rel_pct"], 100 * d.mean() / ref.mean()), c
        assert e["skipped_steps"] == 0 and e["nonfinite_losses"] == 0
    assert any(abs(e["vs_reference"]["diff"]) > 1e-6 for e in data["summary"][1:]), "FP8 changed nothing"
    with open(os.path.join(out, "table.md"), encoding="utf-8") as f:
        table = f.read()
    assert table == stdout, "the table printed is the one written"
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| run | seeds | final loss (mean ± std) | Δ vs bf16 [95% CI]"), rows[0]
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == VARIANTS, rows
    assert all(" ± " in row and row.endswith("| none |") for row in rows[1:]), rows
    assert all(" paired | " in row for row in rows[2:]), rows
    with open(os.path.join(out, "curves.png"), "rb") as f:
        png = f.read(24)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") > 400, png
    with open(os.path.join(out, "timings.tsv"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 11
    return data


def mtimes(out):
    return {d: os.path.getmtime(os.path.join(out, d, "metrics.jsonl")) for d in os.listdir(out)
            if os.path.exists(os.path.join(out, d, "metrics.jsonl"))}


def check_resume(out, first_stdout):
    before = mtimes(out)
    res = harness(out, *demo_args())
    assert res.stdout == first_stdout and mtimes(out) == before, "a second call reran finished runs"
    assert res.stderr.count("reused") == 10 and "started" not in res.stderr, res.stderr
    res = harness(out, *demo_args("--variant", "f32_moments: adam_moment_precision=f32"))
    started = sorted(line.split()[1].rstrip(":") for line in res.stderr.splitlines() if "started" in line)
    assert started == ["f32_moments_seed1", "f32_moments_seed2"], res.stderr
    assert "| f32_moments | 2 |" in res.stdout, res.stdout
    # --reference: candidates against another row, seed by seed, without the bf16 runs.
    res = harness(out, *demo_args("--recipes", "delayed", "--formats", "hybrid", "--reference", "delayed_hybrid",
                                  "--variant", "f32_moments: adam_moment_precision=f32"))
    assert "started" not in res.stderr, res.stderr
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")]
    assert "| Δ vs delayed_hybrid [95% CI] |" in rows[0], rows[0]
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == ["delayed_hybrid", "f32_moments"], rows
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        data = json.load(f)
    finals = {(r["variant"], r["seed"]): r["final_loss"] for r in data["runs"]}
    d = [finals[("f32_moments", s)] - finals[("delayed_hybrid", s)] for s in (1, 2)]
    c = data["summary"][1]["vs_reference"]
    assert data["meta"]["reference"] == "delayed_hybrid" and c["used"] == "paired" and close(c["diff"], sum(d) / 2), c
    res = harness(out, *demo_args("--reference", "tensorwise_e4m3"), expect_ok=False)
    assert "--reference tensorwise_e4m3: no such row" in res.stderr, res.stderr
    # --time-budget: runs that could not end in time are not started (every run so far took longer
    # than 0 s); the finished ones make the table and the call says what is left (exit status 3).
    res = harness(out, *demo_args("--variant", "late: adam_moment_precision=bf16", "--time-budget", "0"),
                  expect_ok=False)
    assert res.returncode == 3 and res.stderr.count("not started (--time-budget 0 s)") == 2, res.stderr
    assert "2 runs not started within --time-budget (late_seed1, late_seed2)" in res.stderr, res.stderr
    assert "| late |" not in res.stdout and "| delayed_hybrid | 2 |" in res.stdout, res.stdout
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        assert json.load(f)["meta"]["not_run"] == ["late_seed1", "late_seed2"]
    # An interrupted run (no end-of-run validation yet) is run again, and only it.
    path = os.path.join(out, "delayed_hybrid_seed2", "metrics.jsonl")
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if '"when":"end"' not in line]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)
    res = harness(out, *demo_args())
    started = [line.split()[1].rstrip(":") for line in res.stderr.splitlines() if "started" in line]
    assert started == ["delayed_hybrid_seed2"] and res.stdout == first_stdout, res.stderr
    res = harness(out, *demo_args("--steps", "5"), expect_ok=False)
    assert "bf16_seed1 made with other arguments" in res.stderr and "train_iters=5" in res.stderr, res.stderr
    # A run made by a flux8 whose resolved settings differ (another default) is not reused either:
    # its stamp holds the digest of the config it resolved to.
    stamp = os.path.join(out, "bf16_seed1", runs.RUN_FILE)
    with open(stamp, encoding="utf-8") as f:
        made = json.load(f)
    digests = [a for a in made["identity"] if a.startswith("resolved-config=")]
    assert len(digests) == 1 and len(digests[0]) == len("resolved-config=") + 16, made["identity"]
    changed = dict(made, identity=[a if a not in digests else "resolved-config=0000000000000000" for a in made["identity"]])
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(changed, f)
    res = harness(out, *demo_args(), expect_ok=False)
    assert "bf16_seed1 made with other arguments or other resolved settings" in res.stderr, res.stderr
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(made, f)


def check_failures(tmp):
    out = os.path.join(tmp, "fail")
    res = harness(out, *demo_args("--recipes", "none", "--variant", "misspelt: fp8_recipy=delayed"), expect_ok=False)
    log = os.path.join(out, "misspelt_seed1.log")
    assert "run misspelt_seed1 failed (exit status 78, config error): see " + log in res.stderr, res.stderr
    assert "fp8_recipy" in res.stderr and os.path.exists(log), res.stderr
    assert not os.path.exists(os.path.join(out, "results.json")), "no table from a failed call"
    res = harness(out, *demo_args("--set", "seed=3"), expect_ok=False)
    assert "use --seeds" in res.stderr, res.stderr
    res = harness(out, *demo_args("--gpus", "0"), expect_ok=False)  # --jobs 2 (harness()) on one GPU
    assert "at most one run a GPU" in res.stderr, res.stderr


def check_bench_tier(tmp):
    out = os.path.join(tmp, "bench")
    args = ["--tier", "w1", "-c", os.path.join(SRC, "configs", "demo.yaml"), "--backend", "cpu", "--steps", "8",
            "--final-window", "4", "--recipes", "tensorwise", "--formats", "hybrid"]
    for kv in SHRINK:
        args += ["--set", kv]
    res = harness(out, *args, "--gpus", "0,1")  # (CUDA_VISIBLE_DEVICES: ignored by the CPU backend)
    started = [line for line in res.stderr.splitlines() if "started" in line]
    assert len(started) == 4 and all(", GPU 0)" in s or ", GPU 1)" in s for s in started), res.stderr
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        data = json.load(f)
    assert [e["variant"] for e in data["summary"]] == ["bf16", "tensorwise_hybrid"]
    curves = {}
    for r in data["runs"]:
        with open(os.path.join(r["folder"], "bench.json"), encoding="utf-8") as f:
            losses = json.load(f)["steps"][0]["losses"]
        assert r["train"]["loss"] == losses and close(r["final_loss"], float(np.mean(losses[-4:]))), r["folder"]
        curves.setdefault(r["variant"], []).append(tuple(losses))
    for e in data["summary"]:  # flagged exactly when the seeds' curves are the same
        assert e["identical_seeds"] == (len(set(curves[e["variant"]])) == 1), e
    c = data["summary"][1]["vs_reference"]
    assert (c["verdict"] == "seeds identical") == (data["summary"][0]["identical_seeds"] or
                                                   data["summary"][1]["identical_seeds"]), c


def main():
    check_statistics()
    with tempfile.TemporaryDirectory() as tmp:
        check_reading(tmp)
        out = os.path.join(tmp, "demo")
        first = harness(out, *demo_args())
        check_demo_outputs(out, first.stdout)
        check_resume(out, first.stdout)
        check_failures(tmp)
        check_bench_tier(tmp)
    print("convergence harness: OK")


if __name__ == "__main__":
    main()
