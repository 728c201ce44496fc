#!/usr/bin/env python3
"""One line per kernel launch from Nsight Compute's text report, then one per kernel.

    python3 scripts/ncu_summary.py ncu_report.txt [more.txt ...]

Reads what `ncu --section SpeedOfLight --section LaunchStats [--section Occupancy
--section WarpStateStats --section MemoryWorkloadAnalysis] <program>` prints (the report of each
launch: a header line naming the kernel with its grid and block, then "Section:" tables of
metric name, unit and value), as scripts/gpu_check.sh's ncu stage writes it. Prints, per launch:
duration (µs), DRAM, SM and L1/TEX throughput (% of peak), registers per thread, achieved
occupancy (%), local-memory spill requests, grid x block; then per kernel (the name with its
template arguments): launches, total µs, and the duration-weighted DRAM and SM throughput.
A metric a section did not report shows as '-'. Standard library only.
"""
import re
import sys

HEADER = re.compile(
    r"^  (?P<name>\S.*?) \((?P<grid>\d+, \d+, \d+)\)x\((?P<block>\d+, \d+, \d+)\), Context \d+, Stream \d+")
FIELDS = {  # metric name in the report -> column
    "Duration": "us",
    "DRAM Throughput": "dram",
    "Compute (SM) Throughput": "sm",
    "L1/TEX Cache Throughput": "l1",
    "Registers Per Thread": "regs",
    "Achieved Occupancy": "occ",
    "Local Memory Spilling Requests": "spills",
}
UNIT_SCALE = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def short_name(signature):
    """The kernel's name with its template arguments, without the parameter list."""
    s = signature.removeprefix("void ")
    s = s.replace("(anonymous namespace)::", "").replace("unnamed>::", "")
    depth, end = 0, len(s)
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            end = i
            break
    return s[:end].replace("__nv_bfloat16", "bf16").replace("flux8::", "")


def shown(name):
    """A name as printed: cut at 90 characters (totals group by the whole name)."""
    return name if len(name) <= 90 else name[:87] + "..."


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse(lines):
    """The launches in report order: dicts of name, grid, block and the FIELDS found."""
    launches = []
    for line in lines:
        m = HEADER.match(line.rstrip("\n"))
        if m:
            launches.append({"name": short_name(m["name"]), "grid": m["grid"].replace(", ", "x"),
                             "block": m["block"].replace(", ", "x")})
            continue
        if not launches or not line.startswith("    "):
            continue
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) < 2 or parts[0] not in FIELDS:
            continue
        value = number(parts[-1])
        if value is None:
            continue
        unit = parts[1] if len(parts) == 3 else ""
        key = FIELDS[parts[0]]
        if key == "us":
            value *= UNIT_SCALE.get(unit, 1.0)
        launches[-1].setdefault(key, value)  # a metric repeated in a later section keeps its first value
    return launches


def fmt(v, width, prec):
    return "-".rjust(width) if v is None else f"{v:{width}.{prec}f}"


def report(launches, out=sys.stdout):
    out.write(f"{'µs':>9} {'DRAM%':>6} {'SM%':>6} {'L1%':>6} {'regs':>4} {'occ%':>5} {'spills':>9}  "
              f"{'grid x block':<22} kernel\n")
    for k in launches:
        out.write(f"{fmt(k.get('us'), 9, 2)} {fmt(k.get('dram'), 6, 1)} {fmt(k.get('sm'), 6, 1)} "
                  f"{fmt(k.get('l1'), 6, 1)} {fmt(k.get('regs'), 4, 0)} {fmt(k.get('occ'), 5, 1)} "
                  f"{fmt(k.get('spills'), 9, 0)}  {k['grid'] + ' x ' + k['block']:<22} {shown(k['name'])}\n")
    totals = {}
    for k in launches:
        t = totals.setdefault(k["name"], {"n": 0, "us": 0.0, "dram_us": 0.0, "sm_us": 0.0})
        us = k.get("us") or 0.0
        t["n"] += 1
        t["us"] += us
        t["dram_us"] += us * (k.get("dram") or 0.0)
        t["sm_us"] += us * (k.get("sm") or 0.0)
    out.write(f"\n{'launches':>8} {'total µs':>10} {'DRAM%':>6} {'SM%':>6}  kernel (DRAM, SM: weighted by duration)\n")
    for name, t in sorted(totals.items(), key=lambda kv: -kv[1]["us"]):
        dram = t["dram_us"] / t["us"] if t["us"] else None
        sm = t["sm_us"] / t["us"] if t["us"] else None
        out.write(f"{t['n']:>8} {t['us']:>10.1f} {fmt(dram, 6, 1)} {fmt(sm, 6, 1)}  {shown(name)}\n")


def main(argv):
    if len(argv) < 2:
        sys.stderr.write(__doc__)
        return 2
    launches = []
    for path in argv[1:]:
        with open(path, encoding="utf-8", errors="replace") as f:
            launches += parse(f)
    if not launches:
        sys.stderr.write(f"ncu_summary: no kernel reports in {', '.join(argv[1:])} (did ncu profile anything?)\n")
        return 1
    report(launches)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
