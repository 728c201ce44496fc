#!/usr/bin/env python3
"""tools/encode_throughput.py at tiny size on the CPU: its report, and shards that are encode_dataset's.

    python3 tests/python/test_encode_throughput.py <flux8 binary (unused)> <source dir>

Checks
  1. The full-size configs are the real encoders: built on the meta device (nothing allocated),
     the VAE has the Flux VAE's 83,819,683 parameters, T5 the v1.1 XXL encoder's 4,762,310,656
     and CLIP ViT-L/14's text model 123,060,480, with their widths.
  2. `encode_throughput.py --size tiny` as a command, on 6 images, batch 2 and 4, 2 decoding
     threads, shards of 4: the JSON holds the device, versions, settings, each encoder's
     parameters and, per pass, 6 images, images/s = images / seconds, five stages that each took
     time and, with "other", add up to the pass, and the shards (4 + 2 samples).
  3. The synthetic images are JPEGs in the sizes the tool lists (so resizing and cropping run),
     each with a caption of 19 to 94 words.
  4. The batch-2 pass's shards are what tools/encode_dataset.py writes on the same images with the
     same encoders saved and loaded through from_pretrained: the same files and members, mean and
     logvar [16, 8, 8], t5 [32, 32], clip [32] in bf16 bits, the same values, the same empty
     prompt and dataset.yaml.
  5. Without CUDA, --size full says that it needs a GPU and exits 1.

Needs torch, diffusers, transformers, tokenizers, Pillow, numpy, safetensors. Without them it
exits 77 (skipped), except under CI (CI=true), where it fails.
"""
import contextlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile

SRC = os.path.abspath(sys.argv[2])
TOOLS = os.path.join(SRC, "tools")
RES, TEXT_LEN, WIDTH = 64, 32, 32  # the tiny size's image side, T5 tokens, T5 d_model = CLIP hidden
STAGES = {"decode_wait", "vae", "t5", "clip", "write"}

try:
    import numpy as np
    import torch
    from PIL import Image
    from safetensors import safe_open
    import diffusers  # noqa: F401
    import tokenizers  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:
    if os.environ.get("CI") == "true":
        sys.exit(f"FAIL: {e}: CI must have the Python packages of scripts/install_deps.sh")
    print(f"SKIP: {e} (scripts/install_deps.sh installs the Python packages)")
    sys.exit(77)

sys.path.insert(0, TOOLS)
import encode_dataset  # noqa: E402
import encode_throughput as et  # noqa: E402

failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what)
    failures += not ok


def check_full_size():
    built, facts = et.build_encoders("full", "meta", torch.bfloat16)
    params = {k: f["params"] for k, f in facts.items()}
    check(params == {"vae": 83_819_683, "t5": 4_762_310_656, "clip": 123_060_480},
          f"full size: the Flux VAE's, T5 v1.1 XXL encoder's and CLIP-L text model's parameter counts ({params})")
    vae, t5, clip = built["vae"].config, built["t5"].config, built["clip"].config
    check((vae.latent_channels, list(vae.block_out_channels), vae.scaling_factor, vae.shift_factor,
           t5.d_model, t5.num_layers, t5.num_heads, t5.d_ff, clip.hidden_size, clip.num_hidden_layers) ==
          (16, [128, 256, 512, 512], 0.3611, 0.1159, 4096, 24, 64, 10240, 768, 12),
          "full size: 16 latent channels, scale 0.3611, shift 0.1159; T5 4096 x 24 layers; CLIP 768 x 12 layers")


def run_tool(work, out_json):
    cmd = [sys.executable, os.path.join(TOOLS, "encode_throughput.py"), "--size", "tiny", "--images", "6",
           "--batch", "2,4", "--workers", "2", "--shard-size", "4", "--work-dir", work, "--json", out_json]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if r.returncode != 0:
        print(r.stdout[-4000:], r.stderr[-4000:])
        sys.exit(f"FAIL: tools/encode_throughput.py exited {r.returncode}")
    return r.stdout


def check_report(report, stdout):
    check(report["tool"] == "tools/encode_throughput.py" and report["size"] == "tiny" and
          report["device"].startswith("cpu") and report["weights_gpu_memory_gib"] is None,
          f"the report names the tool, the size and the device ({report['device']})")
    check(set(report["versions"]) >= {"torch", "transformers", "diffusers", "tokenizers", "pillow"},
          "the report holds the libraries' versions")
    s = report["settings"]
    check((s["images"], s["resolution"], s["text_seq_len"], s["dtype"], s["shard_size"], s["storage"]) ==
          (6, RES, TEXT_LEN, "float32", 4, "bf16"), f"settings: 6 images, {RES} px, T5 {TEXT_LEN}, f32, shards of 4")
    check(all(report["encoders"][k]["params"] > 1000 and report["encoders"][k]["config"] == json.loads(json.dumps(et.TINY[k]))
              for k in ("vae", "t5", "clip")), "each encoder's parameter count and config")
    passes = report["passes"]
    check([(p["batch"], p["workers"]) for p in passes] == [(2, 2), (4, 2)], "one pass per batch (2, 4) x workers (2)")
    for p in passes:
        what = f"pass batch {p['batch']}"
        check(p["images"] == 6 and p["skipped"] == 0 and abs(p["images_per_s"] * p["seconds"] / 6 - 1) < 1e-3,
              f"{what}: 6 images, images/s = images / seconds ({p['images_per_s']})")
        stages = p["stages"]
        check(set(stages) == STAGES | {"other"} and all(stages[k]["seconds"] > 0 for k in STAGES) and
              abs(sum(v["seconds"] for v in stages.values()) - p["seconds"]) < 2e-3,
              f"{what}: the five stages took time and, with 'other', add up to the pass")
        check(p["shards"] == {"train-000000.tar": 4, "train-000001.tar": 2} and p["shard_bytes"] > 0 and
              p["peak_gpu_memory_gib"] is None, f"{what}: shards of 4 and 2 samples")
        check(f"batch {p['batch']}, workers 2: " in stdout, f"{what}: printed")


def check_images(work):
    folder = os.path.join(work, "images")
    names = sorted(os.listdir(folder))
    check(names == sorted([f"img_{i:06d}.jpg" for i in range(6)] + [f"img_{i:06d}.txt" for i in range(6)]),
          "6 JPEGs with their .txt captions")
    sizes = [Image.open(os.path.join(folder, f"img_{i:06d}.jpg")).size for i in range(6)]
    want = [(max(8, round(w * RES)), max(8, round(h * RES))) for w, h in et.SHAPES[:6]]
    check(sizes == want and len(set(sizes)) == 6, f"the images' sizes vary ({sizes})")
    lengths = [len(open(os.path.join(folder, f"img_{i:06d}.txt")).read().split()) for i in range(6)]
    check(all(19 <= n <= 94 for n in lengths), f"captions of 19 to 94 words ({lengths})")


def tar_members(path):
    """{member name: content} in the tar's order (numpy arrays for .npy members)."""
    out = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            data = tf.extractfile(m).read()
            out[m.name] = np.load(io.BytesIO(data)) if m.name.endswith(".bytes") else json.loads(data)
    return out


def reference_shards(tmp, images):
    """tools/encode_dataset.py on the images, with the tiny encoders saved and loaded from disk."""
    built, _ = et.build_encoders("tiny", "cpu", torch.float32)
    enc = os.path.join(tmp, "encoders")
    built["vae"].save_pretrained(os.path.join(enc, "vae"))
    for name in ("t5", "clip"):
        built[name].save_pretrained(os.path.join(enc, name))
        built[f"{name}_tokenizer"].save_pretrained(os.path.join(enc, name))
    out = os.path.join(tmp, "reference")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = encode_dataset.main([images, "--out", out, "--resolution", str(RES), "--text-seq-len", str(TEXT_LEN),
                                      "--batch", "2", "--workers", "2", "--shard-size", "4", "--device", "cpu",
                                      "--vae", os.path.join(enc, "vae"), "--t5", os.path.join(enc, "t5"),
                                      "--clip", os.path.join(enc, "clip")])
    if status != 0:
        print(err.getvalue()[-4000:])
        sys.exit(f"FAIL: tools/encode_dataset.py exited {status}")
    return out


def check_against_encode_dataset(tmp, work):
    ours, ref = os.path.join(work, "shards-b2-w2"), reference_shards(tmp, os.path.join(work, "images"))
    files = sorted(os.listdir(ours))
    check(files == sorted(os.listdir(ref)) == ["dataset.json", "dataset.yaml", "empty_prompt.safetensors",
                                               "train-000000.tar", "train-000001.tar"],
          f"the pass wrote the files encode_dataset writes ({files})")
    for shard in ("train-000000.tar", "train-000001.tar"):
        a, b = tar_members(os.path.join(ours, shard)), tar_members(os.path.join(ref, shard))
        check(list(a) == list(b) and len(a) == 5 * (4 if shard.endswith("0.tar") else 2),
              f"{shard}: the same members in the same order (KEY.json, .mean/.logvar/.t5/.clip.bytes)")
        shapes = {n.split(".", 1)[1]: v.shape for n, v in a.items() if n.endswith(".bytes")}
        check(shapes == {"mean.bytes": (16, RES // 8, RES // 8), "logvar.bytes": (16, RES // 8, RES // 8),
                         "t5.bytes": (TEXT_LEN, WIDTH), "clip.bytes": (WIDTH,)} and
              all(v.dtype == np.uint16 for n, v in a.items() if n.endswith(".bytes")),
              f"{shard}: mean/logvar [16, 8, 8], t5 [{TEXT_LEN}, {WIDTH}], clip [{WIDTH}] as bf16 bits")
        same = all(np.array_equal(a[n], b[n]) if n.endswith(".bytes") else a[n] == b[n] for n in a)
        check(same, f"{shard}: the same values and captions as encode_dataset's")
    tensors = []
    for d in (ours, ref):
        with safe_open(os.path.join(d, "empty_prompt.safetensors"), "np") as f:
            tensors.append({k: f.get_tensor(k) for k in f.keys()})
    check(tensors[0].keys() == tensors[1].keys() and all(np.array_equal(tensors[0][k], tensors[1][k])
                                                         for k in tensors[0]), "the same empty prompt")
    yaml = [open(os.path.join(d, "dataset.yaml")).read().replace(d, "DIR") for d in (ours, ref)]
    check(yaml[0] == yaml[1], "the same dataset.yaml")


def check_full_needs_gpu():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = et.main(["--json", os.devnull])
        except SystemExit as e:
            status = e.code
    check(status == 1 and "needs a CUDA GPU" in err.getvalue(), "--size full without CUDA: says it needs a GPU, exit 1")


def main():
    check_full_size()
    with tempfile.TemporaryDirectory() as tmp:
        work, out_json = os.path.join(tmp, "work"), os.path.join(tmp, "throughput.json")
        stdout = run_tool(work, out_json)
        with open(out_json) as f:
            check_report(json.load(f), stdout)
        check(sorted(os.listdir(work)) == ["images", "shards-b2-w2", "shards-b4-w2"],
              "the work folder keeps the images and each pass's shards, not the warm-up's")
        check_images(work)
        check_against_encode_dataset(tmp, work)
    if not torch.cuda.is_available():
        check_full_needs_gpu()
    print(f"{failures} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
