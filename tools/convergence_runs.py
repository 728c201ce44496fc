"""The runs of tools/convergence.py: each variant x seed as a `flux8 train` (the train tiers) or
`flux8 bench --data structured` (the bench tier) process with a folder and a log of its own,
several at once, a finished run reused; and what each run's metrics say (its curves, its final
loss, its skipped or non-finite steps).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

RUN_FILE = "convergence_run.json"  # in each run's folder: the command it was made with


class HarnessError(Exception):
    """A failure the user can act on; the message names the run, its log and what to do."""


@dataclasses.dataclass
class Variant:
    name: str
    sets: list  # "key=value" overrides that make this variant

    def value(self, key: str) -> str | None:
        for kv in reversed(self.sets):
            k, _, v = kv.partition("=")
            if k == key:
                return v
        return None


@dataclasses.dataclass
class Run:
    variant: Variant
    seed: int
    folder: str  # save_dir of a train run; the bench's JSON lives here too
    log: str
    command: list = dataclasses.field(default_factory=list)
    threads: int = 1
    result: dict | None = None
    # The settings the run resolves to beyond its command: the digest of flux8's resolved config
    # (its defaults included), so that a run made by a flux8 with other defaults is not reused.
    resolved: str = ""

    @property
    def name(self) -> str:
        return os.path.basename(self.folder)


@dataclasses.dataclass
class Plan:
    runner: str  # "train" or "bench"
    flux8: str
    config: str | None  # the YAML (train; bench: instead of --workload)
    workload: str | None  # bench without a config
    sets: list  # --set given for every run
    steps: int | None  # train_iters / bench --steps; None: the config's train_iters
    final_window: int  # bench: steps averaged for the final loss
    backend: str  # bench --backend
    out: str
    seed_data: dict = dataclasses.field(default_factory=dict)  # seed -> demo dataset --set overrides


def run_name(variant: Variant, seed: int) -> str:
    return f"{variant.name}_seed{seed}"


def train_command(plan: Plan, run: Run) -> list:
    cmd = [plan.flux8, "train", "-c", plan.config]
    # The harness's own settings first, so that --set and the variant can still change them;
    # target_eval_loss would stop runs at different steps, and the end-of-run sample grid costs
    # time that says nothing about the loss.
    sets = [f"seed={run.seed}", f"save_dir={run.folder}", "log_interval=1", "sample_prompts=",
            "target_eval_loss=0"]
    sets += plan.seed_data.get(run.seed, [])
    if plan.steps:
        sets.append(f"train_iters={plan.steps}")
    sets += plan.sets + run.variant.sets
    for kv in sets:
        cmd += ["--set", kv]
    return cmd


def bench_command(plan: Plan, run: Run) -> list:
    cmd = [plan.flux8, "bench"]
    cmd += ["-c", plan.config] if plan.config else ["--workload", plan.workload]
    fp8 = run.variant.value("fp8") or "none"
    recipe = run.variant.value("fp8_recipe") or "delayed"
    cmd += ["--data", "structured", "--warmup", "0", "--steps", str(plan.steps), "--backend", plan.backend,
            "--json", os.path.join(run.folder, "bench.json")]
    cmd += ["--precision", "bf16"] if fp8 in ("none", "null") else ["--precision", recipe, "--fp8-format", fp8]
    # (bench takes the recipe and format as options, every other key as --set)
    for kv in [f"seed={run.seed}"] + plan.sets + run.variant.sets:
        if kv.partition("=")[0] not in ("fp8", "fp8_recipe"):
            cmd += ["--set", kv]
    return cmd


def run_identity(run: Run) -> list:
    """What decides a run's result: its command less the binary's path and the threads, and the
    digest of the config it resolves to."""
    return identity(run.command) + ([f"resolved-config={run.resolved}"] if run.resolved else [])


def identity(command: list) -> list:
    """The part of a command that decides its result: not the binary's path, nor the threads."""
    out, skip = [], False
    for i, a in enumerate(command[1:]):
        if skip:
            skip = False
            continue
        if a == "--set" and i + 2 < len(command) and command[i + 2].startswith("threads="):
            skip = True
            continue
        out.append(a)
    return out


def describe_exit(rc: int) -> str:
    known = {78: "config error", 65: "data error", 79: "out of memory", 80: "non-finite losses or gradients",
             75: "stopped early", 2: "unexpected error"}
    if rc < 0:
        return f"killed by signal {-rc}"
    return f"exit status {rc}" + (f", {known[rc]}" if rc in known else "")


def tail(path: str, lines: int = 8) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"


# ---- reading a run's metrics ------------------------------------------------------------------

def finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def read_train_metrics(run: Run) -> dict | None:
    """The curves and health of a train run from its metrics.jsonl; None unless it finished
    (a validation record with when == "end")."""
    path = os.path.join(run.folder, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    train = {"step": [], "loss": []}
    evals = {"step": [], "val_loss": []}
    skipped, nonfinite, final = set(), 0, None
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise HarnessError(f"{path}:{line_no}: not a JSON record ({e}); delete {run.folder} to rerun it")
            kind = r.get("kind")
            if kind == "step":
                train["step"].append(r["step"])
                train["loss"].append(r["loss"] if finite(r.get("loss")) else None)
                nonfinite += not finite(r.get("loss"))
                if r.get("skipped"):
                    skipped.add(r["step"])
            elif kind == "run" and r.get("event") == "skipped_step":
                skipped.add(r["step"])
            elif kind == "eval":
                evals["step"].append(r["step"])
                evals["val_loss"].append(r["val_loss"] if finite(r.get("val_loss")) else None)
                if r.get("when") == "end":
                    final = r.get("val_loss")
    if final is None:
        return None
    return {"final_loss": final if finite(final) else None, "final_step": evals["step"][-1],
            "final_metric": "validation loss at the end of the run", "train": train, "eval": evals,
            "skipped_steps": sorted(skipped), "nonfinite_losses": nonfinite}


def read_bench_json(run: Run, steps: int, window: int) -> dict | None:
    """A bench run's per-step losses (fresh structured samples each step: every loss is on data
    the model has not seen) and its final loss, the mean of the last `window` steps."""
    path = os.path.join(run.folder, "bench.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)["steps"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise HarnessError(f"{path}: not a flux8 bench result ({e}); delete {run.folder} to rerun it")
    losses = [v if finite(v) else None for v in rec.get("losses", [])]
    if len(losses) < steps:
        return None
    last = [v for v in losses[-window:] if v is not None]
    return {"final_loss": sum(last) / len(last) if len(last) == min(window, steps) else None,
            "final_step": steps, "final_metric": f"mean training loss of the last {min(window, steps)} steps",
            "train": {"step": list(range(1, len(losses) + 1)), "loss": losses}, "eval": {"step": [], "val_loss": []},
            "skipped_steps": [], "nonfinite_losses": int(rec.get("non_finite_steps", 0))}


def read_result(plan: Plan, run: Run) -> dict | None:
    if plan.runner == "train":
        return read_train_metrics(run)
    return read_bench_json(run, plan.steps, plan.final_window)


# ---- running ----------------------------------------------------------------------------------

def reusable(plan: Plan, run: Run) -> bool:
    """True when the run's folder holds a finished run made with the same command; a folder made
    with another command is an error (its results would be mixed into this table)."""
    stamp = os.path.join(run.folder, RUN_FILE)
    if not os.path.exists(stamp):
        return False
    with open(stamp, encoding="utf-8") as f:
        made_with = json.load(f).get("identity")
    if made_with != run_identity(run):
        raise HarnessError(
            f"{run.folder} holds run {run.name} made with other arguments or other resolved settings (a flux8 with "
            f"other defaults):\n  then: {' '.join(made_with or [])}\n  now:  {' '.join(run_identity(run))}\n"
            f"use another --out, or delete {run.folder} to rerun it")
    run.result = read_result(plan, run)
    return run.result is not None


def start_fresh(run: Run) -> None:
    """An unfinished run's folder is emptied: the run starts again from step 0."""
    shutil.rmtree(run.folder, ignore_errors=True)
    os.makedirs(run.folder, exist_ok=True)
    with open(os.path.join(run.folder, RUN_FILE), "w", encoding="utf-8") as f:
        json.dump({"identity": run_identity(run), "command": run.command}, f, indent=1)


_live, _live_lock = set(), threading.Lock()  # the flux8 processes under way
_stopping = threading.Event()  # set by stop_runs: no new run starts


def stop_runs() -> None:
    """Passes a SIGTERM on to every run under way (flux8 stops after its current step); their
    folders stay unfinished, so the next call runs them again."""
    _stopping.set()
    with _live_lock:
        for proc in _live:
            proc.terminate()


def execute(plan: Plan, run: Run, gpu: str | None) -> float:
    """Runs one training (on GPU `gpu` when given: CUDA_VISIBLE_DEVICES); its output goes to
    run.log. Returns the wall seconds."""
    start_fresh(run)
    env = dict(os.environ, OMP_NUM_THREADS=str(run.threads))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    t0 = time.time()
    with open(run.log, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(run.command) + "\n")
        log.flush()
        proc = subprocess.Popen(run.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        with _live_lock:
            _live.add(proc)
        rc = proc.wait()
        with _live_lock:
            _live.discard(proc)
    seconds = time.time() - t0
    if rc != 0:
        raise HarnessError(f"run {run.name} failed ({describe_exit(rc)}): see {run.log}\n{tail(run.log)}")
    run.result = read_result(plan, run)
    if run.result is None:
        raise HarnessError(f"run {run.name} exited 0 but its metrics show no finished run: see {run.log} and "
                           f"{run.folder}")
    return seconds


def recorded_run_s(plan: Plan) -> dict:
    """Each run's wall seconds in OUT/timings.tsv (the longest where one is recorded twice)."""
    try:
        with open(os.path.join(plan.out, "timings.tsv"), encoding="utf-8") as f:
            rows = [line.split("\t") for line in f.read().splitlines()[1:]]
    except OSError:
        return {}
    out = {}
    for r in rows:
        if len(r) == 3:
            out[r[0]] = max(out.get(r[0], 0.0), float(r[2]))
    return out


def expected_run_s(plan: Plan, run: Run) -> float:
    """A run's expected wall seconds: its variant's longest recorded run, else the shortest recorded
    run of any variant (0 when none is recorded)."""
    times = recorded_run_s(plan)
    own = [s for name, s in times.items() if name.rsplit("_seed", 1)[0] == run.variant.name]
    return max(own) if own else min(times.values(), default=0.0)


_say_lock = threading.Lock()


def say_line(message: str) -> None:
    """One line to stderr, whole: print() writes the text and its newline separately, so lines of
    runs finishing at once could interleave."""
    with _say_lock:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def run_all(plan: Plan, runs: list, jobs: int, gpus: list, say=say_line,
            budget_s: float | None = None) -> None:
    """Runs what is not finished yet, `jobs` at a time, each on a GPU of `gpus` that no other run
    holds (all of them on the default device when gpus is empty). After a failure no new run
    starts; the ones under way finish, then every failure is raised together. With `budget_s`, a
    run starts only while it is expected (expected_run_s) to end within budget_s of now; the others
    keep result None."""
    t0 = time.time()
    todo = [r for r in runs if not reusable(plan, r)]
    for r in runs:
        if r not in todo:
            say(f"{r.name}: finished before (final loss {r.result['final_loss']}): reused")
    failures, lock, stop = [], threading.Lock(), threading.Event()
    timings = os.path.join(plan.out, "timings.tsv")
    if not os.path.exists(timings):
        with open(timings, "w", encoding="utf-8") as f:
            f.write("run\tthreads\tseconds\n")

    free = queue.Queue()
    for g in gpus:
        free.put(g)

    def one(i_run):
        i, run = i_run
        if stop.is_set() or _stopping.is_set():
            return
        if budget_s is not None and time.time() - t0 + expected_run_s(plan, run) > budget_s:
            say(f"[{i + 1}/{len(todo)}] {run.name}: not started (--time-budget {budget_s:g} s)")
            return
        gpu = free.get() if gpus else None
        where = "" if gpu is None else f", GPU {gpu}"
        say(f"[{i + 1}/{len(todo)}] {run.name}: started ({run.threads} threads{where}), log {run.log}")
        try:
            seconds = execute(plan, run, gpu)
        except HarnessError as e:
            stop.set()
            with lock:
                failures.append(str(e))
            return
        finally:
            if gpu is not None:
                free.put(gpu)
        with lock:
            with open(timings, "a", encoding="utf-8") as f:
                f.write(f"{run.name}\t{run.threads}\t{seconds:.0f}\n")
        say(f"[{i + 1}/{len(todo)}] {run.name}: done in {seconds:.0f} s, final loss {run.result['final_loss']}")

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, enumerate(todo)))
    if failures:
        raise HarnessError("\n".join(failures))
