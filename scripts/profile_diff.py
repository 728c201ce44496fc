#!/usr/bin/env python3
"""What changed between two `flux8 bench --profile` outputs: per workload and op, base, new, new - base.

    python3 scripts/profile_diff.py ab_profile_base.txt ab_profile_new.txt [--min-ms 0.02]
    python3 scripts/profile_diff.py base.json new.json      # `flux8 bench --profile --json FILE`

Reads what `flux8 bench ... --profile` prints (a line per workload and precision with its step
time, then "op calls ms/step share" rows and the profiled step's total), as scripts/gpu_check.sh's
ab stage keeps it for the base and the new side, or the same runs from its --json file (a file
whose first non-blank character is "{"; the profiled total is the sum of the op rows, idle
included, as the printed total is). Prints, for each workload and precision both
files have: the step times and profiled totals of both sides, then every op whose time moved by
at least --min-ms ms, the largest change first (an op only one side ran counts as 0 on the other),
and, where both sides measured it (a GPU with an energy counter),
the step's energy in joules: a power-capped step is as fast as its energy allows.
The memory-bound rows are what an A/B reads; the GEMM and attention rows move with the GPU's
clock between the sides. Standard library only.
"""
import argparse
import json
import re
import sys

RUN = re.compile(r"^(?P<workload>W\d+) \(\S+\)\s+(?P<precision>\S.*?)\s{2,}(?P<step>\d+\.\d+)\s")
TOTAL = re.compile(r"\(profiled step: (?P<total>\d+\.\d+) ms")
OP = re.compile(r"^  (?P<op>\S.*?)\s+(?P<calls>\d+)\s+(?P<ms>\d+\.\d+)\s+\d+\.\d+%$")
ENERGY = re.compile(r"^  energy: (?P<joules>\d+\.\d+) J a step")
MIN_MS = 0.02  # the smallest change listed by default (ms per step)


def parse(lines):
    """{(workload, precision): {"step": ms, "profiled": ms or None, "joules": J a step or None,
    "ops": {op: ms per step}}}, in file order."""
    runs = {}
    current = None
    for line in lines:
        line = line.rstrip("\n")
        m = RUN.match(line)
        if m:
            current = {"step": float(m["step"]), "profiled": None, "joules": None, "ops": {}}
            runs[(m["workload"], m["precision"])] = current
            continue
        if current is None:
            continue
        m = ENERGY.match(line)
        if m:
            current["joules"] = float(m["joules"])
            continue
        m = TOTAL.search(line)
        if m:
            current["profiled"] = float(m["total"])
            continue
        m = OP.match(line)
        if m:
            current["ops"][m["op"]] = float(m["ms"])
    return runs


def parse_json(text):
    """parse()'s runs from `flux8 bench --profile --json`'s steps, labelled as the printed table labels them."""
    runs = {}
    for step in json.loads(text).get("steps", []):
        if "ops" not in step:  # a run without --profile
            continue
        p = step["precision"]
        precision = "BF16" if p == "bf16" else f"{p} {step['fp8_format']}"
        ops = {o["op"]: float(o["ms_per_step"]) for o in step["ops"]}
        energy = step.get("energy") or {}
        runs[(step["workload"], precision)] = {"step": float(step["median_step_ms"]),
                                               "profiled": sum(ops.values()),
                                               "joules": float(energy["joules_per_step"]) if energy.get("measured") else None,
                                               "ops": ops}
    return runs


def read(f):
    """The runs of an open file, printed output or --json."""
    text = f.read()
    return parse_json(text) if text.lstrip().startswith("{") else parse(text.splitlines(keepends=True))


def profiled(run):
    return "-" if run["profiled"] is None else f"{run['profiled']:.2f}"


def report(base, new, out, min_ms=MIN_MS):
    for key, b in base.items():
        n = new.get(key)
        if n is None:
            continue
        workload, precision = key
        energy = ""
        if b.get("joules") is not None and n.get("joules") is not None:
            energy = f", energy {b['joules']:.1f} -> {n['joules']:.1f} J a step"
        out.write(f"{workload} {precision}: step {b['step']:.2f} -> {n['step']:.2f} ms, "
                  f"profiled {profiled(b)} -> {profiled(n)} ms{energy}\n")
        rows = []
        for op in b["ops"] | n["ops"]:  # base's order, then the ops only new has
            before, after = b["ops"].get(op, 0.0), n["ops"].get(op, 0.0)
            if abs(after - before) >= min_ms:
                rows.append((op, before, after))
        rows.sort(key=lambda r: -abs(r[2] - r[1]))
        for op, before, after in rows:
            out.write(f"  {op:<58} {before:8.3f} {after:8.3f} {after - before:+8.3f}\n")
        if not rows:
            out.write(f"  (no op moved by {min_ms} ms or more)\n")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--min-ms", type=float, default=MIN_MS, help="smallest change listed (ms per step)")
    a = p.parse_args(argv[1:])
    runs = []
    for path in (a.base, a.new):
        with open(path, encoding="utf-8") as f:
            runs.append(read(f))
        if not runs[-1]:
            sys.stderr.write(f"profile_diff: no `flux8 bench --profile` output in {path}\n")
            return 1
    report(runs[0], runs[1], sys.stdout, a.min_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
