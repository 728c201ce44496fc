#!/usr/bin/env python3
"""scripts/ncu_summary.py reads Nsight Compute's text report as gpu_check.sh's ncu stage keeps it.

    python3 tests/python/test_ncu_summary.py <flux8 binary, unused> <source dir>

The fixture (tests/python/data/ncu_sample.txt) is two launch reports of a real W2 FP8 step on the
H200: QK-norm's FP8 backward with every section the stage asks for, and a
column-sum total with SpeedOfLight and LaunchStats only. Standard library only.
"""
import io
import os
import sys


def main(argv):
    src = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "..")
    sys.path.insert(0, os.path.join(src, "scripts"))
    import ncu_summary

    with open(os.path.join(src, "tests", "python", "data", "ncu_sample.txt"), encoding="utf-8") as f:
        launches = ncu_summary.parse(f)
    assert len(launches) == 2, launches
    qk, total = launches
    assert qk["name"] == "qk_norm_rope_to_heads_backward_vec_kernel<16, bf16, bf16, 1>", qk["name"]
    assert qk["grid"] == "13824x1x1" and qk["block"] == "256x1x1", qk
    expected = {"us": 213.02, "dram": 36.50, "sm": 46.05, "l1": 93.08, "regs": 64, "occ": 48.34, "spills": 1548288}
    for key, value in expected.items():
        assert abs(qk[key] - value) < 1e-6, (key, qk[key], value)
    assert total["name"] == "column_partials_total_kernel", total["name"]
    assert abs(total["us"] - 20.61) < 1e-6 and total["regs"] == 30 and total["grid"] == "24x1x1", total
    assert "occ" not in total and "spills" not in total, total  # sections not in its report

    # Units: a duration in ns or ms is converted to µs.
    ms = ncu_summary.parse(["  k() (1, 1, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0\n",
                            "    Duration                         ms         1.50\n"])
    assert abs(ms[0]["us"] - 1500.0) < 1e-9, ms

    out = io.StringIO()
    ncu_summary.report(launches, out)
    text = out.getvalue()
    assert "1548288" in text and "column_partials_total_kernel" in text, text
    lines = text.splitlines()
    per_kernel = lines[next(i for i, l in enumerate(lines) if l.strip().startswith("launches")) + 1]
    assert per_kernel.split()[0] == "1" and per_kernel.split()[1] == "213.0", per_kernel  # longest first
    assert ncu_summary.main(["ncu_summary.py", os.devnull]) == 1  # no reports: a failure, not an empty table
    print("ncu_summary: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
