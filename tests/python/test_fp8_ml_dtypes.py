#!/usr/bin/env python3
"""flux8's FP8 conversions (src/fp8/format.h) are bit-exact with ml_dtypes.

    python3 tests/python/test_fp8_ml_dtypes.py <flux8 binary> <source dir>

Needs `numpy` and `ml_dtypes` (pip), and the test tool flux8_fp8_convert built next to the flux8
binary (CMake target of the same name, built with flux8_tests). Takes a few seconds.

Reference, per format:
  E4M3  ml_dtypes.float8_e4m3fn cast of clip(x, -448, 448)      (flux8 saturates, TE semantics)
  E5M2  ml_dtypes.float8_e5m2   cast of clip(x, -57344, 57344)  (so ±inf -> ±max, as in flux8)
  E8M0  ml_dtypes.float8_e8m0fnu cast of x itself, on every input.
NaN inputs: compared as "both are NaN", because payload conventions differ (ml_dtypes keeps some
payload bits: a signalling f32 NaN can become E5M2 0x7D); flux8's own NaN codes are checked to be
the canonical ones (E4M3 0x7F|sign, E5M2 quiet 0x7E|sign). Everything else: equal bytes.

E8M0 domain notes: E8M0 has no zero, sign or inf, and ml_dtypes' cast gives NaN (0xFF) for ±0,
every negative, ±inf, NaN and anything that rounds past 2^127 (x >= 1.5·2^127); flux8's
e8m0_encode returns 0xFF for all of them too, so E8M0 is compared bit for bit everywhere, not
only on positive finite inputs. ml_dtypes rounds a normal x to the nearest power of two with the
midpoint 1.5·2^k going UP, and (since 0.7) rounds f32 subnormals by the same rule: below 1.5·2^-127
to 2^-127, from there to 2^-126; flux8 follows (documented in format.h). Older ml_dtypes sent every
subnormal above 2^-127 to 2^-126, so this check needs ml_dtypes >= 0.7 and is skipped (exit 77,
ctest's SKIP_RETURN_CODE for the python tests) with a note on an older one. The MX scale
(e8m0_scale_for_amax) is a different rule and is tested in tests/test_fp8_format.cpp.

Inputs: every bf16 value (through the bf16 entry point and through the f32 one); for every FP8
code its value, the midpoints to both neighbours, one f32 ULP either side of each; f32
subnormals; ±max, just above max, overflow, ±0, ±inf, NaNs with several payloads; 1M log-uniform
magnitudes over 2^-160..2^130 with random signs, 1M random f32 bit patterns and 300k normal
samples at three scales. Decodes: all 256 codes of each format, compared bit for bit (NaN: both NaN).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np

ML_DTYPES_MIN = (0, 7)
_ml_version = tuple(int(p) for p in ml_dtypes.__version__.split(".")[:2] if p.isdigit())
if _ml_version < ML_DTYPES_MIN:
    print(f"SKIP: ml_dtypes {ml_dtypes.__version__} < 0.7 rounds E8M0 f32 subnormals by an older rule;"
          " upgrade it (python3 -m pip install -U 'ml_dtypes>=0.7', or scripts/install_deps.sh)")
    sys.exit(77)

FLUX8 = os.path.abspath(sys.argv[1])
TOOL = os.path.join(os.path.dirname(FLUX8), "flux8_fp8_convert")
if not os.path.exists(TOOL):
    sys.exit(f"FAIL: {TOOL} not found: build the flux8_fp8_convert target (ninja flux8_fp8_convert)")

FORMATS = {  # name: (ml_dtypes type, saturation bound or None, canonical +NaN code or None)
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 0x7F),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, 0x7E),
    "e8m0": (ml_dtypes.float8_e8m0fnu, None, None),
}
failures = 0
TMP = tempfile.mkdtemp(prefix="flux8_fp8_")


def check(ok: bool, what: str):
    global failures
    if not ok:
        failures += 1
    print(("ok   " if ok else "FAIL ") + what)


def run_tool(op: str, fmt: str, data: np.ndarray, out_dtype) -> np.ndarray:
    src, dst = os.path.join(TMP, "in.bin"), os.path.join(TMP, "out.bin")
    data.astype(data.dtype.newbyteorder("<")).tofile(src)
    subprocess.run([TOOL, op, fmt, src, dst], check=True)
    return np.fromfile(dst, dtype=np.dtype(out_dtype).newbyteorder("<"))


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def compare_encode(fmt: str, x: np.ndarray, got: np.ndarray, label: str) -> int:
    """x: float32 (or bfloat16) inputs, got: flux8 codes. Returns the number of values compared."""
    dt, bound, nan_code = FORMATS[fmt]
    xf = x.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        want = (xf if bound is None else np.clip(xf, -bound, bound)).astype(dt).view(np.uint8)
    nan_in = np.isnan(xf)
    if bound is None:
        ok = got == want
    else:
        sign = (xf.view(np.uint32) >> 31).astype(np.uint8) << 7
        ok = np.where(nan_in, (got == (sign | nan_code)) & np.isnan(want.view(dt).astype(np.float32)), got == want)
    bad = np.nonzero(~ok)[0]
    detail = ""
    if bad.size:
        i = bad[:5]
        detail = "; first: " + ", ".join(
            f"x={xf[j]!r} (0x{int(xf.view(np.uint32)[j]):08x}) flux8=0x{int(got[j]):02x} ml_dtypes=0x{int(want[j]):02x}"
            for j in i)
    check(bad.size == 0, f"{fmt} {label}: {x.size} values, {bad.size} mismatches{detail}")
    return x.size


def code_neighbourhood_inputs(fmt: str) -> np.ndarray:
    """Each finite FP8 value, the midpoints to its neighbours and one f32 ULP either side of both."""
    dt = FORMATS[fmt][0]
    vals = np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)
    vals = np.unique(vals[np.isfinite(vals)])  # sorted, -max..max
    top = vals[-1]
    step = vals[-1] - vals[-2]
    vals = np.concatenate([[-top * 2, -top - step], vals, [top + step, top * 2]])  # overflow side
    mids = (vals[:-1] + vals[1:]) / 2  # exact in float64; exact in float32 too for these formats
    pts = np.concatenate([vals, mids]).astype(np.float32)
    out = [pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(-np.inf))]
    return np.concatenate(out)


def special_inputs() -> np.ndarray:
    s = [0.0, -0.0, np.inf, -np.inf, 448.0, -448.0, 464.0, 480.0, 57344.0, 61440.0, 65536.0, 1e30, -1e30,
         3.4028235e38, -3.4028235e38, 1.0, 1.5, 3.0, 0.75]
    x = np.array(s, dtype=np.float32)
    nans = f32([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FE00000])
    sub = f32(np.concatenate([np.arange(1, 1 << 23, 997), [1, 2, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF]]))
    # E8M0: powers of two, the 1.5·2^k midpoints and their f32 neighbours, over the whole f32 range.
    k = np.arange(-149, 128)
    p2 = np.ldexp(1.0, k).astype(np.float32)
    mid = (1.5 * np.ldexp(1.0, k)).astype(np.float32)
    e8 = np.concatenate([p2, mid, np.nextafter(p2, np.float32(0)), np.nextafter(p2, np.float32(np.inf)),
                         np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    return np.concatenate([x, nans, sub, -sub, e8, -e8])


def random_inputs() -> np.ndarray:
    rng = np.random.default_rng(20240611)
    n = 1_000_000
    mag = np.exp2(rng.uniform(-160.0, 130.0, n))  # float64; underflows to 0 / overflows to inf in f32
    with np.errstate(over="ignore"):
        logu = (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    bits = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    normal = np.concatenate([rng.normal(0.0, s, 100_000) for s in (1.0, 300.0, 1e-3)]).astype(np.float32)
    return np.concatenate([logu, bits, normal])


def main():
    counts = {f: 0 for f in FORMATS}
    bf16_bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    bf16 = bf16_bits.view(ml_dtypes.bfloat16)
    bf16_as_f32 = (bf16_bits.astype(np.uint32) << 16).view(np.float32)
    rand = random_inputs()
    special = special_inputs()
    for fmt, (dt, bound, _) in FORMATS.items():
        # every bf16, through fp8_encode_bf16 (e8m0: e8m0_encode of the widened value) ...
        got = run_tool("encode-bf16", fmt, bf16_bits, np.uint8)
        counts[fmt] += compare_encode(fmt, bf16_as_f32, got, "every bf16 (bf16 path)")
        # ... and against ml_dtypes' own bf16 cast too (E8M0: no clip needed)
        if bound is None:
            with np.errstate(invalid="ignore"):
                want = bf16.astype(dt).view(np.uint8)
            check(np.array_equal(got, want), f"{fmt} every bf16 vs ml_dtypes' bfloat16 cast: 65536 values")
            counts[fmt] += 65536
        got = run_tool("encode-f32", fmt, bf16_as_f32, np.uint8)
        counts[fmt] += compare_encode(fmt, bf16_as_f32, got, "every bf16 widened to f32 (f32 path)")
        for label, x in (("code values, midpoints, ±1 ULP", code_neighbourhood_inputs("e4m3" if fmt == "e8m0" else fmt)),
                         ("specials (±0, ±inf, NaNs, max, overflow, f32 subnormals, 2^k, 1.5·2^k)", special),
                         ("random: log-uniform, bit patterns, normal", rand)):
            got = run_tool("encode-f32", fmt, x, np.uint8)
            counts[fmt] += compare_encode(fmt, x, got, label)
        # decode: all 256 codes
        codes = np.arange(256, dtype=np.uint8)
        got = run_tool("decode", fmt, codes, np.float32)
        want = codes.view(dt).astype(np.float32)
        gn, wn = np.isnan(got), np.isnan(want)
        ok = (gn == wn) & (gn | (got.view(np.uint32) == want.view(np.uint32)))
        check(bool(ok.all()), f"{fmt} decode of all 256 codes: {int((~ok).sum())} mismatches")
        counts[fmt] += 256
    shutil.rmtree(TMP, ignore_errors=True)
    print("values compared: " + ", ".join(f"{f} {n}" for f, n in counts.items()))
    if failures:
        sys.exit(f"{failures} check(s) failed")
    print("all checks passed")


if __name__ == "__main__":
    main()
