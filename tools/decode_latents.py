#!/usr/bin/env python3
"""Decode the latents written by `flux8 sample` (latent models) with the Flux VAE into a PNG grid.

flux8 has no VAE decoder: `flux8 sample --out GRID.png` and the trainer's previews (sample_vae)
run this script, and without Python and diffusers keep the latents, a safetensors file:
  latents   [images, 16, h, w] F32, prompt-major (image k of prompt p at p*K + k), already in the
            VAE's latent space (flux8 applied z = x / vae_scale_factor + vae_shift_factor)
  metadata  prompts (JSON list), images_per_prompt, image_size, steps, seed, ...
This script decodes them with diffusers' AutoencoderKL and writes one grid row per prompt.

Needs torch, diffusers and Pillow (not flux8's own dependencies):
    python3 -m venv venv && venv/bin/pip install torch diffusers safetensors pillow

    python3 tools/decode_latents.py latents.safetensors --out grid.png \
        [--vae black-forest-labs/FLUX.1-schnell | --vae /path/to/vae] [--device cuda] [--dtype bfloat16]
    python3 tools/decode_latents.py --check --vae /path/to/vae   # the packages import, the VAE loads

Exit status: 0 done; 3 a package is missing; 1 any other error (a message says which).

--vae is a Hugging Face Hub id (its `vae` subfolder is loaded; FLUX.1-dev and -schnell share the
VAE) or a local directory: either a VAE folder holding config.json + weights, or a pipeline folder
with a vae/ subfolder. Hub downloads need network access (and, for gated repos, a token).
"""
import argparse
import json
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("latents", nargs="?", help="safetensors file written by `flux8 sample` (tensor 'latents')")
    p.add_argument("--out", help="output PNG grid")
    p.add_argument("--check", action="store_true",
                   help="only check that the packages import and the VAE loads, then exit")
    p.add_argument("--vae", default="black-forest-labs/FLUX.1-schnell",
                   help="Hub id (subfolder vae) or local VAE/pipeline directory")
    p.add_argument("--subfolder", default=None,
                   help="subfolder of --vae holding the VAE (default: 'vae' unless --vae has config.json)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batch", type=int, default=4, help="images decoded per VAE call")
    p.add_argument("--per-row", type=int, default=None,
                   help="images per grid row (default: the file's images_per_prompt)")
    p.add_argument("--gutter", type=int, default=2, help="pixels between grid cells")
    return p.parse_args(argv)


MISSING_PACKAGES = 3  # the exit status flux8 reads as "no decoder here, keep the latents"


def fail(msg, status=1):
    print(f"decode_latents: error: {msg}", file=sys.stderr)
    sys.exit(status)


def load_vae(args, torch, AutoencoderKL):
    subfolder = args.subfolder
    if subfolder is None:
        local_vae = os.path.isdir(args.vae) and os.path.isfile(os.path.join(args.vae, "config.json"))
        subfolder = None if local_vae else "vae"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    try:
        vae = AutoencoderKL.from_pretrained(args.vae, subfolder=subfolder, torch_dtype=dtype)
    except Exception as e:  # diffusers raises several types for missing/offline repos
        fail(f"cannot load the VAE from {args.vae!r} (subfolder {subfolder!r}): {e}")
    return vae.to(device).eval(), device, dtype


def main(argv=None):
    args = parse_args(argv)
    if not args.check and (args.latents is None or args.out is None):
        fail("give LATENTS and --out GRID.png (or --check)")
    try:
        import numpy as np
        import torch
        from diffusers import AutoencoderKL
        from PIL import Image
        from safetensors import safe_open
    except ImportError as e:
        fail(f"{e}; this tool needs torch, diffusers, safetensors and Pillow (see --help)", MISSING_PACKAGES)
    if args.check:
        vae, device, _ = load_vae(args, torch, AutoencoderKL)
        print(f"decode_latents: ready: VAE {args.vae} ({vae.config.latent_channels} latent channels) on {device}")
        return 0

    if not os.path.isfile(args.latents):
        fail(f"{args.latents}: no such file")
    with safe_open(args.latents, "pt") as f:
        if "latents" not in f.keys():
            fail(f"{args.latents} has no tensor 'latents' (tensors: {list(f.keys())}); "
                 "was it written by `flux8 sample` for a latent model?")
        latents = f.get_tensor("latents").float()
        meta = f.metadata() or {}
    if latents.ndim != 4:
        fail(f"{args.latents}: 'latents' must be [images, channels, h, w], got {list(latents.shape)}")
    per_row = args.per_row or int(meta.get("images_per_prompt", latents.shape[0]))
    prompts = json.loads(meta.get("prompts", "[]"))

    vae, device, dtype = load_vae(args, torch, AutoencoderKL)
    if vae.config.latent_channels != latents.shape[1]:
        fail(f"the VAE at {args.vae} has {vae.config.latent_channels} latent channels, "
             f"{args.latents} has {latents.shape[1]}")

    images = []
    with torch.no_grad():
        for i in range(0, latents.shape[0], args.batch):
            z = latents[i:i + args.batch].to(device=device, dtype=dtype)
            images.append(vae.decode(z).sample.float().cpu())  # [b, 3, H, W] in ~[-1, 1]
    images = torch.cat(images)
    pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()

    n, H, W, _ = pixels.shape
    cols = min(per_row, n)
    rows = (n + cols - 1) // cols
    g = args.gutter
    grid = np.full((rows * H + (rows - 1) * g, cols * W + (cols - 1) * g, 3), 128, np.uint8)
    for i in range(n):
        r, c = divmod(i, cols)
        grid[r * (H + g):r * (H + g) + H, c * (W + g):c * (W + g) + W] = pixels[i]
    tmp = f"{args.out}.tmp.{os.getpid()}.png"
    Image.fromarray(grid).save(tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {n} images {W}x{H}, {rows} rows x {cols}"
          + (f"; prompts: {prompts}" if prompts else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
