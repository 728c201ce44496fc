#!/usr/bin/env python3
"""The checks of a machine with several GPUs, in one call (docs/DISTRIBUTED.md, "On several GPUs").

    tools/multi_gpu_check.py [--flux8 build/flux8] [--out DIR] [--parts correct,scaling,big,failure]

Each part runs `flux8` jobs under mpirun, one rank a GPU (NCCL); with fewer GPUs than ranks the
ranks share GPU 0 through the host-staged communicator (FLUX8_COMM=mpi), and with `--backend cpu`
they run on the CPU backend (the tool's own test: tests/python/test_multi_gpu_check.py).

  correct  the demo, --steps steps, one rank against DP=2, DP=2 with the distributed optimizer and
           TP=2, in the config's precision and in FP8 (delayed, hybrid): each step's loss against one
           rank's, the final validation loss, and in FP8 every checkpoint's check that the ranks'
           scales agree (metrics `fp8_ranks_agree`). A TP=2 job stopped half way and resumed at
           TP=2 (its losses and final model.safetensors tensors bit for bit the straight job's)
           and at TP=1 (its losses against the straight job's). From 4 GPUs on, TP=2 x DP=N/2 with
           the distributed optimizer over every GPU: its saves' time and size, its checkpoint
           resumed at that layout (bit for bit), at TP=2 x DP=1 and at TP=1.
  scaling  `flux8 bench` of each workload at one rank and at DP=N (N: --gpus), BF16 and FP8
           delayed: the throughput ratio N x t(1) / t(N), and at DP=N the step with
           overlap_grad_reduce off: the time the overlap hides.
  big      the big model (--big-config, flux_12b_dev at 1024 px, micro-batch 1) at TP=2 x DP=N/2
           with the distributed optimizer: the first of --big-settings that `flux8 info` plans to
           fit the GPU's memory, timed in BF16 and FP8 (delayed, hybrid) with the micro-batches of
           --big-global-batch accumulated; each GPU's peak against the plan, tokens/s, model
           TFLOP/s a GPU, and the collectives' time from a profiled run; with 4 GPUs or more also
           TP=2 x DP=1 on two of them (the scaling). --big-dp picks layouts for calls of their own.
  failure  a DP=2 demo job saving every 5 steps, rank 1 killed (SIGKILL) after step 12: how long
           the job takes to end, that it names the rank, and the last checkpoint resumed.

Writes DIR/multi_gpu.json (every number, the commands, the verdicts), DIR/multi_gpu.txt (the
summary printed) and DIR/logs/ (each job's output). Exit status: 0 when every judged check is met,
1 when one is not (or a job failed), 3 when --deadline left parts not run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

STOPPED = 75  # flux8 train's exit status when --stop-after stops it (src/train/signals.h)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_repo(path):
    """A config path as given, or else relative to the repository."""
    return path if os.path.isabs(path) or os.path.exists(path) else os.path.join(ROOT, path)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flux8", default="build/flux8")
    p.add_argument("--out", default=os.environ.get("OUT", "runs/multi_gpu"))
    p.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpus", type=int, default=0, help="GPUs to use (default: every GPU nvidia-smi lists)")
    p.add_argument("--parts", default="correct,scaling,big,failure")
    p.add_argument("--mpirun", default=os.environ.get("FLUX8_MPIRUN", "mpirun"))
    p.add_argument("--steps", type=int, default=20, help="steps of the demo jobs (correct)")
    p.add_argument("--demo-set", action="append", default=[], help="KEY=VALUE for every demo job")
    p.add_argument("--workloads", default="", help="scaling: W1,W2 (default W1,W2 at 2 GPUs, W1 beyond)")
    p.add_argument("--bench-config", default="", help="scaling: a config instead of the workloads")
    p.add_argument("--bench-set", action="append", default=[], help="KEY=VALUE for every bench job")
    p.add_argument("--bench-steps", type=int, default=10)
    p.add_argument("--big-config", default="configs/models/flux_12b_dev.yaml")
    p.add_argument("--big-steps", type=int, default=0, help="big: timed steps (default 20; 30 from 8 GPUs on)")
    p.add_argument("--big-global-batch", type=int, default=0,
                   help="big: samples a step over the data-parallel ranks at micro-batch 1, the rest gradient "
                        "accumulation (default: one micro-batch a rank; 32 from 8 GPUs on)")
    p.add_argument("--big-dp", default="",
                   help="big: the data-parallel sizes to run at TP=2 (default: N/2, and 1 from 4 GPUs on), so that "
                        "the layouts can go in calls of their own")
    p.add_argument("--big-precisions", default="bf16,delayed", help="big: the precisions (flux8 bench --precision)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="big: the GPU's dense BF16 peak for the model FLOP utilisation (H100/H200 SXM: 989)")
    p.add_argument("--big-settings", default="recompute_granularity=full;"
                   "recompute_granularity=full,optimizer_offload=moments",
                   help="';'-separated candidate settings (comma-separated KEY=VALUE), the first that fits is run")
    p.add_argument("--gpu-memory-gib", type=float, default=0.0,
                   help="big: the memory to plan for (default: the GPU's, less 1 GiB)")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="seconds from the start after which no job runs: a job is stopped there, the parts not "
                        "begun are listed as not run (exit status 3); 0: none")
    p.add_argument("--job-timeout", type=float, default=1800.0, help="seconds any one job may take")
    return p.parse_args(argv)


class Checker:
    def __init__(self, a):
        self.a = a
        self.flux8 = os.path.abspath(a.flux8)
        self.out = os.path.abspath(a.out)
        self.logs = os.path.join(self.out, "logs")
        self.runs = os.path.join(self.out, "runs")
        for d in (self.logs, self.runs):
            shutil.rmtree(d, ignore_errors=True)
            os.makedirs(d)
        self.gpus = a.gpus or (gpu_count() if a.backend == "cuda" else 2)
        self.result = {"backend": a.backend, "gpus": self.gpus, "device": device_name(a.backend),
                       "parts": {}, "verdicts": [], "commands": []}
        self.lines: list[str] = []
        self.t0 = time.monotonic()

    def seconds_left(self):
        """What a job may still take: --job-timeout, or less before --deadline."""
        if not self.a.deadline:
            return self.a.job_timeout
        return min(self.a.job_timeout, self.a.deadline - (time.monotonic() - self.t0))

    # ---- running jobs --------------------------------------------------------------------------

    def env(self, ranks):
        e = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                 OMPI_MCA_btl_vader_single_copy_mechanism="none", OMP_NUM_THREADS="1")
        if self.a.backend == "cuda" and ranks > self.gpus:
            e["FLUX8_COMM"] = "mpi"  # ranks sharing a GPU: NCCL needs one GPU a rank
        return e

    def command(self, ranks, args):
        cmd = [self.flux8] + args
        if ranks > 1:
            cmd = [self.a.mpirun, "-np", str(ranks), "--oversubscribe"] + cmd
        return cmd

    def run(self, name, ranks, args, ok=(0,)):
        cmd = self.command(ranks, args)
        self.result["commands"].append(" ".join(cmd))
        log = os.path.join(self.logs, name + ".log")
        t0 = time.monotonic()
        with open(log, "w") as f:
            job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env(ranks), start_new_session=True)
            try:
                rc = job.wait(timeout=max(1.0, self.seconds_left()))
            except subprocess.TimeoutExpired:
                stop(job)
                raise SystemExit(f"multi_gpu_check: {name} still ran after {time.monotonic() - t0:.0f} s "
                                 f"(--job-timeout, --deadline): stopped; see {log}\n" + tail(log))
        if rc not in ok:
            raise SystemExit(f"multi_gpu_check: {name} exited with {rc} (expected {ok}): see {log}\n" + tail(log))
        return rc, time.monotonic() - t0

    def verdict(self, part, what, value, limit, met, judged=True):
        """judged False: a speed or memory target, which only the GPU backend is held to (met: null)."""
        met = bool(met) if judged else None
        self.result["verdicts"].append({"part": part, "check": what, "value": value, "limit": limit, "met": met})
        self.say(f"  [{'not judged on the CPU' if met is None else 'met' if met else 'NOT MET'}] {what}: {value} "
                 f"(limit {limit})")

    @property
    def on_gpu(self):
        return self.a.backend == "cuda"

    def say(self, line):
        print(line, flush=True)
        self.lines.append(line)

    # ---- correct -------------------------------------------------------------------------------

    def demo_args(self, name, extra):
        sets = [f"backend={self.a.backend}", f"train_iters={self.a.steps}", "micro_batch_size=4",
                "global_batch_size=16", "eval_interval=0", "sample_prompts=", "log_interval=1",
                f"save_interval={max(1, self.a.steps // 2)}", f"save_dir={os.path.join(self.runs, name)}"]
        if self.a.backend == "cpu":
            sets.append("threads=1")
        sets += self.a.demo_set + extra
        return ["train", "-c", in_repo("configs/demo.yaml")] + [x for s in sets for x in ("--set", s)]

    def correct(self):
        self.say("== correct: the demo at one rank against DP=2, DP=2 with the distributed optimizer, TP=2")
        layouts = [("dp2", 2, []), ("dp2_zero", 2, ["use_distributed_optimizer=true"]),
                   ("tp2", 2, ["tensor_model_parallel_size=2"])]
        part = {"steps": self.a.steps, "runs": {}}
        for prec, psets in (("default", []), ("fp8", ["fp8=hybrid", "fp8_recipe=delayed"])):
            self.run(f"one_{prec}", 1, self.demo_args(f"one_{prec}", psets))
            one = read_metrics(os.path.join(self.runs, f"one_{prec}"))
            for name, ranks, sets in layouts:
                run = f"{name}_{prec}"
                self.run(run, ranks, self.demo_args(run, psets + sets))
                m = read_metrics(os.path.join(self.runs, run))
                rel = max_rel(m["losses"], one["losses"])
                entry = {"ranks": ranks, "last_loss": m["losses"][-1], "max_rel_loss_diff": rel,
                         "val_loss": m["val_loss"], "val_rel_diff": rel_diff(m["val_loss"], one["val_loss"])}
                if prec == "fp8":
                    entry["fp8_checks"] = m["fp8_checks"]
                    agree = len(m["fp8_checks"]) > 0 and all(c["agree"] for c in m["fp8_checks"])
                    self.verdict("correct", f"{run}: FP8 scales identical on every rank at each checkpoint",
                                 f"{sum(c['agree'] for c in m['fp8_checks'])} of {len(m['fp8_checks'])} saves", "all",
                                 agree)
                part["runs"][run] = entry
                self.verdict("correct", f"{run}: step losses against one rank (largest relative difference)",
                             f"{rel:.3g}", 1e-2, len(m["losses"]) == len(one["losses"]) and rel <= 1e-2)
        # A TP=2 job stopped half way, resumed at TP=2 and at TP=1.
        half = max(1, self.a.steps // 2)
        tp = ["tensor_model_parallel_size=2"]
        straight, same_losses, same_model, rel = self.stop_and_resume("tp2_default", "tp2", 2, tp, half,
                                                                      [("at_tp1", 1, [])])
        final = f"step-{self.a.steps:07d}/model.safetensors"
        tp1_rel = rel["at_tp1"]
        part["checkpoint"] = {"stopped_at": half, "tp2_resumed_losses_identical": same_losses,
                              "tp2_resumed_model_identical": same_model, "tp1_resumed_max_rel_loss_diff": tp1_rel}
        self.verdict("correct", f"TP=2 checkpoint of step {half} resumed at TP=2: losses and {final} bit for bit",
                     f"losses {'identical' if same_losses else 'differ'}, model "
                     f"{'identical' if same_model else 'differs'}", "identical", same_losses and same_model)
        self.verdict("correct", f"the same checkpoint resumed at TP=1: steps {half + 1}-{self.a.steps} against TP=2's",
                     f"{tp1_rel:.3g}", 1e-2, tp1_rel <= 1e-2)
        part["saves"] = {"tp2": straight["saves"]}
        if self.gpus >= 4:
            part["checkpoint_all_ranks"] = self.checkpoint_at_every_rank(half)
        self.result["parts"]["correct"] = part

    def stop_and_resume(self, straight, key, ranks, sets, half, elsewhere):
        """`key`_stop (`ranks`, `sets`) stopped after step `half`; copies of it resumed at its own
        layout (`key`_resumed) and at each of `elsewhere` ((name, ranks, sets): `key`_name). Returns
        the straight run's metrics, whether the own-layout resume repeated its losses and final
        model tensors, and each other resume's largest relative loss difference past `half`
        (infinite where the step counts differ)."""
        stop = f"{key}_stop"
        self.run(stop, ranks, self.demo_args(stop, sets) + ["--stop-after", str(half)], ok=(STOPPED,))
        resumes = [(f"{key}_resumed", ranks, sets)] + [(f"{key}_{name}", r, s) for name, r, s in elsewhere]
        for run, r, s in resumes:
            shutil.copytree(os.path.join(self.runs, stop), os.path.join(self.runs, run))
            self.run(run, r, self.demo_args(run, s) + ["--resume"])
        base = read_metrics(os.path.join(self.runs, straight))
        own = resumes[0][0]
        final = f"step-{self.a.steps:07d}/model.safetensors"
        same_model = tensors_bytes(os.path.join(self.runs, straight, final)) == tensors_bytes(
            os.path.join(self.runs, own, final))
        rel = {}
        for (name, _, _), (run, _, _) in zip(elsewhere, resumes[1:]):
            other = read_metrics(os.path.join(self.runs, run))["losses"]
            rel[name] = max_rel(other[half:], base["losses"][half:]) if len(other) == len(base["losses"]) \
                else float("inf")
        return base, read_metrics(os.path.join(self.runs, own))["losses"] == base["losses"], same_model, rel

    def checkpoint_at_every_rank(self, half):
        """TP=2 x DP=N/2 with the distributed optimizer on every GPU: its saves (time, size), its
        checkpoint of step `half` resumed at that layout (bit for bit), at TP=2 x DP=1 and at TP=1."""
        n = self.gpus - self.gpus % 2
        dp = n // 2
        key = f"tp2_dp{dp}"
        sets = ["tensor_model_parallel_size=2", "use_distributed_optimizer=true"]
        self.say(f"== correct: the checkpoints of TP=2 x DP={dp} ({n} ranks)")
        self.run(key, n, self.demo_args(key, sets))
        straight, same_losses, same_model, rel = self.stop_and_resume(
            key, key, n, sets, half, [("at_tp2", 2, sets), ("at_tp1", 1, [])])
        same = same_losses and same_model
        out = {"ranks": n, "saves": straight["saves"], "resumed_identical": same}
        self.verdict("correct", f"TP=2 x DP={dp}: its checkpoint of step {half} resumed at that layout, bit for bit",
                     "identical" if same else "differs", "identical", same)
        for layout, name in (("TP=2 x DP=1", "at_tp2"), ("TP=1", "at_tp1")):
            out[f"max_rel_loss_diff_at_{layout}"] = rel[name]
            self.verdict("correct", f"TP=2 x DP={dp}'s checkpoint loaded at {layout}: steps {half + 1}-{self.a.steps}",
                         f"{rel[name]:.3g}", 1e-2, rel[name] <= 1e-2)
        return out

    # ---- scaling -------------------------------------------------------------------------------

    def bench(self, name, ranks, what, sets, precisions, steps, profile=False, micro_batches=1):
        path = os.path.join(self.runs, name + ".json")
        args = ["bench"] + what + ["--backend", self.a.backend, "--precision", precisions, "--steps", str(steps),
                                   "--warmup", "1" if profile else "3", "--micro-batches", str(micro_batches),
                                   "--json", path]
        if profile:
            args.append("--profile")
        for s in self.a.bench_set + sets:
            args += ["--set", s]
        self.run(name, ranks, args)
        with open(path) as f:
            return json.load(f)["steps"]

    def scaling(self):
        n = self.gpus
        if n < 2:
            self.say("== scaling: needs 2 GPUs or more (--gpus)")
            return
        if self.a.bench_config:
            targets = [("config", ["-c", in_repo(self.a.bench_config)], 0.95 * n if n == 2 else 0.925 * n)]
        else:
            names = self.a.workloads.split(",") if self.a.workloads else (["W1", "W2"] if n == 2 else ["W1"])
            limits = {"W1": 0.95 * n if n == 2 else 0.925 * n, "W2": 0.925 * n}
            targets = [(w, ["--workload", w], limits.get(w, 0.9 * n)) for w in names]
        self.say(f"== scaling: one rank against DP={n}, one rank a GPU")
        part = {}
        for label, what, limit in targets:
            one = self.bench(f"scaling_{label}_1", 1, what, [], "bf16,delayed", self.a.bench_steps)
            many = self.bench(f"scaling_{label}_{n}", n, what, [], "bf16,delayed", self.a.bench_steps)
            serial = self.bench(f"scaling_{label}_{n}_no_overlap", n, what, ["overlap_grad_reduce=false"],
                                "bf16,delayed", self.a.bench_steps)
            for a, b, c in zip(one, many, serial):
                ratio = n * a["median_step_ms"] / b["median_step_ms"]
                part[f"{label} {a['precision']}"] = {
                    "ms_1": a["median_step_ms"], f"ms_{n}": b["median_step_ms"], "ratio": ratio,
                    f"ms_{n}_no_overlap": c["median_step_ms"],
                    "hidden_by_overlap_ms": c["median_step_ms"] - b["median_step_ms"],
                    "gradient_buckets": b.get("gradient_buckets"),
                    "buckets_started_in_backward": b.get("buckets_started_in_backward"),
                    "peak_gib_1": a["peak_allocated_gib"], f"peak_gib_{n}": b["peak_allocated_gib"]}
                self.say(f"  {label} {a['precision']}: {a['median_step_ms']:.2f} ms at 1 rank, "
                         f"{b['median_step_ms']:.2f} ms at DP={n} ({c['median_step_ms']:.2f} ms without the overlap; "
                         f"{b.get('buckets_started_in_backward')} of {b.get('gradient_buckets')} buckets started "
                         "in the backward)")
                self.verdict("scaling", f"{label} {a['precision']} at DP={n}: throughput against one GPU",
                             f"{ratio:.2f}x", f"{limit:.2f}x", ratio >= limit, self.on_gpu)
        self.result["parts"]["scaling"] = part

    # ---- big model -----------------------------------------------------------------------------

    def big(self):
        n = self.gpus
        if n < 2:
            self.say("== big: needs 2 GPUs or more (--gpus)")
            return
        dps = [int(d) for d in self.a.big_dp.split(",")] if self.a.big_dp else [n // 2] + ([1] if n >= 4 else [])
        if any(d < 1 or 2 * d > n for d in dps):
            raise SystemExit(f"multi_gpu_check: --big-dp {self.a.big_dp}: TP=2 x DP needs 2 x DP <= {n} GPUs")
        layouts = [(2 * d, d) for d in dps]
        steps = self.a.big_steps or (30 if n >= 8 else 20)
        global_batch = self.a.big_global_batch or (32 if n >= 8 else n // 2)
        # Every layout accumulates as many micro-batches a rank as the largest needs for the global
        # batch, so that their throughputs compare like for like.
        micro = max(1, global_batch // (n // 2))
        self.say(f"== big: {self.a.big_config} at TP=2, distributed optimizer, {micro} micro-batch(es) of 1 a "
                 f"rank and step, {steps} steps")
        # (Less 1 GiB for what the plan leaves out: the CUDA context, cuBLASLt's and NCCL's buffers.)
        gib = self.a.gpu_memory_gib or gpu_memory_gib(self.a.backend) - 1.0
        part = {"config": self.a.big_config, "gpu_memory_gib": gib, "steps": steps, "micro_batches": micro,
                "layouts": {}}
        for ranks, dp in layouts:
            chosen = None
            for cand in [c for c in self.a.big_settings.split(";") if c.strip()]:
                sets = [s for s in cand.split(",") if s]
                plan = self.plan(sets, dp, gib)
                if plan["fits"]:
                    chosen = (sets, plan)
                    break
            key = f"TP=2 x DP={dp}"
            if chosen is None:
                part["layouts"][key] = {"fits": False}
                self.verdict("big", f"{key}: a setting that `flux8 info` plans to fit {gib:.1f} GiB", "none of "
                             f"{self.a.big_settings}", "one", False)
                continue
            sets, plan = chosen
            what = ["-c", in_repo(self.a.big_config)]
            sets = ["tensor_model_parallel_size=2", "use_distributed_optimizer=true", "micro_batch_size=1"] + sets
            runs = self.bench(f"big_tp2_dp{dp}", ranks, what, sets, self.a.big_precisions, steps, micro_batches=micro)
            # The tensor-parallel collectives' share of a step: a profiled run of a few steps.
            profiled = self.bench(f"big_tp2_dp{dp}_profile", ranks, what, sets, self.a.big_precisions, 3, profile=True,
                                  micro_batches=micro)
            entry = {"settings": sets[3:], "plan_step_gib": plan["step_gib"], "runs": {}}
            for r, prof in zip(runs, profiled):
                planned = plan["step_gib"][r["precision"]]
                tokens = (r["txt_tokens"] + r["img_tokens"]) * r["batch"] * micro * dp
                step_s = r["median_step_ms"] / 1e3
                tflops = r["model_tflop_per_step"] * dp / step_s / ranks  # the job's model FLOPs a GPU
                collectives = {o["op"]: o["ms_per_step"] for o in prof.get("ops", [])
                               if o["op"].startswith(("tensor-parallel ", "data-parallel "))}
                entry["runs"][r["precision"]] = {
                    "median_step_ms": r["median_step_ms"], "tokens_per_s": tokens / step_s,
                    "model_tflops_per_gpu": tflops, "mfu": tflops / self.a.peak_tflops,
                    "peak_allocated_gib": r["peak_allocated_gib"],
                    "peak_against_plan": r["peak_allocated_gib"] / planned,
                    "profiled_step_ms": prof["median_step_ms"], "collectives_ms_per_step": collectives,
                    "losses": r.get("losses")}
                self.say(f"  {key} {r['precision']} ({', '.join(sets[3:])}): {r['median_step_ms']:.1f} ms a step, "
                         f"{tokens / step_s:.0f} tokens/s, {tflops:.1f} model TFLOP/s a GPU "
                         f"(MFU {tflops / self.a.peak_tflops:.1%}), {r['peak_allocated_gib']:.2f} GiB peak a GPU "
                         f"against a plan of {planned:.2f} GiB; collectives (profiled, ms a step): "
                         + (", ".join(f"{k} {v:.1f}" for k, v in collectives.items()) or "none"))
                self.verdict("big", f"{key} {r['precision']}: each GPU's peak within 5% of the plan",
                             f"{r['peak_allocated_gib'] / planned:.3f} of it", "0.95-1.05",
                             abs(r["peak_allocated_gib"] / planned - 1) <= 0.05, self.on_gpu)
            ms = {p: e["median_step_ms"] for p, e in entry["runs"].items()}
            if "bf16" in ms and "delayed" in ms:
                self.verdict("big", f"{key}: the FP8 step against BF16's", f"{ms['delayed'] / ms['bf16']:.3f}",
                             0.7, ms["delayed"] / ms["bf16"] <= 0.7, self.on_gpu)
            part["layouts"][key] = entry
        two = part["layouts"].get("TP=2 x DP=1", {}).get("runs", {})
        for d in (d for d in dps if d > 1):
            many = part["layouts"].get(f"TP=2 x DP={d}", {}).get("runs", {})
            for p in (p for p in many if p in two):
                ratio = many[p]["tokens_per_s"] / two[p]["tokens_per_s"]
                self.verdict("big", f"{p}: TP=2 x DP={d} throughput against TP=2 x DP=1", f"{ratio:.2f}x",
                             f"{0.925 * d:.2f}x", ratio >= 0.925 * d, self.on_gpu)
        self.result["parts"]["big"] = part

    def plan(self, sets, dp, gib):
        """`flux8 info`'s plan of one GPU at micro-batch 1, BF16 and FP8: whether both fit `gib`."""
        granularity = next((s.split("=", 1)[1] for s in sets if s.startswith("recompute_granularity=")), "none")
        fits, step_gib = True, {}
        for precision, fp8 in (("bf16", []), ("delayed", ["fp8=hybrid", "fp8_recipe=delayed"])):
            args = ["info", "-c", in_repo(self.a.big_config), "--batch", "1", "--tp", "2", "--dp", str(dp),
                    "--distributed-optimizer", "--gpu-memory", f"{gib:.2f}", "--json"]
            for s in self.a.bench_set + fp8 + sets:
                args += ["--set", s]
            p = subprocess.run([self.flux8] + args, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"multi_gpu_check: flux8 {' '.join(args)} failed:\n{p.stderr}")
            r = json.loads(p.stdout)["memory_plan"]["recompute"][granularity]
            fits = fits and r["fits"]
            step_gib[precision] = r["step_total_bytes"] / 2**30
        return {"fits": fits, "step_gib": step_gib}

    # ---- failure -------------------------------------------------------------------------------

    def failure(self):
        self.say("== failure: rank 1 of a DP=2 job killed after step 12")
        run = os.path.join(self.runs, "killed")
        args = self.demo_args("killed", ["train_iters=1000000", "save_interval=5"])
        cmd = self.command(2, args)
        self.result["commands"].append(" ".join(cmd))
        log = os.path.join(self.logs, "killed.log")
        with open(log, "w") as f:
            job = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env(2), start_new_session=True)
        until = time.monotonic() + min(600.0, self.seconds_left())
        while last_step(run) < 12:
            if job.poll() is not None or time.monotonic() > until:
                stop(job)
                raise SystemExit("multi_gpu_check: the job to kill did not reach step 12:\n" + tail(log))
            time.sleep(0.2)
        victim = rank_pid(1, run)
        if victim is None:
            stop(job)
            raise SystemExit("multi_gpu_check: rank 1's process was not found")
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        try:
            rc = job.wait(timeout=120)
        except subprocess.TimeoutExpired:
            stop(job)
            rc = None
        seconds = time.monotonic() - killed_at
        text = open(log, errors="replace").read()
        named = "rank 1" in text
        saved = sorted(d for d in os.listdir(run) if d.startswith("step-"))
        self.run("killed_resume", 2, args + ["--resume", "--stop-after", "1"], ok=(STOPPED,))
        resumed = "resumed from" in open(os.path.join(self.logs, "killed_resume.log"), errors="replace").read()
        self.result["parts"]["failure"] = {"seconds_to_end": seconds, "exit_status": rc, "names_rank": named,
                                           "last_checkpoint": saved[-1] if saved else None, "resumed": resumed}
        self.verdict("failure", "the job ends after rank 1 is killed", f"{seconds:.1f} s, exit {rc}", "60 s, non-zero",
                     rc not in (None, 0) and seconds <= 60)
        self.verdict("failure", "its output names the rank", "yes" if named else "no", "yes", named)
        self.verdict("failure", f"the last checkpoint ({saved[-1] if saved else 'none'}) verified and resumed",
                     "yes" if resumed else "no", "yes", bool(saved) and resumed)

    def finish(self):
        with open(os.path.join(self.out, "multi_gpu.json"), "w") as f:
            json.dump(self.result, f, indent=1)
        judged = [v for v in self.result["verdicts"] if v["met"] is not None]
        self.say(f"{sum(v['met'] for v in judged)} of {len(judged)} checks met")
        with open(os.path.join(self.out, "multi_gpu.txt"), "w") as f:
            f.write("\n".join(self.lines) + "\n")


# ---- helpers -----------------------------------------------------------------------------------

def stop(job):
    """Ends a job started as a process group of its own: the launcher and every rank."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait()


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def device_name(backend):
    if backend == "cpu":
        return "cpu"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout.splitlines()
        return f"{len(out)} x {out[0]}" if out else "no GPU"
    except (OSError, subprocess.CalledProcessError):
        return "no GPU"


def gpu_memory_gib(backend):
    if backend == "cpu":
        return 64.0
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return float(out[0]) / 1024.0  # MiB


def read_metrics(run):
    losses, val, fp8, saves = [], None, [], []
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "step" and "loss" in r:
                losses.append(r["loss"])
            if "val_loss" in r:
                val = r["val_loss"]
            if r.get("event") in ("fp8_ranks_agree", "fp8_ranks_differ"):
                fp8.append({"step": r["step"], "agree": r["event"] == "fp8_ranks_agree",
                            "differing_ranks": r.get("differing_ranks", [])})
            if r.get("event") == "checkpoint":  # a save written in line: its bytes and seconds
                saves.append({"step": r["step"], "bytes": r.get("bytes"), "seconds": r.get("seconds")})
    return {"losses": losses, "val_loss": val, "fp8_checks": fp8, "saves": saves}


def last_step(run):
    try:
        with open(os.path.join(run, "metrics.jsonl")) as f:
            steps = [json.loads(line).get("step", 0) for line in f if line.strip().endswith("}")]
        return max(steps, default=0)
    except (OSError, ValueError):
        return 0


def rank_pid(rank, marker):
    """The process of `rank` (Open MPI's OMPI_COMM_WORLD_RANK) whose command line holds `marker`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if marker in cmdline and "mpirun" not in cmdline.split(" ")[0] and \
                f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(pid)
    return None


def max_rel(a, b):
    if not a or len(a) != len(b):
        return float("inf")
    return max(rel_diff(x, y) for x, y in zip(a, b))


def rel_diff(a, b):
    if a is None or b is None:
        return float("inf")
    return abs(a - b) / max(abs(b), 1e-30)


def tensors_bytes(path):
    """A safetensors file's tensors — their header entries and data — without its metadata (which
    holds the run's resolved config, save_dir included)."""
    with open(path, "rb") as f:
        blob = f.read()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    return json.dumps(header, sort_keys=True).encode() + blob[8 + n:]


def tail(path, n=20):
    try:
        return "".join(open(path, errors="replace").readlines()[-n:])
    except OSError:
        return ""


def main(argv):
    a = parse_args(argv)
    c = Checker(a)
    parts = [p for p in a.parts.split(",") if p]
    unknown = set(parts) - {"correct", "scaling", "big", "failure"}
    if unknown:
        raise SystemExit(f"multi_gpu_check: unknown part(s) {sorted(unknown)}: correct, scaling, big, failure")
    if a.backend == "cuda" and c.gpus == 0:
        raise SystemExit("multi_gpu_check: nvidia-smi lists no GPU (use --backend cpu on a machine without one)")
    c.say(f"multi_gpu_check: {c.result['device']}, {c.gpus} GPUs used, parts {', '.join(parts)}")
    c.result["not_run"] = []
    try:
        for p in parts:
            if a.deadline and c.seconds_left() < 30:
                c.result["not_run"].append(p)
                c.say(f"== {p}: not run, {max(0.0, c.seconds_left()):.0f} s left before --deadline")
                continue
            getattr(c, p)()
    finally:
        c.finish()
    if not all(v["met"] is not False for v in c.result["verdicts"]):
        return 1
    return 3 if c.result["not_run"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
