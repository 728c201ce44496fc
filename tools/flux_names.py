#!/usr/bin/env python3
"""Parameter-name map between diffusers' FluxTransformer2DModel and the Black Forest Labs
(BFL) Flux.1 checkpoint layout that flux8 uses (docs/FLUX.md, Tensor names).

Works on plain dicts of arrays: NumPy arrays or torch tensors (torch is only touched if the
values are torch tensors). Gradients map exactly like parameters (every transform is a row
permutation / concatenation), so the same functions convert gradient dicts.

    diffusers_to_bfl(sd)  -> dict in BFL names   (fuses q/k/v, swaps final adaLN halves)
    bfl_to_diffusers(sd)  -> dict in diffusers names (splits, swaps back)

Both assert that every input tensor is used exactly once and that every expected output name
is produced. `python3 tools/flux_names.py` runs a round-trip self-check (NumPy only).

Mapping (checked against diffusers 0.42.1 transformer_flux.py; {i} = block index):
  img_in                                  <- x_embedder
  txt_in                                  <- context_embedder
  time_in.in_layer / out_layer            <- time_text_embed.timestep_embedder.linear_1 / linear_2
  guidance_in.in_layer / out_layer        <- time_text_embed.guidance_embedder.linear_1 / linear_2
  vector_in.in_layer / out_layer          <- time_text_embed.text_embedder.linear_1 / linear_2
  double_blocks.{i}.img_mod.lin           <- transformer_blocks.{i}.norm1.linear
  double_blocks.{i}.txt_mod.lin           <- transformer_blocks.{i}.norm1_context.linear
  double_blocks.{i}.img_attn.qkv          <- cat(attn.to_q, attn.to_k, attn.to_v)            (rows)
  double_blocks.{i}.img_attn.norm.query_norm.scale / key_norm.scale <- attn.norm_q / norm_k .weight
  double_blocks.{i}.img_attn.proj         <- attn.to_out.0
  double_blocks.{i}.txt_attn.qkv          <- cat(attn.add_q_proj, add_k_proj, add_v_proj)   (rows)
  double_blocks.{i}.txt_attn.norm.query_norm.scale / key_norm.scale <- attn.norm_added_q / norm_added_k
  double_blocks.{i}.txt_attn.proj         <- attn.to_add_out
  double_blocks.{i}.img_mlp.0 / .2        <- ff.net.0.proj / ff.net.2
  double_blocks.{i}.txt_mlp.0 / .2        <- ff_context.net.0.proj / ff_context.net.2
  single_blocks.{i}.linear1               <- cat(attn.to_q, attn.to_k, attn.to_v, proj_mlp) (rows)
  single_blocks.{i}.linear2               <- proj_out
  single_blocks.{i}.norm.query_norm.scale / key_norm.scale <- attn.norm_q / norm_k .weight
  single_blocks.{i}.modulation.lin        <- norm.linear
  final_layer.adaLN_modulation.1          <- norm_out.linear with its two row halves SWAPPED
                                             (diffusers chunks [scale; shift], BFL [shift; scale])
  final_layer.linear                      <- proj_out
Every Linear has .weight and .bias in both layouts; BFL norm `.scale` is diffusers `.weight`.
"""
from __future__ import annotations

import re

__all__ = ["diffusers_to_bfl", "bfl_to_diffusers", "mapping_entries", "count_blocks"]


# ----------------------------------------------------------------------------------------------
# array helpers (NumPy or torch)

def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _cat(parts):
    if _is_torch(parts[0]):
        import torch
        return torch.cat(list(parts), dim=0)
    import numpy as np
    return np.concatenate(list(parts), axis=0)


def _swap_halves(x):
    n = x.shape[0]
    assert n % 2 == 0, f"cannot swap halves of a tensor with {n} rows"
    h = n // 2
    return _cat([x[h:], x[:h]])


# ----------------------------------------------------------------------------------------------
# the table

def mapping_entries(num_double: int, num_single: int, guidance: bool = True):
    """List of (bfl_prefix, kind, [diffusers_prefixes], suffix_pairs).

    kind: 'copy' (1:1), 'cat' (row concatenation of several diffusers tensors), 'swap' (1:1 with
    the two row halves exchanged). suffix_pairs: [(bfl_suffix, diffusers_suffix), ...].
    """
    lin = [("weight", "weight"), ("bias", "bias")]
    nrm = [("scale", "weight")]
    e = []

    def add(bfl, kind, dif, suf=lin):
        e.append((bfl, kind, dif if isinstance(dif, list) else [dif], suf))

    add("img_in", "copy", "x_embedder")
    add("txt_in", "copy", "context_embedder")
    add("time_in.in_layer", "copy", "time_text_embed.timestep_embedder.linear_1")
    add("time_in.out_layer", "copy", "time_text_embed.timestep_embedder.linear_2")
    if guidance:
        add("guidance_in.in_layer", "copy", "time_text_embed.guidance_embedder.linear_1")
        add("guidance_in.out_layer", "copy", "time_text_embed.guidance_embedder.linear_2")
    add("vector_in.in_layer", "copy", "time_text_embed.text_embedder.linear_1")
    add("vector_in.out_layer", "copy", "time_text_embed.text_embedder.linear_2")
    for i in range(num_double):
        b, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        add(f"{b}.img_mod.lin", "copy", f"{d}.norm1.linear")
        add(f"{b}.txt_mod.lin", "copy", f"{d}.norm1_context.linear")
        add(f"{b}.img_attn.qkv", "cat", [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v"])
        add(f"{b}.img_attn.norm.query_norm", "copy", f"{d}.attn.norm_q", nrm)
        add(f"{b}.img_attn.norm.key_norm", "copy", f"{d}.attn.norm_k", nrm)
        add(f"{b}.img_attn.proj", "copy", f"{d}.attn.to_out.0")
        add(f"{b}.txt_attn.qkv", "cat",
            [f"{d}.attn.add_q_proj", f"{d}.attn.add_k_proj", f"{d}.attn.add_v_proj"])
        add(f"{b}.txt_attn.norm.query_norm", "copy", f"{d}.attn.norm_added_q", nrm)
        add(f"{b}.txt_attn.norm.key_norm", "copy", f"{d}.attn.norm_added_k", nrm)
        add(f"{b}.txt_attn.proj", "copy", f"{d}.attn.to_add_out")
        add(f"{b}.img_mlp.0", "copy", f"{d}.ff.net.0.proj")
        add(f"{b}.img_mlp.2", "copy", f"{d}.ff.net.2")
        add(f"{b}.txt_mlp.0", "copy", f"{d}.ff_context.net.0.proj")
        add(f"{b}.txt_mlp.2", "copy", f"{d}.ff_context.net.2")
    for i in range(num_single):
        b, d = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        add(f"{b}.linear1", "cat",
            [f"{d}.attn.to_q", f"{d}.attn.to_k", f"{d}.attn.to_v", f"{d}.proj_mlp"])
        add(f"{b}.linear2", "copy", f"{d}.proj_out")
        add(f"{b}.norm.query_norm", "copy", f"{d}.attn.norm_q", nrm)
        add(f"{b}.norm.key_norm", "copy", f"{d}.attn.norm_k", nrm)
        add(f"{b}.modulation.lin", "copy", f"{d}.norm.linear")
    add("final_layer.adaLN_modulation.1", "swap", "norm_out.linear")
    add("final_layer.linear", "copy", "proj_out")
    return e


def count_blocks(names, double_prefix: str, single_prefix: str):
    """Number of double / single blocks present in a set of names."""
    def n(prefix):
        idx = {int(m.group(1)) for k in names if (m := re.match(re.escape(prefix) + r"\.(\d+)\.", k))}
        assert idx == set(range(len(idx))), f"non-contiguous {prefix} indices: {sorted(idx)}"
        return len(idx)
    return n(double_prefix), n(single_prefix)


# ----------------------------------------------------------------------------------------------
# conversions

def diffusers_to_bfl(sd: dict) -> dict:
    nd, ns = count_blocks(sd.keys(), "transformer_blocks", "single_transformer_blocks")
    guidance = any(k.startswith("time_text_embed.guidance_embedder.") for k in sd)
    used: dict[str, int] = {k: 0 for k in sd}
    out = {}
    for bfl, kind, difs, sufs in mapping_entries(nd, ns, guidance):
        for bs, ds in sufs:
            names = [f"{p}.{ds}" for p in difs]
            for nm in names:
                assert nm in sd, f"missing diffusers tensor {nm}"
                used[nm] += 1
            src = [sd[nm] for nm in names]
            if kind == "copy":
                val = src[0]
            elif kind == "cat":
                val = _cat(src)
            elif kind == "swap":
                val = _swap_halves(src[0])
            else:
                raise ValueError(kind)
            out[f"{bfl}.{bs}"] = val
    bad = {k: c for k, c in used.items() if c != 1}
    assert not bad, f"diffusers tensors not used exactly once: {bad}"
    return out


def bfl_to_diffusers(sd: dict) -> dict:
    nd, ns = count_blocks(sd.keys(), "double_blocks", "single_blocks")
    guidance = any(k.startswith("guidance_in.") for k in sd)
    used: dict[str, int] = {k: 0 for k in sd}
    out = {}
    for bfl, kind, difs, sufs in mapping_entries(nd, ns, guidance):
        for bs, ds in sufs:
            name = f"{bfl}.{bs}"
            assert name in sd, f"missing BFL tensor {name}"
            used[name] += 1
            x = sd[name]
            if kind == "copy":
                out[f"{difs[0]}.{ds}"] = x
            elif kind == "swap":
                out[f"{difs[0]}.{ds}"] = _swap_halves(x)
            elif kind == "cat":
                rows = x.shape[0]
                if len(difs) == 3:                       # qkv: three equal parts
                    assert rows % 3 == 0, name
                    sizes = [rows // 3] * 3
                else:                                    # linear1: [q | k | v | mlp]
                    blk = bfl.rsplit(".", 1)[0]          # single_blocks.{i}
                    hidden = sd[f"{blk}.linear2.weight"].shape[0]
                    sizes = [hidden] * 3 + [rows - 3 * hidden]
                    assert sizes[3] > 0, name
                off = 0
                for p, sz in zip(difs, sizes):
                    out[f"{p}.{ds}"] = x[off:off + sz]
                    off += sz
            else:
                raise ValueError(kind)
    bad = {k: c for k, c in used.items() if c != 1}
    assert not bad, f"BFL tensors not used exactly once: {bad}"
    return out


# ----------------------------------------------------------------------------------------------
# self-check

def _self_check():
    import numpy as np
    rng = np.random.default_rng(0)
    H, M, ctx, vec, cin, D = 8, 32, 5, 3, 4, 4
    nd, ns = 2, 3
    shapes = {}

    def lin(name, o, i):
        shapes[f"{name}.weight"] = (o, i)
        shapes[f"{name}.bias"] = (o,)

    lin("x_embedder", H, cin)
    lin("context_embedder", H, ctx)
    for e in ("timestep_embedder", "guidance_embedder"):
        lin(f"time_text_embed.{e}.linear_1", H, 256)
        lin(f"time_text_embed.{e}.linear_2", H, H)
    lin("time_text_embed.text_embedder.linear_1", H, vec)
    lin("time_text_embed.text_embedder.linear_2", H, H)
    for i in range(nd):
        d = f"transformer_blocks.{i}"
        lin(f"{d}.norm1.linear", 6 * H, H)
        lin(f"{d}.norm1_context.linear", 6 * H, H)
        for p in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                  "to_add_out"):
            lin(f"{d}.attn.{p}", H, H)
        for p in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            shapes[f"{d}.attn.{p}.weight"] = (D,)
        for f in ("ff", "ff_context"):
            lin(f"{d}.{f}.net.0.proj", M, H)
            lin(f"{d}.{f}.net.2", H, M)
    for i in range(ns):
        d = f"single_transformer_blocks.{i}"
        lin(f"{d}.norm.linear", 3 * H, H)
        for p in ("to_q", "to_k", "to_v"):
            lin(f"{d}.attn.{p}", H, H)
        shapes[f"{d}.attn.norm_q.weight"] = (D,)
        shapes[f"{d}.attn.norm_k.weight"] = (D,)
        lin(f"{d}.proj_mlp", M, H)
        lin(f"{d}.proj_out", H, H + M)
    lin("norm_out.linear", 2 * H, H)
    lin("proj_out", cin, H)

    sd = {k: rng.standard_normal(s) for k, s in shapes.items()}
    bfl = diffusers_to_bfl(sd)
    assert bfl["double_blocks.1.img_attn.qkv.weight"].shape == (3 * H, H)
    assert bfl["single_blocks.2.linear1.weight"].shape == (3 * H + M, H)
    assert bfl["single_blocks.2.linear2.weight"].shape == (H, H + M)
    # final adaLN: BFL [shift; scale] = diffusers [scale; shift] swapped
    assert np.array_equal(bfl["final_layer.adaLN_modulation.1.weight"][:H],
                          sd["norm_out.linear.weight"][H:])
    assert np.array_equal(bfl["single_blocks.0.linear1.bias"][3 * H:],
                          sd["single_transformer_blocks.0.proj_mlp.bias"])
    back = bfl_to_diffusers(bfl)
    assert set(back) == set(sd), set(back) ^ set(sd)
    for k in sd:
        assert back[k].shape == sd[k].shape and np.array_equal(back[k], sd[k]), k
    n_d = sum(v.size for v in sd.values())
    n_b = sum(v.size for v in bfl.values())
    assert n_d == n_b
    again = diffusers_to_bfl(back)
    assert all(np.array_equal(again[k], bfl[k]) for k in bfl)
    # torch path, if torch is importable
    try:
        import torch
    except Exception:
        torch = None
    if torch is not None:
        tb = diffusers_to_bfl({k: torch.from_numpy(v) for k, v in sd.items()})
        assert all(np.array_equal(tb[k].numpy(), bfl[k]) for k in bfl)
        tback = bfl_to_diffusers(tb)
        assert all(np.array_equal(tback[k].numpy(), sd[k]) for k in sd)
    print(f"flux_names self-check OK: {len(sd)} diffusers tensors <-> {len(bfl)} BFL tensors, "
          f"{n_d} values, round trip exact" + (" (numpy + torch)" if torch is not None else " (numpy)"))


if __name__ == "__main__":
    _self_check()
