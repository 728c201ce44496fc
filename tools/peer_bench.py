#!/usr/bin/env python3
"""Times the PyTorch way of training Flux at flux8's benchmark workloads: the peer of `flux8 bench --peer`.

    python3 tools/peer_bench.py --out peer.json [--workload W1,W2,U1] [--mode eager,compile,torchao-fp8]
                                [--steps 10] [--warmup 3] [--processes auto|one|per-mode]
    python3 tools/peer_bench.py --tiny --out peer.json    # a tiny model on the CPU, for tests

The model is diffusers' FluxTransformer2DModel at the sizes of configs/models/ (W1: flux_535m,
32 samples of 256 px with 256 text tokens; W2: flux_12b_dev cut to 2 double + 4 single blocks,
2 samples of 1024 px with 512 text tokens, as src/bench/step_bench.cpp's workload_spec; U1, a
shape flux8 is not tuned for: flux_535m, 8 samples of 512 px with 256 text tokens, written under
the model's name as `flux8 bench -c configs/models/flux_535m.yaml --set image_size=512 --set
micro_batch_size=8` names its run), trained
the usual PyTorch way: fp32 master weights, bf16 autocast, fused AdamW (flux8's defaults: betas
0.9, 0.95, weight decay 0.1, lr 1e-4), the global gradient norm clipped to 1.0, on random data
of the workload's shape with the rectified-flow objective of flux8's bench (x_t = (1 - t) x0 +
t noise, target noise - x0, mean squared error; a fresh t and noise each step, inside the
step's time). Modes:
  eager        the model as diffusers builds it
  compile      torch.compile(model)
  torchao-fp8  torchao float8 training (tensorwise dynamic scaling) on every Linear of the
               blocks except their modulation, then torch.compile
Each mode gets a fresh model and optimizer, --warmup untimed steps (compilation happens there),
then --steps steps, each timed between CUDA events; the JSON holds their median and the peak of
torch.cuda.max_memory_allocated over the mode (weights, gradients, AdamW moments, activations).
A mode that cannot run here (its library missing, no GPU for float8, an error) is written as
skipped, with the reason. On the GPU each workload's mode runs in a process of its own
(`--processes per-mode`, what `auto` picks there): a CUDA error leaves the process's context
unusable, and would otherwise skip every mode after the one that hit it; the peak is then that
mode's alone too. `--processes one` runs them all in this process (`auto` with --tiny). `--tiny` runs configs/models/flux_tiny_demo.yaml at 2 samples of
16 px with 8 text tokens on the CPU (wall-clock times, no memory peak): the shape of the tests'
`flux8 bench -c` config, under the model's name as workload.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("eager", "compile", "torchao-fp8")

# The workloads of `flux8 bench`: model file, block overrides, samples, image pixels, text tokens.
WORKLOADS = {
    "W1": dict(config="flux_535m.yaml", overrides={}, name=None, batch=32, image_size=256, text_seq_len=256),
    "W2": dict(config="flux_12b_dev.yaml", overrides={"num_double_blocks": 2, "num_single_blocks": 4},
               name="flux_12b_width_slice", batch=2, image_size=1024, text_seq_len=512),
    "U1": dict(config="flux_535m.yaml", overrides={}, name=None, batch=8, image_size=512, text_seq_len=256,
               as_model=True),
}
TINY = dict(config="flux_tiny_demo.yaml", overrides={}, name=None, batch=2, image_size=16, text_seq_len=8)


def cpu_device_name() -> str:
    """The CPU's name as `flux8 bench --backend cpu` writes it (src/bench/peer.h)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip(" \t\r\n")
                    if model:
                        return "cpu: " + model
    except OSError:
        pass
    return "cpu"


def load_model_config(source: str, spec: dict) -> dict:
    import yaml  # comes with huggingface_hub, which diffusers needs

    path = os.path.join(source, "configs", "models", spec["config"])
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg.update(spec["overrides"])
    # diffusers' Flux blocks have a fixed MLP ratio of 4 and biased q, k, v projections.
    if float(cfg["mlp_ratio"]) != 4.0 or not cfg["qkv_bias"]:
        sys.exit(f"{path}: mlp_ratio {cfg['mlp_ratio']} / qkv_bias {cfg['qkv_bias']}: diffusers' Flux has 4.0 / true")
    cell = cfg["vae_downsample"] * cfg["patch_size"]
    side = spec["image_size"] // cell
    cfg.update(batch=spec["batch"], txt_tokens=spec["text_seq_len"], img_tokens=side * side, grid=side,
               workload_model=spec["name"] or cfg["model_name"])
    return cfg


def build_model(cfg: dict, device):
    from diffusers import FluxTransformer2DModel

    heads = cfg["num_attention_heads"]
    return FluxTransformer2DModel(
        patch_size=1, in_channels=cfg["in_channels"], out_channels=None, num_layers=cfg["num_double_blocks"],
        num_single_layers=cfg["num_single_blocks"], attention_head_dim=cfg["hidden_size"] // heads,
        num_attention_heads=heads, joint_attention_dim=cfg["context_dim"], pooled_projection_dim=cfg["vec_dim"],
        guidance_embeds=bool(cfg["guidance_embed"]), axes_dims_rope=tuple(cfg["axes_dim"])).to(device)


def to_float8(model):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def block_linear(module, fqn: str) -> bool:
        # Modulation (norm1.linear, norm1_context.linear, norm.linear) sees one row per sample.
        return fqn.startswith(("transformer_blocks.", "single_transformer_blocks.")) and ".norm" not in fqn

    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=block_linear)
    return model


def why_not(mode: str, device) -> str | None:
    """Why `mode` cannot run on `device`, or None."""
    import torch

    if mode != "torchao-fp8":
        return None
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # ImportError, or a torchao built for another torch
        return f"torchao is not usable here: {type(e).__name__}: {e}"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return "torchao float8 training needs a CUDA GPU of compute capability 8.9 or newer"
    return None


class Batch:
    """Random inputs of the workload's shape, made once; each step draws t and the noise."""

    def __init__(self, cfg: dict, device):
        import torch

        g = torch.Generator(device="cpu").manual_seed(1234)
        b, li, lt = cfg["batch"], cfg["img_tokens"], cfg["txt_tokens"]
        self.x0 = torch.randn(b, li, cfg["in_channels"], generator=g).to(device)
        self.txt = torch.randn(b, lt, cfg["context_dim"], generator=g).to(device)
        self.pooled = torch.randn(b, cfg["vec_dim"], generator=g).to(device)
        rows = torch.arange(cfg["grid"]).repeat_interleave(cfg["grid"])
        cols = torch.arange(cfg["grid"]).repeat(cfg["grid"])
        self.img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).float().to(device)
        self.txt_ids = torch.zeros(lt, 3, device=device)
        self.guidance = torch.full((b,), 3.5, device=device) if cfg["guidance_embed"] else None


def train_step(model, opt, batch: Batch, device):
    import torch

    x0 = batch.x0
    t = torch.rand(x0.shape[0], device=device)
    noise = torch.randn_like(x0)
    tb = t.view(-1, 1, 1)
    xt = (1 - tb) * x0 + tb * noise
    with torch.autocast(device.type, dtype=torch.bfloat16):
        pred = model(hidden_states=xt, encoder_hidden_states=batch.txt, pooled_projections=batch.pooled,
                     timestep=t, img_ids=batch.img_ids, txt_ids=batch.txt_ids, guidance=batch.guidance,
                     return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(pred.float(), noise - x0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_mode(mode: str, cfg: dict, device, steps: int, warmup: int) -> dict:
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    model = build_model(cfg, device)
    if mode == "torchao-fp8":
        model = to_float8(model)
    if mode in ("compile", "torchao-fp8"):
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    batch = Batch(cfg, device)
    start = time.perf_counter()
    for _ in range(warmup):
        train_step(model, opt, batch, device)
    if cuda:
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - start
    step_ms = []
    for _ in range(steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            train_step(model, opt, batch, device)
            end.record()
            end.synchronize()
            step_ms.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            train_step(model, opt, batch, device)
            step_ms.append(1e3 * (time.perf_counter() - t0))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    del model, opt, batch
    if mode != "eager":
        torch._dynamo.reset()  # the compiled graphs hold the model's tensors: free them for the next mode
    gc.collect()
    return {"mode": mode, "status": "ran", "median_ms": statistics.median(step_ms), "peak_gib": peak,
            "steps": len(step_ms), "step_ms": step_ms, "warmup": warmup, "warmup_s": warmup_s}


def per_mode_processes(args, device) -> bool:
    return args.processes == "per-mode" or (args.processes == "auto" and device.type == "cuda")


def run_in_own_process(name: str | None, mode: str, args) -> tuple[dict | None, str | None]:
    """One mode of one workload timed by a child process of this script: (its result, None), or
    (None, why) where the child failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "mode.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--out", out, "--mode", mode, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--source", args.source, "--processes", "one"]
        cmd += ["--tiny"] if args.tiny else ["--workload", name]
        child = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(child.stderr)
        if child.returncode == 0 and os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                [w] = json.load(f)["workloads"]
            [result] = w["modes"]
            return (result, None) if result["status"] == "ran" else (None, result["why"])
        last = next((line for line in reversed(child.stderr.splitlines()) if line.strip()), "")
        return None, f"failed: its process exited with status {child.returncode}: {last}"


def run_workload(name: str, spec: dict, args, device, diffusers_error: str | None) -> dict:
    cfg = load_model_config(args.source, spec)
    workload = cfg["workload_model"] if not name or spec.get("as_model") else name
    out = {"workload": workload, "model": cfg["workload_model"],
           "batch": cfg["batch"], "txt_tokens": cfg["txt_tokens"], "img_tokens": cfg["img_tokens"], "modes": []}
    for mode in args.mode:
        why = diffusers_error or why_not(mode, device)
        if why is None and per_mode_processes(args, device):
            result, why = run_in_own_process(name, mode, args)
        elif why is None:
            try:
                result = time_mode(mode, cfg, device, args.steps, args.warmup)
            except Exception as e:  # an error in one mode leaves the others' numbers
                traceback.print_exc()
                why = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if why is not None:
            result = {"mode": mode, "status": "skipped", "why": why}
            gc.collect()
        out["modes"].append(result)
        shown = f"{result['median_ms']:.2f} ms, peak {result['peak_gib']} GiB" if result["status"] == "ran" else why
        print(f"{out['workload']} {mode}: {shown}", flush=True)
    return out


def versions(diffusers_error: str | None) -> dict:
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": None, "torchao": None}
    if diffusers_error is None:
        import diffusers

        v["diffusers"] = diffusers.__version__
    try:
        import torchao

        v["torchao"] = torchao.__version__
    except Exception:
        pass
    return v


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--workload", default="W1,W2", help="W1, W2 and/or U1, comma-separated (not with --tiny)")
    p.add_argument("--mode", default=None, help="eager, compile, torchao-fp8, comma-separated (default: all three; "
                   "eager with --tiny)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (their median is reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens there)")
    p.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (tests)")
    p.add_argument("--source", default=ROOT, help="the flux8 repository (its configs/models/)")
    p.add_argument("--processes", default="auto", choices=("auto", "one", "per-mode"),
                   help="per-mode: each workload's mode in a process of its own; one: all in this one; auto "
                   "(default): per-mode on the GPU, one with --tiny")
    args = p.parse_args(argv)
    args.mode = (args.mode or ("eager" if args.tiny else ",".join(MODES))).split(",")
    for m in args.mode:
        if m not in MODES:
            p.error(f"--mode {m}: choose from {', '.join(MODES)}")
    for w in args.workload.split(","):
        if w not in WORKLOADS:
            p.error(f"--workload {w}: choose W1, W2 or U1")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"peer_bench: PyTorch is needed ({e})", file=sys.stderr)
        return 1
    try:
        import diffusers  # noqa: F401
        diffusers_error = None
    except Exception as e:
        diffusers_error = f"diffusers is not usable here: {type(e).__name__}: {e}"
    if args.tiny:
        device, plan = torch.device("cpu"), [(None, TINY)]
    else:
        if not torch.cuda.is_available():
            print("peer_bench: no CUDA GPU (use --tiny for the CPU)", file=sys.stderr)
            return 1
        device, plan = torch.device("cuda", 0), [(w, WORKLOADS[w]) for w in args.workload.split(",")]
    result = {"tool": "tools/peer_bench.py",
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_device_name(),
              "versions": versions(diffusers_error),
              "workloads": [run_workload(name, spec, args, device, diffusers_error) for name, spec in plan]}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(f"peer_bench: wrote {args.out} ({result['device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
