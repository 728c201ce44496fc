#!/usr/bin/env python3
"""End-to-end parity check of the flux8 binary against Hugging Face diffusers' FluxTransformer2DModel.

Unlike tests/golden (a stored file), this runs both programs now, on weights and inputs that
only exist as safetensors files between them, so it also covers the file formats and the
diffusers<->BFL name map in both directions. Needs torch + diffusers (see tests/golden/README.md).

    python3 tools/check_against_diffusers.py [--flux8 build-py/flux8] [--loss-grad]
           [--weights W.safetensors] [--no-guidance] [--seed N] [--keep DIR]

Two weight sources, each checked (both by default):
  diffusers-random   a FluxTransformer2DModel with every parameter seeded random (weights
                     N(0,0.3^2), biases N(0,0.2^2), norm scales 1+N(0,0.2^2)); its state_dict is
                     saved under diffusers names and given to `flux8 forward --checkpoint`.
  flux8-init         `flux8 init --naming diffusers --dtype f32`, perturbed in NumPy (+N(0,0.2^2)
                     on every value, since MLPerf init zeroes the modulation and final layer,
                     which would make pred identically zero), then loaded into diffusers with
                     load_state_dict(strict=True). The unperturbed file must load strictly too.
  --weights W        a flux8-written file (either naming, any dtype) used as is, instead of
                     both; it must have DIFFUSERS_CFG's shapes (H=48, 2+2 blocks, in 16, text 32,
                     pooled 24, guidance; flux8_overrides() prints as --set flags), and must
                     not be a raw `flux8 init` file (its zero final layer makes pred zero).

For each, flux8 runs at --precision f64 and f32 and diffusers runs in float64 twice: stock (its
sinusoidal timestep/guidance embedding, RoPE tables and RoPE rotation are float32 even in a
float64 model; tests/golden/README.md) and with those three computed in float64 (the
replacements from tools/make_goldens.py, which checks they compute the same functions).
Reported: max |flux8 - diffusers| / max |diffusers| for pred, loss and (with --loss-grad) per
gradient tensor (BFL names; diffusers gradients mapped with tools/flux_names.py).

Expected (reasons in tests/golden/README.md, "Precision" and "Tolerances"):
  flux8 f64 vs diffusers float64 with f64 embeddings: ~1e-7, the f32 rounding of flux8's output
      file (flux8 writes pred and grads as F32 even at --precision f64);
  flux8 f64 vs stock diffusers: ~1e-5 to 1e-4, diffusers' float32 timestep embedding
      (arguments ~1e3 rounded to float32) — flux8 computes that embedding in double;
  flux8 f32: ~1e-6 to 1e-5 for pred (fp32 rounding through ~20 sequential ops).
Fails (exit 1) if pred is identically zero, or if flux8 f64 vs diffusers with f64 embeddings exceeds 1e-5 for pred or 1e-4 for
any gradient: both sides then compute the same float64 function from the same bits, so
anything above float32 output rounding times a small growth factor is a real disagreement.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from diffusers import FluxTransformer2DModel
from safetensors.numpy import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from flux_names import diffusers_to_bfl  # noqa: E402
import diffusers.models.transformers.transformer_flux as tf_flux  # noqa: E402
from make_goldens import F64PosEmbed, F64TimestepProj, f64_apply_rotary_emb  # noqa: E402

STOCK_ROPE = tf_flux.apply_rotary_emb

# A little larger than the golden (H=48, 2+2 blocks, 12 image tokens on a 3x4 grid).
DIFFUSERS_CFG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                     attention_head_dim=24, num_attention_heads=2, joint_attention_dim=32,
                     pooled_projection_dim=24, guidance_embeds=True, axes_dims_rope=(4, 10, 10))
B, GRID, LT = 2, (3, 4), 4
BASE_CONFIG = os.path.join(ROOT, "configs", "models", "flux_tiny_demo.yaml")

# f64 flux8 vs f64 diffusers (f64 embeddings): see the module docstring.
PRED_LIMIT, GRAD_LIMIT = 1e-5, 1e-4


def flux8_overrides(d: dict) -> list[str]:
    kv = dict(hidden_size=d["attention_head_dim"] * d["num_attention_heads"],
              num_attention_heads=d["num_attention_heads"], num_double_blocks=d["num_layers"],
              num_single_blocks=d["num_single_layers"], in_channels=d["in_channels"],
              out_channels=d["in_channels"], context_dim=d["joint_attention_dim"],
              vec_dim=d["pooled_projection_dim"], mlp_ratio=4.0,
              guidance_embed=str(d["guidance_embeds"]).lower(), qkv_bias="true",
              axes_dim="[" + ",".join(map(str, d["axes_dims_rope"])) + "]", rope_theta=10000.0)
    return [a for k, v in kv.items() for a in ("--set", f"{k}={v}")]


def run_flux8(binary, *args):
    cmd = [binary, *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")


def make_inputs(rng, d):
    Li = GRID[0] * GRID[1]
    img_ids = np.array([[0, r, c] for r in range(GRID[0]) for c in range(GRID[1])], np.float32)
    x = dict(img=rng.standard_normal((B, Li, d["in_channels"])), img_ids=img_ids,
             txt=rng.standard_normal((B, LT, d["joint_attention_dim"])), txt_ids=np.zeros((LT, 3)),
             timesteps=rng.uniform(0, 1, B), y=rng.standard_normal((B, d["pooled_projection_dim"])),
             probe=rng.standard_normal((B, Li, d["in_channels"])))
    if d["guidance_embeds"]:
        x["guidance"] = np.array([3.5, 1.25][:B])
    # f32 values so that both programs see the same numbers whatever they compute in
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in x.items()}


def random_diffusers_params(d, seed):
    gen = torch.Generator().manual_seed(seed)
    model = FluxTransformer2DModel(**d)
    out = {}
    for name, p in model.state_dict().items():
        z = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        v = 0.2 * z if name.endswith(".bias") else (1.0 + 0.2 * z if p.ndim == 1 else 0.3 * z)
        out[name] = v.numpy().astype(np.float32)
    return out


def diffusers_run(params_d, inp, d, f64_embeddings: bool, grads: bool):
    """float64 diffusers forward (+ backward of mean(pred*probe)); strict state-dict load."""
    model = FluxTransformer2DModel(**d).double()
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in params_d.items()},
                          strict=True)
    if f64_embeddings:
        model.time_text_embed.time_proj = F64TimestepProj()
        model.pos_embed = F64PosEmbed(10000, d["axes_dims_rope"])
    tf_flux.apply_rotary_emb = f64_apply_rotary_emb if f64_embeddings else STOCK_ROPE
    try:
        t = {k: torch.from_numpy(v.astype(np.float64)) for k, v in inp.items()}
        pred = model(hidden_states=t["img"], encoder_hidden_states=t["txt"],
                     pooled_projections=t["y"], timestep=t["timesteps"], img_ids=t["img_ids"],
                     txt_ids=t["txt_ids"], guidance=t.get("guidance"), return_dict=False)[0]
        loss = (pred * t["probe"]).mean()
        g = {}
        if grads:
            loss.backward()
            g = diffusers_to_bfl({k: p.grad.numpy().copy() for k, p in model.named_parameters()})
    finally:
        tf_flux.apply_rotary_emb = STOCK_ROPE
    return pred.detach().numpy(), loss.item(), g


def rel(a, ref):
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-300))


def compare(label, f8, dif, grads):
    pred_d, loss_d, g_d = dif
    r_pred = rel(f8["pred"], pred_d)
    r_loss = rel(f8["loss"], [loss_d])
    line = f"  {label:44s} pred {r_pred:8.2e}  loss {r_loss:8.2e}"
    r_grad = {}
    if grads:
        assert set(g_d) == {k[5:] for k in f8 if k.startswith("grad.")}, "gradient names differ"
        r_grad = {k: rel(f8[f"grad.{k}"], v) for k, v in g_d.items()}
        worst = max(r_grad, key=r_grad.get)
        line += (f"  grads median {np.median(list(r_grad.values())):8.2e} "
                 f"worst {r_grad[worst]:8.2e} ({worst})")
    print(line)
    return r_pred, max(r_grad.values(), default=0.0)


def check_case(name, params_d, inp, d, args, tmp):
    print(f"{name}: {len(params_d)} diffusers tensors, "
          f"{sum(v.size for v in params_d.values()):,} parameters")
    ckpt = os.path.join(tmp, f"{name}.safetensors")
    save_file(params_d, ckpt, metadata={"format": "pt"})
    inputs = os.path.join(tmp, "inputs.safetensors")
    extra = ["--loss-grad"] if args.loss_grad else []
    f8 = {}
    for prec in ("f64", "f32"):
        out = os.path.join(tmp, f"{name}_out_{prec}.safetensors")
        run_flux8(args.flux8, "forward", "-c", BASE_CONFIG, *flux8_overrides(d), "--checkpoint", ckpt,
                  "--inputs", inputs, "--out", out, "--precision", prec, *extra)
        f8[prec] = load_file(out)
    if not args.loss_grad:   # loss is only written with --loss-grad: recompute for the report
        for o in f8.values():
            o["loss"] = np.array([np.mean(o["pred"].astype(np.float64) * inp["probe"])])
    dif = {emb: diffusers_run(params_d, inp, d, emb, args.loss_grad) for emb in (True, False)}
    print(f"  max|pred| (diffusers) = {np.abs(dif[True][0]).max():.4g}")
    if not np.abs(dif[True][0]).max() > 0:
        print("  FAIL: pred is identically zero (MLPerf init zeroes the final layer), so a "
              "comparison would check nothing; perturb the weights first")
        return False
    worst = None
    for prec in ("f64", "f32"):
        for emb in (True, False):
            label = (f"flux8 {prec} vs diffusers f64 "
                     + ("with f64 embeddings" if emb else "stock (f32 t-emb)"))
            r = compare(label, f8[prec], dif[emb], args.loss_grad)
            if prec == "f64" and emb:
                worst = r
    r_st = rel(dif[False][0], dif[True][0])
    print(f"  {'stock diffusers vs f64-embedding diffusers':44s} pred {r_st:8.2e}")
    ok = worst[0] <= PRED_LIMIT and worst[1] <= GRAD_LIMIT
    if not ok:
        print(f"  FAIL: flux8 f64 vs diffusers f64 exceeds {PRED_LIMIT:g} (pred) / {GRAD_LIMIT:g} (grads)")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flux8", default=os.path.join(ROOT, "build-py", "flux8"))
    ap.add_argument("--loss-grad", action="store_true", help="also compare loss gradients")
    ap.add_argument("--weights", help="flux8-written weights (reference or diffusers names) to use as is")
    ap.add_argument("--no-guidance", action="store_true", help="schnell-like model (no guidance_in)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", help="write the intermediate files here instead of a temp dir")
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = dict(DIFFUSERS_CFG, guidance_embeds=not args.no_guidance)
    rng = np.random.default_rng(args.seed)
    inp = make_inputs(rng, d)

    with tempfile.TemporaryDirectory(prefix="flux8_vs_diffusers_") as tmpdir:
        tmp = args.keep or tmpdir
        os.makedirs(tmp, exist_ok=True)
        save_file(inp, os.path.join(tmp, "inputs.safetensors"))
        cases = []
        if args.weights:
            from safetensors.torch import load_file as torch_load_file   # reads bf16 too
            w = {k: v.float().numpy() for k, v in torch_load_file(args.weights).items()}
            if "img_in.weight" in w:                     # reference names -> diffusers
                from flux_names import bfl_to_diffusers
                w = bfl_to_diffusers(w)
            cases.append(("given", {k: v.astype(np.float32) for k, v in w.items()}))
        else:
            cases.append(("diffusers-random", random_diffusers_params(d, args.seed)))
            init = os.path.join(tmp, "flux8_init_diffusers.safetensors")
            run_flux8(args.flux8, "init", "-c", BASE_CONFIG, *flux8_overrides(d), "--seed", str(args.seed),
                      "--dtype", "f32", "--naming", "diffusers", "--out", init)
            w = load_file(init)
            # flux8's own file, unperturbed, loads strictly into diffusers (names and shapes)
            FluxTransformer2DModel(**d).load_state_dict(
                {k: torch.from_numpy(v) for k, v in w.items()}, strict=True)
            print(f"flux8 init --naming diffusers: {len(w)} tensors load into diffusers with strict=True")
            cases.append(("flux8-init-perturbed",
                          {k: (v + 0.2 * rng.standard_normal(v.shape)).astype(np.float32)
                           for k, v in sorted(w.items())}))
        ok = all([check_case(n, p, inp, d, args, tmp) for n, p in cases])
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
