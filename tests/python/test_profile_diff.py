#!/usr/bin/env python3
"""scripts/profile_diff.py reads two `flux8 bench --profile` outputs as gpu_check.sh's ab stage keeps them.

    python3 tests/python/test_profile_diff.py <flux8 binary, unused> <source dir>

The fixtures (tests/python/data/ab_profile_{base,new}.txt) are an ab stage's output on the
H200: W1 and W2 in FP8 delayed + FP8 attention, a base commit against a change of AdamW and
QK-norm; profile_fp8_attention.{txt,json} one run as printed and as --json wrote it (the json trimmed to the keys read). Standard library only.
"""
import io
import os
import sys


def main(argv):
    src = argv[2] if len(argv) > 2 else os.path.join(os.path.dirname(__file__), "..", "..")
    sys.path.insert(0, os.path.join(src, "scripts"))
    import profile_diff

    data = os.path.join(src, "tests", "python", "data")
    runs = []
    for side in ("base", "new"):
        with open(os.path.join(data, f"ab_profile_{side}.txt"), encoding="utf-8") as f:
            runs.append(profile_diff.parse(f))
    base, new = runs
    assert list(base) == [("W1", "delayed hybrid"), ("W2", "delayed hybrid")], list(base)
    w2b, w2n = base[("W2", "delayed hybrid")], new[("W2", "delayed hybrid")]
    assert abs(w2b["step"] - 64.31) < 1e-9 and abs(w2b["profiled"] - 63.92) < 1e-9, w2b
    assert abs(w2b["ops"]["adamw"] - 9.794) < 1e-9 and abs(w2n["ops"]["adamw"] - 9.462) < 1e-9
    # Op names with spaces, brackets and bars, and the idle row, are whole keys.
    assert "quantize_fused ([head | gelu_tanh_backward] + fp8 cast)" in w2b["ops"], sorted(w2b["ops"])
    assert "(device idle between ops)" in w2b["ops"]
    assert len(w2b["ops"]) == len(w2n["ops"]) > 30, len(w2b["ops"])

    out = io.StringIO()
    profile_diff.report(base, new, out, 0.03)
    lines = out.getvalue().splitlines()
    assert lines[0] == "W1 delayed hybrid: step 27.94 -> 27.93 ms, profiled 27.78 -> 27.68 ms", lines[0]
    assert lines[1].split() == ["qk_norm_rope_to_heads_backward_fp8", "0.673", "0.583", "-0.090"], lines[1]
    w2 = lines.index("W2 delayed hybrid: step 64.31 -> 64.27 ms, profiled 63.92 -> 63.99 ms")
    assert lines[w2 + 1].split() == ["adamw", "9.794", "9.462", "-0.332"], lines[w2 + 1]  # largest first
    changes = [abs(float(l.split()[-1])) for l in lines[w2 + 1:]]
    assert changes == sorted(changes, reverse=True) and min(changes) >= 0.03, changes

    # An op only one side ran counts as 0 on the other; a quiet workload says so.
    one = {("W1", "BF16"): {"step": 40.0, "profiled": None, "ops": {"a": 1.0}}}
    two = {("W1", "BF16"): {"step": 39.0, "profiled": 38.5, "ops": {"a": 1.0, "b": 0.5}}}
    out = io.StringIO()
    profile_diff.report(one, two, out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "W1 BF16: step 40.00 -> 39.00 ms, profiled - -> 38.50 ms", lines
    assert len(lines) == 2 and lines[1].split() == ["b", "0.000", "0.500", "+0.500"], lines
    out = io.StringIO()
    profile_diff.report(one, one, out)
    assert out.getvalue().splitlines()[1] == "  (no op moved by 0.02 ms or more)", out.getvalue()

    # One run (FP8 + FP8 attention) as printed and as --json
    # wrote it: the same runs, labels, op names and times (to the printed 3 decimals), and the
    # profiled total as the sum of the rows.
    parsed = {}
    for ext in ("txt", "json"):
        with open(os.path.join(data, f"profile_fp8_attention.{ext}"), encoding="utf-8") as f:
            parsed[ext] = profile_diff.read(f)
    txt, js = parsed["txt"], parsed["json"]
    assert list(js) == list(txt) == [("W1", "delayed hybrid"), ("W2", "delayed hybrid")], (list(js), list(txt))
    for key in txt:
        t, j = txt[key], js[key]
        assert abs(t["step"] - j["step"]) < 0.005 and abs(t["profiled"] - j["profiled"]) < 0.005, (key, t, j)
        assert list(t["ops"]) == list(j["ops"]), key
        for op, ms in t["ops"].items():
            assert abs(ms - j["ops"][op]) < 0.0005, (key, op, ms, j["ops"][op])
    # The fixtures predate the energy line: no energy, and the report does not name it.
    assert all(r["joules"] is None for r in list(txt.values()) + list(js.values()))
    # The energy line a GPU run prints under its step line is the run's
    # joules a step, read from the printed output and from --json alike, and reported where both
    # sides have it.
    printed = [
        "W2 (flux_12b_width_slice) BF16                             90.41    520.6     0.01     0.43      22.85      25.34      7.60  1.71x\n",
        "  energy: 64.0 J a step, 700 W on average over the timed steps' 3.66 s (at the 700 W limit, sustained, this "
        "energy takes 91.42 ms a step); SM clock 1575 MHz in the last step, held back by: power cap (software)\n",
        "  op                                calls    ms/step   share   (profiled step: 90.00 ms of ops and idle)\n",
        "  adamw                                 1      6.555    7.3%\n",
    ]
    a = profile_diff.parse(printed)[("W2", "BF16")]
    assert a["joules"] == 64.0 and a["step"] == 90.41 and a["ops"] == {"adamw": 6.555}, a
    b = profile_diff.parse_json(
        '{"steps": [{"workload": "W2", "precision": "bf16", "median_step_ms": 89.0, "ops": [{"op": "adamw", '
        '"ms_per_step": 6.5}], "energy": {"measured": true, "joules_per_step": 62.5}}]}')[("W2", "BF16")]
    assert b["joules"] == 62.5, b
    out = io.StringIO()
    profile_diff.report({("W2", "BF16"): a}, {("W2", "BF16"): b}, out)
    assert out.getvalue().splitlines()[0] == (
        "W2 BF16: step 90.41 -> 89.00 ms, profiled 90.00 -> 6.50 ms, energy 64.0 -> 62.5 J a step"), out.getvalue()
    unmeasured = profile_diff.parse_json(
        '{"steps": [{"workload": "W2", "precision": "bf16", "median_step_ms": 89.0, "ops": [], '
        '"energy": {"measured": false, "why": "cpu backend: no energy counter"}}]}')
    assert unmeasured[("W2", "BF16")]["joules"] is None, unmeasured
    # A --json file of runs without --profile has nothing to compare.
    assert profile_diff.parse_json('{"steps": [{"workload": "W1", "precision": "bf16"}]}') == {}
    print("profile_diff: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
