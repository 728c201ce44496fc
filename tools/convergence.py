#!/usr/bin/env python3
"""FP8 convergence harness: trains a config in BF16 and in each FP8 recipe x format (and any
extra variant) for several seeds, and reports each variant's final loss as mean ± std over the
seeds and its difference to BF16 with a 95% confidence interval.

Tiers:
  demo  `flux8 train -c configs/demo.yaml` (or -c CONFIG: any training config); the final
        loss is the validation loss at the end of the run (metrics.jsonl, kind "eval").
  w1    `flux8 bench --workload W1 --data structured` (or -c CONFIG: that config's model and
        shape): flux_535m at W1's shape on structured synthetic data (fresh latents tied to the
        text by fixed random maps, plus noise), 5000 steps by default; every step's batch is
        new data, so the final loss is the mean training loss of the last --final-window steps.
        flux8 bench trains at its constant learning rate (1e-4); the seed key sets its initial
        weights, data and noise (where seeds ever give the same curve, the table says
        "(seeds identical)" and the spread over them is zero, not seed noise).

Each train run gets, before --set and the variant's keys (which may change them): seed, save_dir
(its folder), log_interval=1, no sample grid (sample_prompts empty) and target_eval_loss=0 (every
run ends at the same step). A config with demo_data generates its dataset from the seed: each
seed's is written once into OUT/data/seed<S> (train_data, valid_data and empty_prompt_file point
there). A SIGTERM or Ctrl-C stops the runs under way (flux8 stops after its current step).

Examples:
  python3 tools/convergence.py --tier demo --seeds 1234,7,42 --jobs 9 --out runs/conv_demo
  python3 tools/convergence.py --tier w1 --seeds 1,2,3 --formats hybrid --out runs/conv_w1
  python3 tools/convergence.py --tier demo --recipes delayed --formats hybrid \\
      --variant "delayed_hybrid_f32_grads: fp8=hybrid fp8_recipe=delayed grad_precision=f32"
  python3 tools/convergence.py --plot-from runs/conv_w1/results.json   # the PNG on another machine

Writes into --out: one folder per run (<variant>_seed<S>/: metrics.jsonl or bench.json) and its
log (<variant>_seed<S>.log), timings.tsv (each run's wall seconds), results.json (every run's
curves and command, and the summary), table.md (the markdown table, also printed),
curves.png and, for the w1 tier without -c, defaults.yaml (an empty config: what `flux8 config`
resolves the bench's settings from). A run whose folder shows it finished with the same
arguments and the same resolved settings (a digest of `flux8 config`, defaults included) is not
run again, so an interrupted or extended call (more seeds, more variants) redoes only what is
missing, and a flux8 whose defaults changed refuses the old runs instead of mixing them in.

Table columns: final loss mean ± sample std over the seeds; Δ vs BF16 = mean(variant) −
mean(BF16) with its 95% interval: "paired" (Student t over the per-seed differences, n − 1
degrees of freedom) when both have the same seeds, since the same seed means the same data
order, noise and initial weights, else "welch" (unequal variances); Δ % = Δ / mean(BF16), its
interval likewise; within ±TOL% = "within" when the whole interval lies inside, "outside" when
none of it does, "undecided" otherwise; NaN / skipped steps = steps the optimizer skipped for a
non-finite loss or gradient and non-finite logged losses, summed over the seeds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import convergence_report as report  # noqa: E402
import convergence_runs as runs_mod  # noqa: E402
from convergence_runs import HarnessError, Plan, Run, Variant  # noqa: E402

RECIPES = ["delayed", "tensorwise", "blockwise", "mxfp8"]
FORMATS = ["e4m3", "hybrid"]
SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tools/convergence.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tier", choices=["demo", "w1"], default="demo", help="what to train (above; default demo)")
    p.add_argument("-c", "--config", help="training config (demo tier default: configs/demo.yaml); with --tier w1 "
                   "the config whose model and shape flux8 bench trains instead of W1")
    p.add_argument("--flux8", default=None, help="the flux8 binary (default: build/flux8, else build-cpu/flux8)")
    p.add_argument("--out", default=None, help="output folder (default runs/convergence_<tier>)")
    p.add_argument("--seeds", default="1234,7,42", help="comma-separated values of the seed key (default 1234,7,42)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help=f"FP8 recipes, comma-separated, from {', '.join(RECIPES)}; 'none' for no recipe rows "
                   "(default all)")
    p.add_argument("--formats", default=",".join(FORMATS), help="FP8 formats: e4m3, hybrid (default both)")
    p.add_argument("--variant", action="append", default=[], metavar="'NAME: key=value ...'",
                   help="an extra variant: a name, a colon and its --set overrides separated by spaces, e.g. "
                   "'f32_moments: adam_moment_precision=f32' or 'delayed_hybrid_fp8_attention: fp8=hybrid "
                   "fp8_recipe=delayed fp8_dot_product_attention=true' (repeatable)")
    p.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                   help="a config override for every run, e.g. backend=cpu (repeatable; not seed: use --seeds)")
    p.add_argument("--steps", type=int, default=None,
                   help="train_iters of each run (demo tier default: the config's; w1 default 5000)")
    p.add_argument("--final-window", type=int, default=500,
                   help="w1 tier: steps whose mean training loss is the final loss (default 500)")
    p.add_argument("--backend", default="cuda", choices=["cuda", "cpu"], help="w1 tier: flux8 bench --backend")
    p.add_argument("--gpus", default="", help="comma-separated GPU indices: each run gets one of them to itself "
                   "(CUDA_VISIBLE_DEVICES), --jobs defaults to their count; e.g. 0,1,2,3,4,5,6,7")
    p.add_argument("--jobs", type=int, default=None, help="runs at once (default 1, or the number of --gpus)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of each run (threads key and OMP_NUM_THREADS; default max(1, cores / jobs))")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="start a run only while it can end within SECONDS of this call's start (its length taken from "
                   "OUT/timings.tsv: its variant's longest run, else the shortest run); what is left is reported and a later call with the same "
                   "arguments runs it (exit status 3)")
    p.add_argument("--reference", default="bf16", metavar="VARIANT",
                   help="the row every Δ is taken against (default bf16). Another row (a recipe x format such as "
                   "delayed_hybrid, or a --variant) compares candidates with it, paired seed by seed, and leaves "
                   "the bf16 runs out")
    p.add_argument("--tolerance", type=float, default=1.0, help="the ±%% band of the 'within' column (default 1)")
    p.add_argument("--smooth", type=int, default=None,
                   help="moving-average window of the plotted training loss (default steps / 50, at least 1)")
    p.add_argument("--no-plots", action="store_true",
                   help="write no PNG (where matplotlib is missing; plot later with --plot-from)")
    p.add_argument("--plot-from", metavar="RESULTS_JSON", help="only draw curves.png next to this results.json")
    p.add_argument("--title", default=None, help="the table's and plot's title (default: '<tier> tier')")
    return p.parse_args(argv)


def require_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
        import numpy  # noqa: F401
    except ImportError as e:
        raise HarnessError(f"{e.name} is missing: the curves cannot be plotted. Install it (scripts/install_deps.sh, "
                           f"or python3 -m pip install {e.name}), or pass --no-plots and plot later on another "
                           "machine with --plot-from OUT/results.json")


def parse_variant(text: str) -> Variant:
    name, colon, rest = text.partition(":")
    name = name.strip()
    sets = shlex.split(rest)
    if not colon or not name or not sets or any("=" not in kv for kv in sets):
        raise HarnessError(f"--variant '{text}': write it as 'NAME: key=value key=value ...'")
    if any(c in name for c in "/ \t") or name.startswith("."):
        raise HarnessError(f"--variant '{text}': the name '{name}' names folders: no '/' or spaces")
    return Variant(name, sets)


def variants_of(args) -> list:
    out = [Variant("bf16", [])] if args.reference == "bf16" else []
    recipes = [] if args.recipes == "none" else args.recipes.split(",")
    formats = args.formats.split(",")
    for r in recipes:
        if r not in RECIPES:
            raise HarnessError(f"--recipes: unknown recipe '{r}': choose from {', '.join(RECIPES)} or 'none'")
    for f in formats:
        if f not in FORMATS:
            raise HarnessError(f"--formats: unknown format '{f}': choose from {', '.join(FORMATS)}")
    out += [Variant(f"{r}_{f}", [f"fp8={f}", f"fp8_recipe={r}"]) for r in recipes for f in formats]
    out += [parse_variant(v) for v in args.variant]
    names = [v.name for v in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HarnessError(f"variant names used twice: {', '.join(dup)}")
    if args.reference not in names:
        raise HarnessError(f"--reference {args.reference}: no such row among {', '.join(names)}: name a recipe x "
                           "format that --recipes and --formats select, or a --variant")
    return out


def find_flux8(given: str | None) -> str:
    candidates = [given] if given else [os.path.join(SOURCE, "build", "flux8"), os.path.join(SOURCE, "build-cpu",
                                                                                          "flux8")]
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    raise HarnessError(f"no flux8 binary at {' or '.join(candidates)}: build it (README) or pass --flux8 PATH")


def resolved_config(flux8: str, config: str, sets: list) -> dict:
    """`flux8 config`'s resolved values (key: value  # source), as text."""
    cmd = [flux8, "config", "-c", config] + [a for kv in sets for a in ("--set", kv)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise HarnessError(f"{config}: `{' '.join(cmd)}` failed:\n{out.stdout}{out.stderr}")
    values = {}
    for line in out.stdout.splitlines():
        if line and not line.startswith("#") and ":" in line:
            key, _, rest = line.partition(":")
            values[key.strip()] = rest.split("  #")[0].strip().strip('"')
    return values


def prepare_demo_data(plan: Plan, seeds: list, cfg: dict) -> None:
    """A config with demo_data generates its dataset from the seed (into train_data's folder): each
    seed gets a folder of its own under OUT/data, written here once, before runs share it."""
    if cfg.get("demo_data") != "true":
        return
    for seed in seeds:
        folder = os.path.join(plan.out, "data", f"seed{seed}")
        sets = [f"train_data={folder}/{os.path.basename(cfg['train_data'])}"]
        if cfg.get("valid_data"):
            sets.append(f"valid_data={folder}/{os.path.basename(cfg['valid_data'])}")
        if cfg.get("empty_prompt_file"):
            sets.append(f"empty_prompt_file={folder}/{os.path.basename(cfg['empty_prompt_file'])}")
        plan.seed_data[seed] = sets
        if os.path.exists(os.path.join(folder, "manifest.json")):
            continue
        cmd = [plan.flux8, "data", "demo", "--out", folder, "-c", plan.config]
        cmd += [a for kv in plan.sets + [f"seed={seed}"] for a in ("--set", kv)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise HarnessError(f"writing the demo dataset of seed {seed} failed: `{' '.join(cmd)}`\n"
                               f"{out.stdout}{out.stderr}")


def make_plan(args, flux8: str) -> tuple:
    """The plan, the train_iters it runs and a description of what is trained."""
    for kv in args.sets:
        if "=" not in kv:
            raise HarnessError(f"--set '{kv}': write it as key=value")
        if kv.partition("=")[0] == "seed":
            raise HarnessError(f"--set {kv}: the harness sets the seed of each run; use --seeds instead")
    out = os.path.abspath(args.out or f"runs/convergence_{args.tier}")
    if args.tier == "demo":
        config = args.config or os.path.join(SOURCE, "configs", "demo.yaml")
        plan = Plan("train", flux8, config, None, args.sets, args.steps, 0, "", out)
        cfg = resolved_config(flux8, config, args.sets + ([f"train_iters={args.steps}"] if args.steps else []))
        steps = int(cfg["train_iters"])
        what = f"`flux8 train -c {os.path.relpath(config, SOURCE)}`, {steps} steps, backend {cfg.get('backend')}"
        return plan, steps, what, cfg
    steps = args.steps or 5000
    if args.final_window < 1:
        raise HarnessError("--final-window must be at least 1")
    plan = Plan("bench", flux8, args.config, None if args.config else "W1", args.sets, steps,
                min(args.final_window, steps), args.backend, out)
    what = (f"`flux8 bench {'-c ' + args.config if args.config else '--workload W1'} --data structured`, {steps} "
            f"steps, backend {args.backend}")
    return plan, steps, what, {}


def resolving_config(plan: Plan) -> str:
    """The config `flux8 config` resolves the runs' settings from: the runs' own, or for the
    bench's workload an empty one (flux8's defaults), written once into the output folder."""
    if plan.config:
        return plan.config
    config = os.path.join(plan.out, "defaults.yaml")
    os.makedirs(plan.out, exist_ok=True)
    with open(config, "w", encoding="utf-8") as f:
        f.write("# empty: flux8's defaults\n")
    return config


def resolved_digest(plan: Plan, config: str, variant: Variant) -> str:
    """The digest of the settings a variant's runs resolve to (`flux8 config` of `config`, with
    --set and the variant's keys): defaults included, so a run made by a flux8 whose defaults
    differ is not taken for this one."""
    try:
        values = resolved_config(plan.flux8, config, plan.sets + variant.sets)
    except HarnessError:
        return "unresolved"  # a key flux8 refuses: the run itself fails, naming it
    text = "\n".join(f"{k}={v}" for k, v in sorted(values.items()) if k not in ("save_dir", "seed", "threads"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_runs(plan: Plan, variants: list, seeds: list, threads: int) -> list:
    """Seed by seed, so that a call cut short by --time-budget leaves whole seeds: paired
    differences need every variant of a seed."""
    runs = []
    config = resolving_config(plan)
    resolved = {v.name: resolved_digest(plan, config, v) for v in variants}
    for seed in seeds:
        for v in variants:
            name = runs_mod.run_name(v, seed)
            run = Run(v, seed, os.path.join(plan.out, name), os.path.join(plan.out, name + ".log"), threads=threads)
            run.resolved = resolved[v.name]
            if plan.runner == "train":
                run.command = runs_mod.train_command(plan, run) + ["--set", f"threads={threads}"]
            else:
                run.command = runs_mod.bench_command(plan, run)
            runs.append(run)
    return runs


def parse_seeds(text: str) -> list:
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise HarnessError(f"--seeds '{text}': give integers separated by commas, e.g. 1234,7,42")
    if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise HarnessError(f"--seeds '{text}': each seed once, each >= 0")
    return seeds


def write_outputs(out: str, data: dict, plots: bool, smoothing: int) -> str:
    report.write_json(os.path.join(out, "results.json"), data)
    table = report.markdown(data["meta"], data["summary"])
    with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as f:
        f.write(table)
    if plots:
        import convergence_plot  # (numpy and matplotlib: only when plotting)
        convergence_plot.plot(os.path.join(out, "curves.png"), data, smoothing)
    return table


def plot_from(path: str, smoothing: int | None) -> None:
    require_plotting()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise HarnessError(f"--plot-from {path}: cannot read it ({e})")
    steps = max(len(r["train"]["step"]) for r in data["runs"])
    out = os.path.join(os.path.dirname(os.path.abspath(path)), "curves.png")
    import convergence_plot
    convergence_plot.plot(out, data, smoothing or max(1, steps // 50))
    print(f"wrote {out}", file=sys.stderr)


def main(argv) -> int:
    args = parse_args(argv)
    if args.plot_from:
        plot_from(args.plot_from, args.smooth)
        return 0
    if not args.no_plots:
        require_plotting()  # before hours of training, not after
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    args.jobs = args.jobs or max(1, len(gpus))
    if args.jobs < 1 or (args.threads is not None and args.threads < 1):
        raise HarnessError("--jobs and --threads must be at least 1")
    if gpus and args.jobs > len(gpus):
        raise HarnessError(f"--jobs {args.jobs} with {len(gpus)} --gpus: at most one run a GPU")
    seeds = parse_seeds(args.seeds)
    variants = variants_of(args)
    flux8 = find_flux8(args.flux8)
    plan, steps, what, cfg = make_plan(args, flux8)
    os.makedirs(plan.out, exist_ok=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
    if plan.runner == "train":
        prepare_demo_data(plan, seeds, cfg)
    runs = make_runs(plan, variants, seeds, threads)
    runs_mod.run_all(plan, runs, args.jobs, gpus, budget_s=args.time_budget)
    missing = [r.name for r in runs if r.result is None]
    if len(missing) == len(runs):
        raise HarnessError(f"no run fits --time-budget {args.time_budget:g} s (OUT/timings.tsv has how long runs "
                           "take): give more time")
    runs = [r for r in runs if r.result is not None]
    variants = [v for v in variants if any(r.variant.name == v.name for r in runs)]
    if not any(v.name == args.reference for v in variants):
        raise HarnessError(f"the {args.reference} reference has no finished run yet: call again with the same "
                           "arguments")
    summary = report.summarize(variants, runs, args.reference, args.tolerance)
    meta = {"title": args.title or f"{args.tier} tier", "tier": args.tier, "what": what, "steps": steps,
            "seeds": seeds, "reference": args.reference, "tolerance_pct": args.tolerance,
            "final_metric": runs[0].result["final_metric"], "command": ["tools/convergence.py"] + list(argv),
            "not_run": missing}
    data = report.results_json(meta, runs, summary)
    table = write_outputs(plan.out, data, not args.no_plots, args.smooth or max(1, steps // 50))
    print(table, end="")
    print(f"wrote {plan.out}/results.json, table.md" + ("" if args.no_plots else ", curves.png"), file=sys.stderr)
    for e in summary:
        if e["identical_seeds"]:
            print(f"warning: {e['variant']}: every seed gave the same training curve: the seed does not reach these "
                  "runs, so the ± and the intervals are not seed noise", file=sys.stderr)
    if missing:
        print(f"{len(missing)} runs not started within --time-budget ({', '.join(missing)}): the table holds the "
              "finished ones; call again with the same arguments to run the rest", file=sys.stderr)
        return 3
    return 0


def on_sigterm(signum, _frame):
    runs_mod.stop_runs()
    raise HarnessError(f"stopped by signal {signum}: the runs under way were stopped too; call again with the same "
                       "arguments to finish (finished runs are reused)")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        sys.exit(main(sys.argv[1:]))
    except HarnessError as e:
        print(f"tools/convergence.py: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # (Ctrl-C reaches the runs too: they share the terminal's process group)
        print("tools/convergence.py: interrupted; call again with the same arguments to finish", file=sys.stderr)
        sys.exit(130)
