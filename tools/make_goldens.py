#!/usr/bin/env python3
"""Make tests/golden/flux_tiny_diffusers.safetensors: a float64 forward + backward of a tiny
Flux transformer computed by Hugging Face diffusers' FluxTransformer2DModel (an implementation
nobody on the flux8 team wrote), with every tensor also given in BFL checkpoint naming.

Usage (from the repository root, wherever torch + diffusers are installed):
    python3 tools/make_goldens.py [--out tests/golden/flux_tiny_diffusers.safetensors]

Made with: Python 3.11.7, torch 2.15.0+cu132 (run on CPU), diffusers 0.42.1, numpy 2.4.6,
safetensors 0.8.0, huggingface_hub 2.4.0. Other versions should give the same numbers to
~1e-15 relative; if diffusers renames modules, tools/flux_names.py's asserts fail loudly.

What it does
  1. builds FluxTransformer2DModel(patch_size=1, in_channels=6, num_layers=2,
     num_single_layers=2, attention_head_dim=12, num_attention_heads=2, joint_attention_dim=10,
     pooled_projection_dim=7, guidance_embeds=True, axes_dims_rope=(2,4,6)) in float64 and sets
     every parameter to seeded random values (weights N(0, 0.3^2), biases N(0, 0.2^2), norm
     scales 1 + N(0, 0.2^2)), so nothing is trivially zero or one;
  2. makes the three places where stock diffusers computes in float32 even in a float64 model
     compute in float64 instead (see "Precision" below), after checking that each replacement
     computes the same function as the diffusers original;
  3. runs forward (B=2, 5 image tokens on a 2x3 grid cut row-major, 3 text tokens), loss =
     mean(pred * probe), backward;
  4. converts parameters and gradients to BFL names (tools/flux_names.py) and checks the
     prediction against tools/flux_numpy_ref.py (NumPy float64 from docs/FLUX.md) to 1e-10,
     and every BFL gradient against central finite differences of that NumPy model;
  5. writes the safetensors file (all F64) — see tests/golden/README.md for its contents.

Precision. With model.double(), diffusers 0.42.1 still rounds to float32 in:
  * get_timestep_embedding (Timesteps): frequencies, t*1000*f and sin/cos in float32 (the
    argument t*1000 ~ 1e3 loses ~6e-5 absolute — the largest error);
  * FluxPosEmbed: the cos/sin tables are cast to float32 (positions pos = ids.float());
  * apply_rotary_emb: computes x.float()*cos + rot(x).float()*sin, i.e. rotated q/k in float32.
BFL's reference does the same (fp32 timestep embedding and RoPE) — this is intended mixed
precision, not a bug. For a float64 golden we swap in float64 versions of exactly these three
functions (same formulas; checked below: the RoPE rotation exactly on integer inputs, the
tables/embeddings to float32 rounding). The stock-vs-float64 difference is printed and stored
in the metadata ("stock_diffusers_max_abs_diff").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys

import numpy as np
import torch
from torch import nn

import diffusers
import safetensors
from diffusers import FluxTransformer2DModel
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flux_names import bfl_to_diffusers, diffusers_to_bfl  # noqa: E402
import flux_numpy_ref  # noqa: E402

import diffusers.models.transformers.transformer_flux as tf_flux  # noqa: E402
from diffusers.models.embeddings import apply_rotary_emb as diffusers_apply_rotary_emb  # noqa: E402

SEED = 20250101
B, LI, LT = 2, 5, 3
GRID = (2, 3)                    # 2x3 latent grid, first 5 tokens in row-major order

DIFFUSERS_CFG = dict(patch_size=1, in_channels=6, num_layers=2, num_single_layers=2,
                     attention_head_dim=12, num_attention_heads=2, joint_attention_dim=10,
                     pooled_projection_dim=7, guidance_embeds=True, axes_dims_rope=(2, 4, 6))

# flux8 YAML key names
FLUX8_CFG = dict(hidden_size=24, num_attention_heads=2, num_double_blocks=2, num_single_blocks=2,
                 in_channels=6, out_channels=6, context_dim=10, vec_dim=7, mlp_ratio=4.0,
                 guidance_embed=True, qkv_bias=True, axes_dim=[2, 4, 6], rope_theta=10000,
                 qk_norm_eps=1e-6, layernorm_eps=1e-6)


# ----------------------------------------------------------------------------------------------
# float64 replacements for diffusers' float32 islands (same formulas, float64 throughout)

class F64TimestepProj(nn.Module):
    """emb = [cos(t f), sin(t f)], f_k = exp(-ln(10000) k / 128), k < 128 (t already x1000)."""

    def __init__(self, dim=256, max_period=10000.0):
        super().__init__()
        self.dim, self.max_period = dim, max_period

    def forward(self, t):
        half = self.dim // 2
        f = torch.exp(-math.log(self.max_period)
                      * torch.arange(half, dtype=torch.float64, device=t.device) / half)
        a = t.to(torch.float64)[:, None] * f[None, :]
        return torch.cat([torch.cos(a), torch.sin(a)], dim=-1)


class F64PosEmbed(nn.Module):
    """Per axis i of width d: omega_k = theta^(-2k/d); tables [S, D] with each pair's value
    repeated twice (cos/sin for elements 2p and 2p+1), axes concatenated."""

    def __init__(self, theta, axes_dim):
        super().__init__()
        self.theta, self.axes_dim = float(theta), list(axes_dim)

    def forward(self, ids):
        pos = ids.to(torch.float64)
        ang = []
        for i, d in enumerate(self.axes_dim):
            omega = self.theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=ids.device) / d)
            ang.append(pos[:, i:i + 1] * omega[None, :])
        ang = torch.cat(ang, dim=-1).repeat_interleave(2, dim=-1)
        return torch.cos(ang), torch.sin(ang)


def f64_apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """out[2p] = x[2p] cos - x[2p+1] sin; out[2p+1] = x[2p+1] cos + x[2p] sin (adjacent pairs),
    in x's dtype (float64 here). Only the variant Flux uses (use_real, unbind -1)."""
    assert use_real and use_real_unbind_dim == -1
    cos, sin = freqs_cis
    if sequence_dim == 1:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    elif sequence_dim == 2:
        cos, sin = cos[None, None, :, :], sin[None, None, :, :]
    else:
        raise ValueError(sequence_dim)
    cos, sin = cos.to(x), sin.to(x)
    rot = torch.empty_like(x)
    rot[..., 0::2] = -x[..., 1::2]
    rot[..., 1::2] = x[..., 0::2]
    return x * cos + rot * sin


def check_replacements(model):
    """Each float64 replacement computes the diffusers original's function."""
    g = torch.Generator().manual_seed(1)
    # RoPE rotation: exact on small integers (float32 is exact there)
    x = torch.randint(-8, 9, (2, 7, 3, 12), generator=g).double()
    c = torch.randint(-3, 4, (7, 6), generator=g).double().repeat_interleave(2, dim=-1)
    s = torch.randint(-3, 4, (7, 6), generator=g).double().repeat_interleave(2, dim=-1)
    ref = diffusers_apply_rotary_emb(x, (c.float(), s.float()), sequence_dim=1)
    mine = f64_apply_rotary_emb(x, (c, s), sequence_dim=1)
    assert torch.equal(ref, mine), "RoPE rotation convention differs from diffusers"
    # RoPE tables: equal up to float32 rounding
    ids = torch.tensor([[0, 0, 0]] * 3 + [[0, r, c_] for r in range(4) for c_ in range(5)],
                       dtype=torch.float64)
    ids[:, 0] = torch.arange(ids.shape[0]) % 2
    rc, rs = model.pos_embed(ids)
    mc, ms = F64PosEmbed(10000, DIFFUSERS_CFG["axes_dims_rope"])(ids)
    assert rc.dtype == torch.float32            # the stock float32 island
    assert (rc.double() - mc).abs().max() < 1e-6 and (rs.double() - ms).abs().max() < 1e-6
    # timestep embedding: equal up to float32 argument rounding (args up to ~1e4 here)
    t = torch.tensor([0.0, 1.0, 37.5, 250.0, 999.0, 3500.0], dtype=torch.float64)
    r = model.time_text_embed.time_proj(t)
    m = F64TimestepProj()(t)
    assert r.shape == m.shape == (6, 256)
    assert (r.double() - m).abs().max() < 2e-3, (r.double() - m).abs().max()
    # ...and exact in structure: with t = 0 it is [1]*128 + [0]*128 (cos first)
    assert torch.equal(r[0].double(), m[0])


# ----------------------------------------------------------------------------------------------

def set_random_params(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith(".bias"):
                p.copy_(0.2 * z)
            elif p.ndim == 1:                    # RMSNorm scales (norm_q, norm_k, ...)
                p.copy_(1.0 + 0.2 * z)
            else:
                p.copy_(0.3 * z)


def make_inputs(gen):
    d = DIFFUSERS_CFG
    img = torch.randn(B, LI, d["in_channels"], generator=gen, dtype=torch.float64)
    txt = torch.randn(B, LT, d["joint_attention_dim"], generator=gen, dtype=torch.float64)
    y = torch.randn(B, d["pooled_projection_dim"], generator=gen, dtype=torch.float64)
    timesteps = torch.rand(B, generator=gen, dtype=torch.float64)
    guidance = torch.tensor([3.5, 1.25], dtype=torch.float64)
    img_ids = torch.tensor([[0, r, c] for r in range(GRID[0]) for c in range(GRID[1])][:LI],
                           dtype=torch.float64)
    txt_ids = torch.zeros(LT, 3, dtype=torch.float64)
    probe = torch.randn(B, LI, d["in_channels"], generator=gen, dtype=torch.float64)
    return dict(img=img, img_ids=img_ids, txt=txt, txt_ids=txt_ids, timesteps=timesteps, y=y,
                guidance=guidance, probe=probe)


def run_model(model, inp):
    return model(hidden_states=inp["img"], encoder_hidden_states=inp["txt"],
                 pooled_projections=inp["y"], timestep=inp["timesteps"], img_ids=inp["img_ids"],
                 txt_ids=inp["txt_ids"], guidance=inp["guidance"], return_dict=False)[0]


def numpy_forward(params_bfl, inp_np):
    return flux_numpy_ref.flux_forward(params_bfl, FLUX8_CFG, inp_np["img"], inp_np["img_ids"],
                                       inp_np["txt"], inp_np["txt_ids"], inp_np["timesteps"],
                                       inp_np["y"], inp_np["guidance"])


def finite_difference_check(params_bfl, grads_bfl, inp_np, per_tensor=3, h=1e-5, seed=7):
    """Central differences of the NumPy model's loss for a few elements of every BFL tensor."""
    rng = np.random.default_rng(seed)
    probe = inp_np["probe"]

    def loss(p):
        return float(np.mean(numpy_forward(p, inp_np) * probe))

    worst = 0.0
    gmax = max(float(np.abs(g).max()) for g in grads_bfl.values())
    for name in sorted(params_bfl):
        p0 = params_bfl[name]
        flat_idx = rng.choice(p0.size, size=min(per_tensor, p0.size), replace=False)
        for fi in flat_idx:
            idx = np.unravel_index(fi, p0.shape)
            p = dict(params_bfl)
            for sign, store in ((1, "plus"), (-1, "minus")):
                q = p0.copy()
                q[idx] += sign * h
                p[name] = q
                if store == "plus":
                    lp = loss(p)
                else:
                    lm = loss(p)
            fd = (lp - lm) / (2 * h)
            g = float(grads_bfl[name][idx])
            err = abs(fd - g) / max(abs(g), 1e-3 * gmax)
            worst = max(worst, err)
            assert err < 1e-6, f"grad mismatch {name}{idx}: autograd {g!r} vs finite diff {fd!r}"
    return worst


def check_flux_dev_param_count():
    """diffusers' default (12B dev / schnell) configs have docs/FLUX.md's exact parameter counts."""
    with torch.device("meta"):
        dev = FluxTransformer2DModel(guidance_embeds=True)
        schnell = FluxTransformer2DModel(guidance_embeds=False)
    n_dev = sum(p.numel() for p in dev.parameters())
    n_sch = sum(p.numel() for p in schnell.parameters())
    assert n_dev == 11_901_408_320, n_dev
    assert n_sch == 11_891_178_560, n_sch
    # the name map covers the full-size model and gives docs/FLUX.md's BFL shapes
    bfl = diffusers_to_bfl(dict(dev.state_dict()))
    want = {"double_blocks.18.img_attn.qkv.weight": (9216, 3072),
            "double_blocks.0.img_attn.norm.query_norm.scale": (128,),
            "double_blocks.0.img_mod.lin.weight": (18432, 3072),
            "single_blocks.37.linear1.weight": (21504, 3072),
            "single_blocks.0.linear2.weight": (3072, 15360),
            "final_layer.adaLN_modulation.1.weight": (6144, 3072),
            "final_layer.linear.weight": (64, 3072)}
    for k, shp in want.items():
        assert tuple(bfl[k].shape) == shp, (k, tuple(bfl[k].shape))
    assert sum(v.numel() for v in bfl.values()) == n_dev
    return n_dev, n_sch


def precision_study(params_d, inp, gold):
    """How far a float32 model lands from the float64 golden (relative to max|pred|), with the
    sinusoidal timestep/guidance embedding and the RoPE tables/rotation in float32 (stock) or
    computed in float64 and then rounded to float32."""
    scale = float(np.abs(gold).max())
    stock_rope = tf_flux.apply_rotary_emb
    rows = []
    for f64_time in (False, True):
        for f64_rope in (False, True):
            m = FluxTransformer2DModel(**DIFFUSERS_CFG).double()
            m.load_state_dict({k: torch.from_numpy(v) for k, v in params_d.items()})
            m = m.float()
            if f64_time:
                tp = F64TimestepProj()
                m.time_text_embed.time_proj = _Cast(lambda t: tp(t.double()))
            if f64_rope:
                pe = F64PosEmbed(10000, DIFFUSERS_CFG["axes_dims_rope"])
                m.pos_embed = _Cast(lambda ids: pe(ids))
            tf_flux.apply_rotary_emb = f64_apply_rotary_emb if f64_rope else stock_rope
            x = {k: (v if k.endswith("_ids") else v.float()) for k, v in inp.items()}
            with torch.no_grad():
                p = run_model(m, x).double().numpy()
            rows.append((f64_time, f64_rope, float(np.abs(p - gold).max()) / scale))
    tf_flux.apply_rotary_emb = f64_apply_rotary_emb
    for f64_time, f64_rope, r in rows:
        print(f"  float32 model, t/guidance embedding {'f64->f32' if f64_time else 'fp32    '}, "
              f"RoPE {'f64->f32' if f64_rope else 'fp32    '}: max rel err {r:.3g}")


class _Cast(nn.Module):
    """Wraps a float64 function; casts its output(s) to float32."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        y = self.fn(x)
        return tuple(t.float() for t in y) if isinstance(y, tuple) else y.float()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "golden",
                                                  "flux_tiny_diffusers.safetensors"))
    ap.add_argument("--precision-study", action="store_true",
                    help="also report how far float32 variants of the model land from the golden")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)                     # deterministic reduction order

    versions = dict(python=platform.python_version(), torch=torch.__version__,
                    diffusers=diffusers.__version__, numpy=np.__version__,
                    safetensors=safetensors.__version__)
    print("versions:", versions)
    n_dev, n_sch = check_flux_dev_param_count()
    print(f"diffusers full-size param counts match docs/FLUX.md: dev {n_dev:,}, schnell {n_sch:,}")

    gen = torch.Generator().manual_seed(SEED)
    model = FluxTransformer2DModel(**DIFFUSERS_CFG).double()
    model.eval()
    set_random_params(model, gen)
    inp = make_inputs(gen)
    assert not any(True for _ in model.buffers()), "unexpected buffers"
    print("diffusers state_dict keys:")
    for k, v in model.state_dict().items():
        print(f"  {k} {tuple(v.shape)}")

    # --- stock diffusers (float32 islands), for the record
    check_replacements(model)
    with torch.no_grad():
        pred_stock = run_model(model, inp)

    # --- float64 everywhere
    model.time_text_embed.time_proj = F64TimestepProj()
    model.pos_embed = F64PosEmbed(10000, DIFFUSERS_CFG["axes_dims_rope"])
    tf_flux.apply_rotary_emb = f64_apply_rotary_emb
    pred = run_model(model, inp)
    assert pred.dtype == torch.float64 and pred.shape == (B, LI, DIFFUSERS_CFG["in_channels"])
    loss = (pred * inp["probe"]).mean()
    loss.backward()
    stock_diff = float((pred_stock - pred.detach()).abs().max())
    print(f"pred max|.| = {float(pred.detach().abs().max()):.4g}; stock diffusers (fp32 islands) vs float64: "
          f"max abs diff {stock_diff:.3g}")
    assert 0 < stock_diff < 1e-2

    params_d = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
    grads_d = {k: v.grad.detach().numpy().copy() for k, v in model.named_parameters()}
    assert set(params_d) == set(model.state_dict())
    params_b = diffusers_to_bfl(params_d)
    grads_b = diffusers_to_bfl(grads_d)
    back = bfl_to_diffusers(params_b)
    assert set(back) == set(params_d) and all(np.array_equal(back[k], params_d[k]) for k in back)
    n_values = sum(v.size for v in params_d.values())
    assert n_values == sum(v.size for v in params_b.values())

    # --- independent check: NumPy float64 model from docs/FLUX.md on the BFL tensors
    inp_np = {k: v.numpy() for k, v in inp.items()}
    pred_np = numpy_forward(params_b, inp_np)
    pred_t = pred.detach().numpy()
    err = float(np.abs(pred_np - pred_t).max())
    rel = err / float(np.abs(pred_t).max())
    print(f"NumPy docs/FLUX.md reference vs diffusers(float64): max abs diff {err:.3g} (rel {rel:.3g})")
    assert rel < 1e-10, "NumPy reference disagrees with diffusers"
    loss_np = float(np.mean(pred_np * inp_np["probe"]))
    assert abs(loss_np - loss.item()) <= 1e-12 * max(1.0, abs(loss_np))
    worst = finite_difference_check(params_b, grads_b, inp_np)
    print(f"gradients vs NumPy central differences: worst relative error {worst:.3g}")

    # --- write
    tensors = {}
    for k, v in inp.items():
        tensors[f"input.{k}"] = v.numpy()
    for k, v in params_b.items():
        tensors[f"param.{k}"] = v
    for k, v in params_d.items():
        tensors[f"diffusers.{k}"] = v
    tensors["output.pred"] = pred_t
    tensors["output.loss"] = np.array([loss.item()])
    for k, v in grads_b.items():
        tensors[f"grad.{k}"] = v
    tensors = {k: np.ascontiguousarray(v, dtype=np.float64) for k, v in tensors.items()}
    meta = {
        "config": json.dumps(FLUX8_CFG),
        "generator": json.dumps(dict(
            tool="tools/make_goldens.py", model="diffusers FluxTransformer2DModel",
            diffusers_config={k: (list(v) if isinstance(v, tuple) else v)
                              for k, v in DIFFUSERS_CFG.items()},
            versions=versions, seed=SEED, loss="mean(pred * probe)",
            timesteps_and_guidance="raw values; the model multiplies both by 1000",
            precision="float64 throughout; diffusers' float32 timestep embedding / RoPE tables / "
                      "RoPE rotation replaced by float64 versions of the same formulas",
            stock_diffusers_max_abs_diff=stock_diff,
            numpy_reference_max_abs_diff=err,
            num_parameters=n_values)),
    }
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    save_file(tensors, out, metadata=meta)
    size = os.path.getsize(out)
    print(f"wrote {out}: {len(tensors)} tensors, {n_values} parameters, {size:,} bytes")
    assert size <= 2 * 1024 * 1024, "golden file over 2 MB"
    if args.precision_study:
        print("precision study (float32 runs vs this float64 golden):")
        precision_study(params_d, inp, pred_t)


if __name__ == "__main__":
    main()
