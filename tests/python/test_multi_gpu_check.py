#!/usr/bin/env python3
"""The multi-GPU machine's checks (tools/multi_gpu_check.py) as two CPU ranks, on a shrunk demo.

    python3 tests/python/test_multi_gpu_check.py <flux8 binary> <source dir>

Needs mpirun (Open MPI); exit 77 without it. Checks:
  1. Every part runs and multi_gpu.json holds its numbers: `correct` (DP=2, DP=2 with the
     distributed optimizer and TP=2 against one rank, in the config's precision and FP8, within
     1e-6 (DP) and 1e-5 (TP) on the CPU; every FP8 job's checkpoints found the ranks' scales
     identical; a TP=2 checkpoint resumed at TP=2 bit for bit and at TP=1 within 1e-5),
     `scaling` (one rank and DP=2, with and without overlap_grad_reduce, the buckets reported),
     `big` (the first setting the plan fits, timed in BF16 and FP8 with 2 micro-batches a step,
     its tensor-parallel all-reduces profiled) and `failure` (rank 1 killed: the job ends within
     60 s naming it, the last checkpoint resumes).
  2. Speed and memory targets are recorded but not judged on the CPU (met: null); every judged
     check is met, the exit status is 0 and multi_gpu.txt ends with the count.
  3. Over 4 ranks: TP=2 x DP=2's checkpoints (saves timed and sized, resumed bit for bit, loaded
     at TP=2 x DP=1 and at TP=1); with --big-dp 2,1 both big layouts and the throughput of one
     against the other.
  4. A --deadline too close to begin a part lists the parts as not run (exit 3); an unknown part
     is refused by name.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

FLUX8, SRC = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
TOOL = os.path.join(SRC, "tools", "multi_gpu_check.py")
if not shutil.which("mpirun"):
    print("SKIP: mpirun not found (scripts/install_deps.sh installs Open MPI)")
    sys.exit(77)

# The jobs' ranks run under mpirun: with an AddressSanitizer build, Open MPI's allocations that it
# never frees would fail every rank at exit (the MPI tests set the same).
ENV = dict(os.environ, ASAN_OPTIONS=":".join(filter(None, [os.environ.get("ASAN_OPTIONS", ""), "detect_leaks=0"])))

SHRINK = ["hidden_size=24", "num_attention_heads=2", "axes_dim=[2,4,6]", "num_double_blocks=1",
          "num_single_blocks=1", "context_dim=8", "vec_dim=8", "text_seq_len=4", "image_size=8"]
failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what)
    failures += 0 if ok else 1


def main():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        args = [sys.executable, TOOL, "--flux8", FLUX8, "--backend", "cpu", "--out", out, "--steps", "6",
                "--bench-config", "configs/demo.yaml", "--bench-steps", "2", "--big-config", "configs/demo.yaml",
                "--big-steps", "2", "--big-global-batch", "2", "--bench-set", "backend=cpu", "--bench-set", "threads=1"]
        for s in SHRINK + ["demo_train_samples=64", "demo_val_samples=16"]:
            args += ["--demo-set", s]
        for s in SHRINK:
            args += ["--bench-set", s]
        p = subprocess.run(args, capture_output=True, text=True, cwd=tmp, env=ENV, timeout=900)
        print(p.stdout[-3000:], p.stderr[-2000:])
        check(p.returncode == 0, f"the tool exits 0 when every judged check is met (got {p.returncode})")
        with open(os.path.join(out, "multi_gpu.json")) as f:
            r = json.load(f)
        check((r["backend"], r["gpus"]) == ("cpu", 2) and set(r["parts"]) == {"correct", "scaling", "big", "failure"},
              "multi_gpu.json: the backend, 2 ranks and every part")

        c = r["parts"]["correct"]
        runs = c["runs"]
        check(set(runs) == {f"{n}_{p}" for n in ("dp2", "dp2_zero", "tp2") for p in ("default", "fp8")},
              "correct: DP=2, DP=2 distributed optimizer and TP=2, each in the config's precision and FP8")
        # TP=2 sums the split GEMMs in another order: ~1e-7 apart, which the bf16 moments' stochastic
        # rounding turns into a moment an ulp apart where a value lies at a rounding boundary.
        def bound(name):
            return 1e-5 if name.startswith("tp2") else 1e-6
        check(all(e["max_rel_loss_diff"] < bound(name) and e["val_rel_diff"] < bound(name)
                  for name, e in runs.items()),
              "correct: step and validation losses within 1e-6 (DP) and 1e-5 (TP) of one rank's on the CPU "
              f"({max(e['max_rel_loss_diff'] for e in runs.values()):.2g})")
        fp8 = [runs[f"{n}_fp8"]["fp8_checks"] for n in ("dp2", "dp2_zero", "tp2")]
        check(all(len(x) == 2 and all(k["agree"] for k in x) for x in fp8),
              "correct: each FP8 job's two checkpoints found the ranks' scales identical (TP=2 included)")
        ck = c["checkpoint"]
        check(ck["stopped_at"] == 3 and ck["tp2_resumed_losses_identical"] and ck["tp2_resumed_model_identical"],
              "correct: the TP=2 checkpoint of step 3 resumed at TP=2 bit for bit")
        check(ck["tp1_resumed_max_rel_loss_diff"] < 1e-5, "correct: resumed at TP=1 within 1e-5")

        sc = r["parts"]["scaling"]
        check(set(sc) == {"config bf16", "config delayed"} and
              all(e["ratio"] > 0 and e["gradient_buckets"] >= 1 and e["ms_2_no_overlap"] > 0 for e in sc.values()),
              "scaling: BF16 and FP8 at one rank and DP=2, without the overlap too, with the buckets reported")

        bp = r["parts"]["big"]
        big = bp["layouts"]
        e = big.get("TP=2 x DP=1", {})
        check(list(big) == ["TP=2 x DP=1"] and e.get("settings") == ["recompute_granularity=full"] and
              set(e.get("runs", {})) == {"bf16", "delayed"} and set(e["plan_step_gib"]) == {"bf16", "delayed"} and
              all(v > 0 for v in e["plan_step_gib"].values()),
              "big: TP=2 x DP=1 with the first setting the plan fits in BF16 and FP8, timed in both")
        runs_big = e.get("runs", {}).values()
        check(bp["micro_batches"] == 2 and all(x["tokens_per_s"] > 0 and x["model_tflops_per_gpu"] > 0 for x in runs_big),
              "big: 2 micro-batches a step (global batch 2), tokens/s and model TFLOP/s a GPU")
        check(all(x["collectives_ms_per_step"].get("tensor-parallel all_reduce", 0) > 0 for x in runs_big),
              "big: the profiled run times the tensor-parallel all-reduces")

        fl = r["parts"]["failure"]
        check(fl["seconds_to_end"] < 60 and fl["exit_status"] not in (None, 0) and fl["names_rank"] and fl["resumed"],
              f"failure: the job ended {fl['seconds_to_end']:.1f} s after rank 1 was killed, naming it; "
              f"{fl['last_checkpoint']} resumed")

        judged = [v for v in r["verdicts"] if v["met"] is not None]
        unjudged = [v for v in r["verdicts"] if v["met"] is None]
        check(all(v["met"] for v in judged) and len(judged) >= 14, f"{len(judged)} judged checks, all met")
        check(len(unjudged) >= 4 and all(v["part"] in ("scaling", "big") for v in unjudged),
              "speed and memory targets recorded, not judged on the CPU")
        with open(os.path.join(out, "multi_gpu.txt")) as f:
            text = f.read()
        check(text.rstrip().endswith(f"{len(judged)} of {len(judged)} checks met"), "multi_gpu.txt ends with the count")
        check(len(r["commands"]) >= 16 and any(cmd.startswith("mpirun -np 2") for cmd in r["commands"]),
              "the commands are recorded")

        four = subprocess.run(args + ["--parts", "correct,big", "--gpus", "4", "--steps", "4", "--big-dp", "2,1",
                                      "--big-precisions", "bf16", "--big-global-batch", "0"],
                              capture_output=True, text=True, cwd=tmp, env=ENV, timeout=900)
        with open(os.path.join(out, "multi_gpu.json")) as f:
            r4 = json.load(f)
        lay = r4["parts"]["big"]["layouts"]
        scaled = [v for v in r4["verdicts"] if "TP=2 x DP=2 throughput against TP=2 x DP=1" in v["check"]]
        check(four.returncode == 0 and list(lay) == ["TP=2 x DP=2", "TP=2 x DP=1"] and
              all(set(e["runs"]) == {"bf16"} for e in lay.values()) and len(scaled) == 1 and scaled[0]["met"] is None,
              "big at 4 ranks, --big-dp 2,1, BF16 only: both layouts and the DP=2 against DP=1 throughput")
        every = r4["parts"]["correct"].get("checkpoint_all_ranks", {})
        saves = every.get("saves", [])
        check(every.get("ranks") == 4 and every.get("resumed_identical") and
              every.get("max_rel_loss_diff_at_TP=2 x DP=1", 1) < 1e-5 and every.get("max_rel_loss_diff_at_TP=1", 1) < 1e-5
              and [x["step"] for x in saves] == [2, 4] and all(x["bytes"] > 0 and x["seconds"] >= 0 for x in saves),
              "correct at 4 ranks: TP=2 x DP=2's saves (time, size), resumed bit for bit, loaded at TP=2 x DP=1 and "
              "TP=1 within 1e-5")

        late = subprocess.run([sys.executable, TOOL, "--flux8", FLUX8, "--backend", "cpu", "--out", out,
                               "--parts", "correct,failure", "--deadline", "10"],
                              capture_output=True, text=True, cwd=tmp, env=ENV)
        with open(os.path.join(out, "multi_gpu.json")) as f:
            not_run = json.load(f).get("not_run")
        check(late.returncode == 3 and not_run == ["correct", "failure"] and "not run" in late.stdout,
              f"--deadline too close for a part: the parts listed as not run, exit 3 (got {late.returncode}, {not_run})")

        bad = subprocess.run([sys.executable, TOOL, "--flux8", FLUX8, "--backend", "cpu", "--out", out,
                              "--parts", "correct,speed"], capture_output=True, text=True, cwd=tmp, env=ENV)
        check(bad.returncode != 0 and "unknown part(s) ['speed']" in bad.stderr, "an unknown part is refused")
    print(f"{failures} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
