#!/usr/bin/env python3
"""Files flux8 writes are read by Python's safetensors, and files Python writes are read by flux8.

    python3 tests/python/test_safetensors_interop.py <flux8 binary> <source dir>

Needs only `numpy` and `safetensors` (pip). Exits non-zero on the first failed check. Takes about
a second: the model is flux_tiny_demo shrunk to H=24, one double and one single block.

Checks
  1. `flux8 init` in bf16, f32 and f16, with reference (BFL) and diffusers names: each file opens
     with safe_open and load_file; it holds exactly the tensor names and shapes that the config
     implies, with names from tools/flux_names.py (the team's Python name map, written apart from
     the C++ one); every tensor has the requested dtype; the metadata records producer, format
     "pt", seed and the resolved config.
  2. Same seed, different dtype: bf16 and f16 files are the f32 file rounded to nearest even.
  3. Same seed, different naming: the diffusers file mapped by flux_names.diffusers_to_bfl holds
     bit-identical values to the reference file.
  4. `flux8 forward` reads inputs and checkpoints that numpy wrote: checkpoint = the diffusers
     file from (1) perturbed in numpy (so that no parameter is zero: MLPerf init zeroes the
     modulation and final layer, which would make pred identically zero), saved once under
     diffusers names and once converted back to BFL names (in f32, and in f64 holding the same
     values). All give bit-identical pred and gradients, and so do f64 inputs, per-sample
     [B,L,3] ids and integer (I64/I32) ids holding the same values as the f32 inputs.
  5. The forward output opens with safe_open/load_file; it holds pred [B,Li,C], loss [1] and
     grad.<name> shaped like every parameter; loss == mean(pred*probe) recomputed in numpy.
  6. `--init-seed N` gives the same gradients as `--checkpoint` of `init --seed N --dtype f32`.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

FLUX8 = os.path.abspath(sys.argv[1])
SRC = os.path.abspath(sys.argv[2])
sys.path.insert(0, os.path.join(SRC, "tools"))
from flux_names import bfl_to_diffusers, diffusers_to_bfl, mapping_entries  # noqa: E402

CONFIG = os.path.join(SRC, "configs", "models", "flux_tiny_demo.yaml")
# Small enough that init+forward+backward takes milliseconds. guidance_embed is switched on so
# that the guidance_in names are covered too (flux_tiny_demo itself has none).
MODEL = dict(hidden_size=24, num_attention_heads=2, num_double_blocks=1, num_single_blocks=1,
             axes_dim="[2,4,6]", guidance_embed="true")
H, HEADS, ND, NS = 24, 2, 1, 1
CIN, CTX, VEC, MLP_RATIO = 12, 32, 32, 4.0          # from flux_tiny_demo.yaml
SEED = 7
SET = [a for k, v in MODEL.items() for a in ("--set", f"{k}={v}")]
FILE_DTYPE = {"bf16": "BF16", "f32": "F32", "f16": "F16"}

failures = 0


def check(ok: bool, what: str):
    global failures
    if not ok:
        failures += 1
        print(f"FAIL: {what}", flush=True)


def flux8(*args):
    cmd = [FLUX8, *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"FAIL: {' '.join(cmd)} exited {r.returncode}\n{r.stdout}{r.stderr}")
        sys.exit(1)


def expected_bfl_shapes(guidance: bool) -> dict[str, tuple]:
    """Parameter shapes (BFL names) implied by the config; names come from flux_names."""
    D, M = H // HEADS, int(MLP_RATIO * H)
    out_features = {  # BFL prefix with the block index removed -> (out, in) of that Linear
        "img_in": (H, CIN), "txt_in": (H, CTX),
        "time_in.in_layer": (H, 256), "time_in.out_layer": (H, H),
        "guidance_in.in_layer": (H, 256), "guidance_in.out_layer": (H, H),
        "vector_in.in_layer": (H, VEC), "vector_in.out_layer": (H, H),
        "img_mod.lin": (6 * H, H), "txt_mod.lin": (6 * H, H),
        "img_attn.qkv": (3 * H, H), "txt_attn.qkv": (3 * H, H),
        "img_attn.proj": (H, H), "txt_attn.proj": (H, H),
        "img_mlp.0": (M, H), "txt_mlp.0": (M, H), "img_mlp.2": (H, M), "txt_mlp.2": (H, M),
        "linear1": (3 * H + M, H), "linear2": (H, H + M), "modulation.lin": (3 * H, H),
        "final_layer.adaLN_modulation.1": (2 * H, H), "final_layer.linear": (CIN, H),
    }
    shapes = {}
    for bfl, _kind, _dif, sufs in mapping_entries(ND, NS, guidance):
        parts = bfl.split(".")
        key = ".".join(parts[2:]) if parts[0] in ("double_blocks", "single_blocks") else bfl
        for bs, _ds in sufs:
            if bs == "scale":                      # q/k RMSNorm over one head
                shapes[f"{bfl}.{bs}"] = (H // HEADS,)
            elif bs == "weight":
                shapes[f"{bfl}.{bs}"] = out_features[key]
            else:
                shapes[f"{bfl}.{bs}"] = (out_features[key][0],)
    return shapes


def read_bf16_raw(path: str) -> dict[str, np.ndarray]:
    """BF16 tensors as float32, decoded from the file bytes (numpy has no bfloat16 type unless
    ml_dtypes is installed, which this test does not require)."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        assert t["dtype"] == "BF16", (name, t["dtype"])
        a, b = t["data_offsets"]
        u16 = np.frombuffer(blob[8 + n + a:8 + n + b], dtype="<u2")
        out[name] = (u16.astype(np.uint32) << 16).view(np.float32).reshape(t["shape"])
    return out


def load_values(path: str, dtype: str) -> dict[str, np.ndarray]:
    if dtype != "bf16":
        return {k: v.astype(np.float32) for k, v in load_file(path).items()}
    vals = read_bf16_raw(path)
    try:
        import ml_dtypes  # noqa: F401  (optional: lets safetensors.numpy build bfloat16 arrays)
    except ImportError:
        return vals
    via_lib = load_file(path)
    for k, v in vals.items():
        check(np.array_equal(via_lib[k].astype(np.float32), v), f"{path}: {k} load_file != raw bytes")
    return vals


def round_f32_to_bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16          # round to nearest, ties to even
    return u.astype(np.uint32).view(np.float32)


def check_init_file(path: str, dtype: str, naming: str, bfl_shapes: dict) -> dict:
    want = bfl_shapes if naming == "reference" else {
        k: v.shape for k, v in bfl_to_diffusers({k: np.zeros(s) for k, s in bfl_shapes.items()}).items()}
    with safe_open(path, framework="np") as f:
        names = set(f.keys())
        check(names == set(want), f"{path}: names differ from flux_names: missing "
              f"{sorted(set(want) - names)[:5]}, unexpected {sorted(names - set(want))[:5]}")
        for k in names & set(want):
            sl = f.get_slice(k)
            check(tuple(sl.get_shape()) == tuple(want[k]), f"{path}: {k} shape {sl.get_shape()} != {want[k]}")
            check(sl.get_dtype() == FILE_DTYPE[dtype], f"{path}: {k} dtype {sl.get_dtype()} != {FILE_DTYPE[dtype]}")
        meta = f.metadata() or {}
    check(meta.get("producer") == "flux8 init", f"{path}: metadata producer = {meta.get('producer')!r}")
    check(meta.get("format") == "pt", f"{path}: metadata format = {meta.get('format')!r} (transformers/diffusers expect 'pt')")
    check(meta.get("seed") == str(SEED), f"{path}: metadata seed = {meta.get('seed')!r}")
    check("hidden_size: 24" in meta.get("config", ""), f"{path}: metadata config lacks the resolved hidden_size")
    vals = load_values(path, dtype)
    check(all(np.isfinite(v).all() for v in vals.values()), f"{path}: non-finite values")
    return vals


def main():
    with tempfile.TemporaryDirectory(prefix="flux8_st_") as tmp:
        p = lambda name: os.path.join(tmp, name)  # noqa: E731

        # ---- 1-3: flux8 init -> Python ------------------------------------------------------
        bfl_shapes = expected_bfl_shapes(guidance=True)
        vals = {}
        for dtype in ("f32", "bf16", "f16"):
            for naming in ("reference", "diffusers"):
                path = p(f"init_{dtype}_{naming}.safetensors")
                flux8("init", "-c", CONFIG, *SET, "--seed", str(SEED), "--dtype", dtype,
                      "--naming", naming, "--out", path)
                vals[dtype, naming] = check_init_file(path, dtype, naming, bfl_shapes)
        ref32 = vals["f32", "reference"]
        check(any(np.any(v != 0) for v in ref32.values()), "f32 init is all zeros")
        for dtype in ("f32", "bf16", "f16"):
            mapped = diffusers_to_bfl(vals[dtype, "diffusers"])
            for k, v in vals[dtype, "reference"].items():
                check(np.array_equal(mapped[k], v), f"{dtype}: diffusers-named {k} != reference-named {k}")
        for k, v in ref32.items():
            check(np.array_equal(vals["bf16", "reference"][k], round_f32_to_bf16(v)),
                  f"bf16 init {k} is not the f32 init rounded to nearest even")
            check(np.array_equal(vals["f16", "reference"][k], v.astype(np.float16).astype(np.float32)),
                  f"f16 init {k} is not the f32 init rounded to nearest even")
        # guidance_embed=false drops exactly the guidance_in tensors
        path = p("init_noguid.safetensors")
        flux8("init", "-c", CONFIG, *SET, "--set", "guidance_embed=false", "--seed", str(SEED),
              "--dtype", "f32", "--out", path)
        check_init_file(path, "f32", "reference", expected_bfl_shapes(guidance=False))

        # ---- 4: Python -> flux8 forward -------------------------------------------------------
        rng = np.random.default_rng(SEED)
        B, Li, Lt = 2, 5, 3
        img_ids = np.zeros((Li, 3), np.float32)
        img_ids[:, 1], img_ids[:, 2] = np.arange(Li) // 3, np.arange(Li) % 3   # 2x3 grid, row-major
        inputs = dict(img=rng.standard_normal((B, Li, CIN)), img_ids=img_ids,
                      txt=rng.standard_normal((B, Lt, CTX)), txt_ids=np.zeros((Lt, 3)),
                      timesteps=np.array([0.25, 0.9]), y=rng.standard_normal((B, VEC)),
                      guidance=np.array([3.5, 1.0]), probe=rng.standard_normal((B, Li, CIN)))
        inputs = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in inputs.items()}
        save_file(inputs, p("in_f32.safetensors"))
        save_file({k: v.astype(np.float64) for k, v in inputs.items()}, p("in_f64.safetensors"))
        batched = dict(inputs, img_ids=np.broadcast_to(img_ids, (B, Li, 3)).copy(),
                       txt_ids=np.zeros((B, Lt, 3), np.float32))
        save_file(batched, p("in_batched_ids.safetensors"))
        save_file(dict(inputs, img_ids=img_ids.astype(np.int64), txt_ids=np.zeros((Lt, 3), np.int32)),
                  p("in_int_ids.safetensors"))

        dif = {k: v.copy() for k, v in vals["f32", "diffusers"].items()}
        for k in sorted(dif):        # perturb: nothing zero, scales stay near 1
            dif[k] = (dif[k] + 0.2 * rng.standard_normal(dif[k].shape)).astype(np.float32)
        save_file(dif, p("ckpt_diffusers.safetensors"), metadata={"format": "pt"})
        bfl = diffusers_to_bfl(dif)
        save_file({k: np.ascontiguousarray(v) for k, v in bfl.items()}, p("ckpt_bfl.safetensors"))
        save_file({k: v.astype(np.float64) for k, v in bfl.items()}, p("ckpt_bfl_f64.safetensors"))

        outs = {}
        for ck in ("diffusers", "bfl", "bfl_f64"):
            for inp in ("f32", "f64", "batched_ids", "int_ids"):
                out = p(f"out_{ck}_{inp}.safetensors")
                flux8("forward", "-c", CONFIG, *SET, "--checkpoint", p(f"ckpt_{ck}.safetensors"),
                      "--inputs", p(f"in_{inp}.safetensors"), "--out", out, "--loss-grad")
                outs[ck, inp] = out

        # ---- 5: flux8 forward -> Python -------------------------------------------------------
        base = load_file(outs["bfl", "f32"])
        with safe_open(outs["bfl", "f32"], framework="np") as f:
            meta = f.metadata() or {}
        check(meta.get("producer") == "flux8 forward", f"forward output metadata producer = {meta.get('producer')!r}")
        want = {"pred", "loss"} | {f"grad.{k}" for k in bfl_shapes}
        check(set(base) == want, f"forward output names: missing {sorted(want - set(base))[:5]}, "
              f"unexpected {sorted(set(base) - want)[:5]}")
        check(base["pred"].shape == (B, Li, CIN), f"pred shape {base['pred'].shape}")
        check(base["loss"].shape == (1,), f"loss shape {base['loss'].shape}")
        for k, s in bfl_shapes.items():
            g = base.get(f"grad.{k}")
            check(g is not None and g.shape == s, f"grad.{k} shape {None if g is None else g.shape} != {s}")
        pred = base["pred"].astype(np.float64)
        check(np.isfinite(pred).all() and np.abs(pred).max() > 0, "pred is zero or non-finite")
        terms = pred * inputs["probe"].astype(np.float64)
        # flux8 sums n f32 products; the worst-case rounding of a recursive f32 sum is
        # n * 2^-24 * sum|terms|, i.e. n * 2^-24 * mean|terms| on the mean.
        tol = terms.size * 2.0 ** -24 * np.abs(terms).mean()
        err = abs(float(base["loss"][0]) - terms.mean())
        check(err <= tol, f"loss {base['loss'][0]!r} != mean(pred*probe) {terms.mean()!r} (|diff| {err:.3g} > {tol:.3g})")
        check(any(np.abs(base[f"grad.{k}"]).max() > 0 for k in bfl_shapes), "all gradients are zero")

        for key, out in outs.items():   # same weights and same input values: same numbers, bit for bit
            o = load_file(out)
            check(set(o) == set(base), f"{out}: tensor names differ")
            for k in set(o) & set(base):
                check(np.array_equal(o[k], base[k]), f"{key}: {k} differs from the BFL-checkpoint f32-input run "
                      f"(max |diff| {np.abs(o[k].astype(np.float64) - base[k]).max():.3g})")

        # ---- 6: --init-seed == --checkpoint of the f32 init file ------------------------------
        flux8("forward", "-c", CONFIG, *SET, "--init-seed", str(SEED), "--inputs", p("in_f32.safetensors"),
              "--out", p("out_seed.safetensors"), "--loss-grad")
        flux8("forward", "-c", CONFIG, *SET, "--checkpoint", p("init_f32_reference.safetensors"),
              "--inputs", p("in_f32.safetensors"), "--out", p("out_init_ckpt.safetensors"), "--loss-grad")
        a, b = load_file(p("out_seed.safetensors")), load_file(p("out_init_ckpt.safetensors"))
        for k in a:
            check(np.array_equal(a[k], b[k]), f"--init-seed {SEED} and --checkpoint of init --seed {SEED}: {k} differs")

    if failures:
        print(f"test_safetensors_interop: {failures} check(s) failed")
        return 1
    print("test_safetensors_interop: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
