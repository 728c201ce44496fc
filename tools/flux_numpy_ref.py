#!/usr/bin/env python3
"""Direct NumPy float64 forward pass of the Flux transformer, written from flux8's
docs/FLUX.md (BFL Flux.1 conventions), on parameters in BFL checkpoint naming.

Independent of diffusers and torch: used by tools/make_goldens.py to check that the diffusers
model + the name map in tools/flux_names.py agree with the conventions flux8 implements.
Everything is float64 (docs/FLUX.md's fp32 islands — RoPE rotation, QK RMSNorm — are exact here).

    pred = flux_forward(params, cfg, img, img_ids, txt, txt_ids, timesteps, y, guidance)

cfg keys (flux8 YAML names): hidden_size, num_attention_heads, num_double_blocks,
num_single_blocks, mlp_ratio, guidance_embed, axes_dim, rope_theta, qk_norm_eps, layernorm_eps.
Shapes: img [B,Li,Cin], img_ids [Li,3], txt [B,Lt,Ctx], txt_ids [Lt,3], timesteps [B] in [0,1],
y [B,vec_dim], guidance [B] (raw, e.g. 3.5) or None.
"""
from __future__ import annotations

import math

import numpy as np


def linear(p, name, x):
    return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def layernorm(x, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps)


def rmsnorm(x, scale, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def t_embedding(t, dim=256, max_period=10000.0, time_factor=1000.0):
    """[cos(t' f), sin(t' f)], t' = 1000 t, f_k = exp(-ln(max_period) k / (dim/2)). Cos first."""
    half = dim // 2
    f = np.exp(-math.log(max_period) * np.arange(half, dtype=np.float64) / half)
    a = (time_factor * np.asarray(t, dtype=np.float64))[:, None] * f[None, :]
    return np.concatenate([np.cos(a), np.sin(a)], axis=-1)


def mlp_embedder(p, name, x):
    return linear(p, f"{name}.out_layer", silu(linear(p, f"{name}.in_layer", x)))


def rope_angles(ids, axes_dim, theta):
    """ids [L, n_axes] -> angles [L, sum(axes_dim)/2]; axis i: omega_k = theta^(-2k/d_i)."""
    parts = []
    for i, d in enumerate(axes_dim):
        omega = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        parts.append(ids[:, i].astype(np.float64)[:, None] * omega[None, :])
    return np.concatenate(parts, axis=-1)


def apply_rope(x, ang):
    """x [B,H,L,D]; rotate ADJACENT pairs (2p, 2p+1) by angle ang[L, p]."""
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = c * x0 - s * x1
    out[..., 1::2] = s * x0 + c * x1
    return out


def split_heads(qkv, n_heads):
    """[B, L, 3*H] with rows [Q|K|V], each head-major -> q, k, v [B, n, L, D]."""
    B, L, three_h = qkv.shape
    D = three_h // 3 // n_heads
    t = qkv.reshape(B, L, 3, n_heads, D).transpose(2, 0, 3, 1, 4)
    return t[0], t[1], t[2]


def attention(q, k, v):
    """non-causal softmax(q k^T / sqrt(D)) v; [B,n,L,D] -> [B, L, n*D] (head-major)."""
    D = q.shape[-1]
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(D)
    s = s - s.max(-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(-1, keepdims=True)
    o = w @ v
    B, n, L, _ = o.shape
    return o.transpose(0, 2, 1, 3).reshape(B, L, n * D)


def modulate(x, shift, scale, eps):
    return (1.0 + scale[:, None, :]) * layernorm(x, eps) + shift[:, None, :]


def double_block(p, i, img, txt, vec, ang, cfg):
    b = f"double_blocks.{i}"
    n, eps_ln, eps_qk = cfg["num_attention_heads"], cfg["layernorm_eps"], cfg["qk_norm_eps"]
    sv = silu(vec)
    im = np.split(linear(p, f"{b}.img_mod.lin", sv), 6, axis=-1)   # shift1 scale1 gate1 shift2 scale2 gate2
    tm = np.split(linear(p, f"{b}.txt_mod.lin", sv), 6, axis=-1)

    def qkv(stream, x, mod):
        q, k, v = split_heads(linear(p, f"{b}.{stream}_attn.qkv", modulate(x, mod[0], mod[1], eps_ln)), n)
        q = rmsnorm(q, p[f"{b}.{stream}_attn.norm.query_norm.scale"], eps_qk)
        k = rmsnorm(k, p[f"{b}.{stream}_attn.norm.key_norm.scale"], eps_qk)
        return q, k, v

    iq, ik, iv = qkv("img", img, im)
    tq, tk, tv = qkv("txt", txt, tm)
    q = apply_rope(np.concatenate([tq, iq], axis=2), ang)             # text first
    k = apply_rope(np.concatenate([tk, ik], axis=2), ang)
    v = np.concatenate([tv, iv], axis=2)
    a = attention(q, k, v)
    Lt = txt.shape[1]
    ta, ia = a[:, :Lt], a[:, Lt:]

    img = img + im[2][:, None] * linear(p, f"{b}.img_attn.proj", ia)
    h = modulate(img, im[3], im[4], eps_ln)
    img = img + im[5][:, None] * linear(p, f"{b}.img_mlp.2", gelu_tanh(linear(p, f"{b}.img_mlp.0", h)))

    txt = txt + tm[2][:, None] * linear(p, f"{b}.txt_attn.proj", ta)
    h = modulate(txt, tm[3], tm[4], eps_ln)
    txt = txt + tm[5][:, None] * linear(p, f"{b}.txt_mlp.2", gelu_tanh(linear(p, f"{b}.txt_mlp.0", h)))
    return img, txt


def single_block(p, i, z, vec, ang, cfg):
    b = f"single_blocks.{i}"
    n, H = cfg["num_attention_heads"], cfg["hidden_size"]
    shift, scale, gate = np.split(linear(p, f"{b}.modulation.lin", silu(vec)), 3, axis=-1)
    h = linear(p, f"{b}.linear1", modulate(z, shift, scale, cfg["layernorm_eps"]))
    qkv, m = h[..., :3 * H], h[..., 3 * H:]                          # [qkv | mlp]
    q, k, v = split_heads(qkv, n)
    q = apply_rope(rmsnorm(q, p[f"{b}.norm.query_norm.scale"], cfg["qk_norm_eps"]), ang)
    k = apply_rope(rmsnorm(k, p[f"{b}.norm.key_norm.scale"], cfg["qk_norm_eps"]), ang)
    a = attention(q, k, v)
    return z + gate[:, None] * linear(p, f"{b}.linear2", np.concatenate([a, gelu_tanh(m)], axis=-1))


def flux_forward(p, cfg, img, img_ids, txt, txt_ids, timesteps, y, guidance=None):
    img = linear(p, "img_in", img)
    vec = mlp_embedder(p, "time_in", t_embedding(timesteps))
    if cfg.get("guidance_embed", False):
        assert guidance is not None, "guidance-embedded model needs guidance"
        vec = vec + mlp_embedder(p, "guidance_in", t_embedding(guidance))
    vec = vec + mlp_embedder(p, "vector_in", y)
    txt = linear(p, "txt_in", txt)
    ids = np.concatenate([txt_ids, img_ids], axis=0)
    ang = rope_angles(ids, cfg["axes_dim"], cfg["rope_theta"])
    for i in range(cfg["num_double_blocks"]):
        img, txt = double_block(p, i, img, txt, vec, ang, cfg)
    Lt = txt.shape[1]
    z = np.concatenate([txt, img], axis=1)
    for i in range(cfg["num_single_blocks"]):
        z = single_block(p, i, z, vec, ang, cfg)
    x = z[:, Lt:]
    shift, scale = np.split(linear(p, "final_layer.adaLN_modulation.1", silu(vec)), 2, axis=-1)  # shift FIRST
    return linear(p, "final_layer.linear", modulate(x, shift, scale, cfg["layernorm_eps"]))
