#!/usr/bin/env python3
"""`flux8 export` is loaded by diffusers and computes what flux8 computes; the BF16 and FP8 files
other programs write load into flux8 with exactly the values their rounding gives.

    python3 tests/python/test_export_import.py <flux8 binary> <source dir>

Needs numpy, safetensors, torch, diffusers and transformers (pip). Outside CI (no CI variable in
the environment) it exits 77, skipped, when torch or diffusers is missing; in CI that is a
failure. The model is flux_tiny_demo shrunk to H=24, one double and one single block, with
guidance; a few seconds.

Checks
  1. `flux8 export --format diffusers --dtype f32` of a perturbed f32 file (MLPerf init zeroes
     the modulation and final layer, which would make pred zero; +N(0, 0.1^2) on every value) with a small --max-shard-size:
     config.json, several shards named diffusion_pytorch_model-0000N-of-0000M.safetensors, each at
     most the limit unless it holds a single tensor, an index whose weight_map lists every tensor
     once, in its shard; FluxTransformer2DModel.from_pretrained (torch, CPU, f32) loads it with no
     missing or unexpected key, and its parameters are the file's values bit for bit.
  2. diffusers' forward of that model equals `flux8 forward` of the exported folder and of the
     original file on the same inputs within 1e-5 of max|pred| (f32 both; diffusers' timestep and
     RoPE tables computed in f64 and rounded to f32, as flux8 computes them: with_f64_embeddings).
  3. `--dtype bf16` diffusers export: the weights rounded to nearest even, and still loadable.
  4. BF16 import: a BF16 file torch wrote, re-exported by flux8 as f32, holds exactly the BF16
     values; `flux8 forward` of it equals forward of those values written as F32, bit for bit.
  5. FP8 import, two ComfyUI layouts written with torch: the current one (model.diffusion_model.
     prefix, "<layer>.weight_scale", "_quantization_metadata", ".comfy_quant" and input scales)
     and the older one ("scaled_fp8" marker, "<layer>.scale_weight", "<layer>.scale_input"), plus
     unscaled E4M3 weights: flux8 loads code * scale computed in f64 and rounded once to f32,
     exactly (export f32, and forward bit-identical to forward of those values as F32).
  6. `flux8 export --format bfl --dtype fp8`: the blocks' Linear weights are F8_E4M3 with an F32
     scalar weight_scale = amax/448 listed in _quantization_metadata, the rest BF16; code * scale
     is within E4M3's rounding of the weights; flux8 reads its own FP8 file back exactly.
  7. Bad folders fail naming the file and tensor: a missing shard, a tensor the index puts in
     another shard, a negative scale, an FP8 file whose scale sits beside a BF16 weight.
  8. A training run's checkpoint directory exports without -c (it carries its config), and so
     does its save_dir (the newest checkpoint): diffusers loads the model.safetensors values.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

try:
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors import safe_open
    from safetensors.torch import load_file as torch_load, save_file as torch_save
except ImportError as e:  # only outside CI: CI installs them (scripts/install_deps.sh)
    if os.environ.get("CI"):
        raise
    print(f"test_export_import: skipped: {e} (pip install torch diffusers transformers)")
    sys.exit(77)
from safetensors.numpy import load_file, save_file

FLUX8 = os.path.abspath(sys.argv[1])
SRC = os.path.abspath(sys.argv[2])
sys.path.insert(0, os.path.join(SRC, "tools"))
from flux_names import bfl_to_diffusers  # noqa: E402
from make_goldens import F64PosEmbed, F64TimestepProj  # noqa: E402

CONFIG = os.path.join(SRC, "configs", "models", "flux_tiny_demo.yaml")
MODEL = dict(hidden_size=24, num_attention_heads=2, num_double_blocks=1, num_single_blocks=1,
             axes_dim="[2,4,6]", guidance_embed="true")
SET = [a for k, v in MODEL.items() for a in ("--set", f"{k}={v}")]
CIN, CTX, VEC = 12, 32, 32          # from flux_tiny_demo.yaml
SEED = 11
SHARD_LIMIT = 40_000                # bytes: several shards at this size
PRED_TOLERANCE = 1e-5

failures = 0


def check(ok: bool, what: str):
    global failures
    if not ok:
        failures += 1
        print(f"FAIL: {what}", flush=True)


def flux8(*args, expect_ok=True) -> subprocess.CompletedProcess:
    r = subprocess.run([FLUX8, *args], capture_output=True, text=True)
    if expect_ok and r.returncode != 0:
        print(f"FAIL: flux8 {' '.join(args)} exited {r.returncode}\n{r.stdout}{r.stderr}")
        sys.exit(1)
    return r


def expect_error(args, *needles):
    r = flux8(*args, expect_ok=False)
    check(r.returncode != 0, f"flux8 {' '.join(args)} succeeded; it should fail")
    for n in needles:
        check(n in r.stderr, f"flux8 {' '.join(args)}: error lacks {n!r}:\n{r.stderr}")


def is_block_linear(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and name.startswith(("double_blocks.", "single_blocks."))


def f32_via_f64(code: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    return (code.to(torch.float64) * scale.to(torch.float64)).to(torch.float32).numpy()


def make_inputs(rng, path):
    B, Li, Lt = 2, 6, 3
    img_ids = np.zeros((Li, 3), np.float32)
    img_ids[:, 1], img_ids[:, 2] = np.arange(Li) // 3, np.arange(Li) % 3   # 2x3 grid, row-major
    x = dict(img=rng.standard_normal((B, Li, CIN)), img_ids=img_ids,
             txt=rng.standard_normal((B, Lt, CTX)), txt_ids=np.zeros((Lt, 3)),
             timesteps=np.array([0.3, 0.85]), y=rng.standard_normal((B, VEC)), guidance=np.array([3.5, 1.5]))
    x = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in x.items()}
    save_file(x, path)
    return x


def forward(weights, inputs, out, *extra) -> np.ndarray:
    flux8("forward", "-c", CONFIG, *SET, *extra, "--checkpoint", weights, "--inputs", inputs, "--out", out)
    return load_file(out)["pred"]


def check_diffusers_folder(folder, names):
    files = sorted(os.listdir(folder))
    shards = [f for f in files if f.startswith("diffusion_pytorch_model-")]
    check(len(shards) >= 3, f"{folder}: {len(shards)} shards at {SHARD_LIMIT} bytes; expected several")
    check(set(files) == set(shards) | {"config.json", "diffusion_pytorch_model.safetensors.index.json"},
          f"{folder}: unexpected files {files}")
    for i, s in enumerate(shards):
        check(s == f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors", f"shard name {s}")
    with open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json")) as f:
        index = json.load(f)
    wm = index["weight_map"]
    check(set(wm) == set(names), f"index weight_map names differ: {sorted(set(wm) ^ set(names))[:5]}")
    total = 0
    for s in shards:
        with safe_open(os.path.join(folder, s), framework="np") as f:
            keys = list(f.keys())
            size = sum(int(np.prod(f.get_slice(k).get_shape())) * 4 for k in keys)
        total += size
        check(size <= SHARD_LIMIT or len(keys) == 1, f"{s}: {size} bytes of {len(keys)} tensors > {SHARD_LIMIT}")
        for k in keys:
            check(wm.get(k) == s, f"index puts {k} in {wm.get(k)}, the file is in {s}")
    check(index["metadata"]["total_size"] == total, f"total_size {index['metadata']['total_size']} != {total}")
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    want = dict(_class_name="FluxTransformer2DModel", patch_size=1, in_channels=CIN, num_layers=1,
                num_single_layers=1, attention_head_dim=12, num_attention_heads=2, joint_attention_dim=CTX,
                pooled_projection_dim=VEC, guidance_embeds=True, axes_dims_rope=[2, 4, 6])
    for k, v in want.items():
        check(cfg.get(k) == v, f"config.json {k} = {cfg.get(k)!r}, expected {v!r}")


def load_diffusers(folder, dif_values, what):
    model, info = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.float32, output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        check(not info.get(key), f"{what}: from_pretrained {key}: {info.get(key)}")
    sd = model.state_dict()
    check(set(sd) == set(dif_values), f"{what}: state dict names differ")
    for k, v in dif_values.items():
        check(k in sd and np.array_equal(sd[k].numpy(), v), f"{what}: parameter {k} differs from the file")
    return model.eval()


class InF32(torch.nn.Module):
    """An f64 embedding module (tools/make_goldens.py) whose outputs are rounded to f32."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out = self.inner(x)
        return tuple(o.to(torch.float32) for o in out) if isinstance(out, tuple) else out.to(torch.float32)


def with_f64_embeddings(model):
    """diffusers computes the sinusoidal timestep and guidance embeddings from float32 arguments
    t*1000*f_k of about 10^3, whose rounding moves sin and cos by ~1e-4; flux8 computes them in
    double. The model gets the same functions evaluated in f64 and rounded to f32, so that what
    remains between the two programs is f32 arithmetic."""
    model.time_text_embed.time_proj = InF32(F64TimestepProj())
    model.pos_embed = InF32(F64PosEmbed(10000, model.config.axes_dims_rope))
    return model


def diffusers_pred(model, x) -> np.ndarray:
    t = {k: torch.from_numpy(v) for k, v in x.items()}
    with torch.no_grad():
        return model(hidden_states=t["img"], encoder_hidden_states=t["txt"], pooled_projections=t["y"],
                     timestep=t["timesteps"], img_ids=t["img_ids"], txt_ids=t["txt_ids"],
                     guidance=t["guidance"], return_dict=False)[0].numpy()


def rel(a, ref) -> float:
    return float(np.abs(a.astype(np.float64) - ref).max() / np.abs(ref).max())


def comfy_fp8(bfl: dict, legacy: bool):
    """A ComfyUI FP8 file's tensors (torch) and the f32 values flux8 must load from it."""
    out, expected, layers = {}, {}, {}
    prefix = "" if legacy else "model.diffusion_model."
    for k, v in bfl.items():
        w = torch.from_numpy(v)
        if is_block_linear(k, v.shape):
            layer = k[:-len(".weight")]
            scale = (w.abs().max().to(torch.float32) / 448.0).reshape(())
            code = (w / scale).to(torch.float8_e4m3fn)
            out[prefix + k] = code
            out[prefix + layer + (".scale_weight" if legacy else ".weight_scale")] = scale
            out[prefix + layer + (".scale_input" if legacy else ".input_scale")] = torch.tensor(1.0)
            layers[layer] = {"format": "float8_e4m3fn"}
            expected[k] = f32_via_f64(code, scale)
        elif k == "img_in.weight":   # unscaled E4M3, as the plain fp8 casts people share
            code = w.to(torch.float8_e4m3fn)
            out[prefix + k] = code
            expected[k] = code.to(torch.float32).numpy()
        else:
            out[prefix + k] = w.to(torch.bfloat16)
            expected[k] = out[prefix + k].to(torch.float32).numpy()
    meta = {"format": "pt"}
    if legacy:
        out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    else:
        meta["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
        first = sorted(layers)[0]
        out[prefix + first + ".comfy_quant"] = torch.tensor(list(json.dumps(layers[first]).encode()), dtype=torch.uint8)
    return out, meta, expected


def main():
    rng = np.random.default_rng(SEED)
    with tempfile.TemporaryDirectory(prefix="flux8_export_") as tmp:
        p = lambda name: os.path.join(tmp, name)  # noqa: E731
        flux8("init", "-c", CONFIG, *SET, "--seed", str(SEED), "--dtype", "f32", "--out", p("init.safetensors"))
        # N(0, 0.1^2) keeps the activations O(1), as in a trained model; at 0.2 diffusers' own f32
        # forward is 1e-5 away from its f64 forward (flux8's: 7e-7), which would be what is measured.
        bfl = {k: (v + 0.1 * rng.standard_normal(v.shape)).astype(np.float32)
               for k, v in load_file(p("init.safetensors")).items()}
        save_file(bfl, p("w.safetensors"))
        dif = {k: np.ascontiguousarray(v) for k, v in bfl_to_diffusers(bfl).items()}
        x = make_inputs(rng, p("in.safetensors"))

        # ---- 1-2: diffusers export, from_pretrained, forward parity ---------------------------
        flux8("export", p("w.safetensors"), "-c", CONFIG, *SET, "--format", "diffusers", "--dtype", "f32",
              "--out", p("dif32"), "--max-shard-size", str(SHARD_LIMIT))
        check_diffusers_folder(p("dif32"), dif)
        model = load_diffusers(p("dif32"), dif, "f32 export")
        stock = diffusers_pred(model, x)
        ref = diffusers_pred(with_f64_embeddings(model), x)
        check(np.abs(ref).max() > 0, "diffusers pred is zero: the comparison would check nothing")
        for weights in (p("w.safetensors"), p("dif32")):
            pred = forward(weights, p("in.safetensors"), p("out.safetensors"))
            r = rel(pred, ref)
            check(r <= PRED_TOLERANCE, f"flux8 forward of {weights} vs diffusers: {r:.3g} > {PRED_TOLERANCE}")
            print(f"flux8 forward ({os.path.basename(weights)}) vs diffusers f32: max|diff|/max|pred| = {r:.2e} "
                  f"({rel(pred, stock):.2e} against diffusers' own f32 embeddings)")

        # ---- 3: bf16 diffusers export ---------------------------------------------------------
        flux8("export", p("w.safetensors"), "-c", CONFIG, *SET, "--format", "diffusers", "--dtype", "bf16",
              "--out", p("dif16"))
        check(sorted(os.listdir(p("dif16"))) == ["config.json", "diffusion_pytorch_model.safetensors"],
              f"one-shard export: {os.listdir(p('dif16'))}")
        rounded = {k: torch.from_numpy(v).to(torch.bfloat16).to(torch.float32).numpy() for k, v in dif.items()}
        st = torch_load(os.path.join(p("dif16"), "diffusion_pytorch_model.safetensors"))
        for k, v in rounded.items():
            check(st[k].dtype == torch.bfloat16 and np.array_equal(st[k].to(torch.float32).numpy(), v),
                  f"bf16 export {k} is not the f32 value rounded to nearest even")
        m16 = FluxTransformer2DModel.from_pretrained(p("dif16"), torch_dtype=torch.float32)
        check(rel(diffusers_pred(m16, x), ref) < 0.05, "bf16 diffusers export computes something else")

        # ---- 4: BF16 import -------------------------------------------------------------------
        torch_save({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in dif.items()}, p("dif_bf16.safetensors"))
        flux8("export", p("dif_bf16.safetensors"), "-c", CONFIG, *SET, "--format", "bfl", "--dtype", "f32",
              "--out", p("from_bf16.safetensors"))
        back = load_file(p("from_bf16.safetensors"))
        want = {k: torch.from_numpy(v).to(torch.bfloat16).to(torch.float32).numpy() for k, v in bfl.items()}
        for k, v in want.items():
            check(np.array_equal(back[k], v), f"BF16 import: {k} is not the file's BF16 value")
        save_file(want, p("want_bf16.safetensors"))
        check(np.array_equal(forward(p("dif_bf16.safetensors"), p("in.safetensors"), p("o1.safetensors")),
                             forward(p("want_bf16.safetensors"), p("in.safetensors"), p("o2.safetensors"))),
              "forward of the BF16 file differs from forward of its values as F32")

        # ---- 5: ComfyUI FP8 import ------------------------------------------------------------
        for legacy in (False, True):
            tensors, meta, expected = comfy_fp8(bfl, legacy)
            name = p(f"comfy_fp8_{'legacy' if legacy else 'current'}.safetensors")
            torch_save(tensors, name, metadata=meta)
            flux8("export", name, "-c", CONFIG, *SET, "--format", "bfl", "--dtype", "f32", "--out", p("from_fp8.safetensors"))
            back = load_file(p("from_fp8.safetensors"))
            for k, v in expected.items():
                check(np.array_equal(back[k], v), f"FP8 import ({os.path.basename(name)}): {k} != code*scale")
            save_file(expected, p("want_fp8.safetensors"))
            check(np.array_equal(forward(name, p("in.safetensors"), p("o1.safetensors")),
                                 forward(p("want_fp8.safetensors"), p("in.safetensors"), p("o2.safetensors"))),
                  f"forward of {os.path.basename(name)} differs from forward of code*scale as F32")

        # ---- 6: FP8 export in ComfyUI's layout --------------------------------------------------
        flux8("export", p("w.safetensors"), "-c", CONFIG, *SET, "--format", "bfl", "--dtype", "fp8",
              "--out", p("fp8.safetensors"))
        with safe_open(p("fp8.safetensors"), framework="pt") as f:
            qmeta = json.loads((f.metadata() or {}).get("_quantization_metadata", "{}"))
        st = torch_load(p("fp8.safetensors"))
        quantized = sorted(k[:-len(".weight")] for k, v in bfl.items() if is_block_linear(k, v.shape))
        check(sorted(qmeta.get("layers", {})) == quantized, f"_quantization_metadata layers: {qmeta}")
        deq = {}
        for k, v in bfl.items():
            if is_block_linear(k, v.shape):
                code, scale = st[k], st[k[:-len(".weight")] + ".weight_scale"]
                check(code.dtype == torch.float8_e4m3fn, f"fp8 export {k} is {code.dtype}")
                check(scale.dtype == torch.float32 and scale.shape == (), f"fp8 export scale of {k}: {scale}")
                check(float(scale) == np.float32(np.abs(v).max() / np.float32(448)), f"scale of {k} is not amax/448")
                deq[k] = f32_via_f64(code, scale)
                err = np.abs(deq[k].astype(np.float64) - v)
                bound = np.maximum(np.abs(v) * 2.0 ** -4, float(scale) * 2.0 ** -10) * (1 + 1e-6)
                check((err <= bound).all(), f"fp8 export {k}: code*scale further from w than E4M3 rounding")
            else:
                check(st[k].dtype == torch.bfloat16, f"fp8 export keeps {k} as {st[k].dtype}, not BF16")
                deq[k] = st[k].to(torch.float32).numpy()
        flux8("export", p("fp8.safetensors"), "-c", CONFIG, *SET, "--format", "bfl", "--dtype", "f32",
              "--out", p("from_own_fp8.safetensors"))
        back = load_file(p("from_own_fp8.safetensors"))
        for k, v in deq.items():
            check(np.array_equal(back[k], v), f"flux8's own FP8 file: {k} read back != code*scale")

        # ---- 7: bad folders and files ------------------------------------------------------------
        folder = p("dif32")
        index_path = os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json")
        with open(index_path) as f:
            index = json.load(f)
        shard2 = sorted(f for f in os.listdir(folder) if f.startswith("diffusion_pytorch_model-"))[1]
        os.rename(os.path.join(folder, shard2), p("moved.safetensors"))
        expect_error(["forward", "-c", CONFIG, *SET, "--checkpoint", folder, "--inputs", p("in.safetensors"),
                      "--out", p("o.safetensors")], shard2, "missing")
        os.rename(p("moved.safetensors"), os.path.join(folder, shard2))
        moved = sorted(index["weight_map"])[0]
        index["weight_map"][moved] = next(s for s in set(index["weight_map"].values())
                                          if s != index["weight_map"][moved])
        with open(index_path, "w") as f:
            json.dump(index, f)
        expect_error(["export", folder, "-c", CONFIG, *SET, "--format", "bfl", "--out", p("x.safetensors")], moved)
        tensors, meta, _ = comfy_fp8(bfl, legacy=False)
        bad_scale = "model.diffusion_model.double_blocks.0.img_mlp.0.weight_scale"
        tensors[bad_scale] = torch.tensor(-1.0)
        torch_save(tensors, p("bad_scale.safetensors"), metadata=meta)
        expect_error(["export", p("bad_scale.safetensors"), "-c", CONFIG, *SET, "--format", "bfl", "--out",
                      p("x.safetensors")], bad_scale, "bad_scale.safetensors")
        tensors, meta, _ = comfy_fp8(bfl, legacy=False)
        bf16_name = "model.diffusion_model.double_blocks.0.img_mlp.0.weight"
        tensors[bf16_name] = torch.from_numpy(bfl["double_blocks.0.img_mlp.0.weight"]).to(torch.bfloat16)
        torch_save(tensors, p("scaled_bf16.safetensors"), metadata=meta)
        expect_error(["export", p("scaled_bf16.safetensors"), "-c", CONFIG, *SET, "--format", "bfl", "--out",
                      p("x.safetensors")], bf16_name, "scales FP8 weights only")

        # ---- 8: a checkpoint directory carries its config ---------------------------------------
        run = p("run")
        flux8("train", "-c", os.path.join(SRC, "configs", "demo.yaml"), *SET, "--set", f"save_dir={run}",
              "--set", f"train_data={p('data')}/train-*.tar", "--set", f"valid_data={p('data')}/val-*.tar",
              "--set", f"empty_prompt_file={p('data')}/empty_prompt", "--set", "demo_train_samples=32",
              "--set", "demo_val_samples=8", "--set", "micro_batch_size=4", "--set", "train_iters=2",
              "--set", "save_interval=2", "--set", "eval_interval=2", "--set", "backend=cpu",
              "--set", "sample_prompts=")
        trained = load_file(os.path.join(run, "step-0000002", "model.safetensors"))
        trained_dif = bfl_to_diffusers(trained)
        for source, out in ((os.path.join(run, "step-0000002"), p("from_ckpt")), (run, p("from_root"))):
            flux8("export", source, "--format", "diffusers", "--dtype", "f32", "--out", out)
            load_diffusers(out, {k: np.ascontiguousarray(v) for k, v in trained_dif.items()}, f"export of {source}")

    if failures:
        print(f"test_export_import: {failures} check(s) failed")
        return 1
    print("test_export_import: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
