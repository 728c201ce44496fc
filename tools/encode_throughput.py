#!/usr/bin/env python3
"""Encode throughput of tools/encode_dataset.py: images/s with real-sized, randomly initialised encoders.

    python3 tools/encode_throughput.py --json encode_throughput.json [--images 256] [--batch 8,16]
        [--workers 4,16] [--resolution 1024] [--text-seq-len 512] [--work-dir DIR]
    python3 tools/encode_throughput.py --size tiny --json out.json    # tiny encoders, on the CPU

The encoders are built from the configs below and initialised directly on the device in the
dtype encode_dataset uses there (bfloat16 on CUDA); nothing is downloaded. Random weights cost
what trained ones cost: the work per image is the same.
  vae   diffusers' AutoencoderKL as FLUX.1's vae/config.json: 16 latent channels, blocks of
        128, 256, 512, 512 channels with 2 layers each, scaling 0.3611, shift 0.1159 (83.8M)
  t5    transformers' T5EncoderModel as google/t5-v1_1-xxl: d_model 4096, 24 layers, 64 heads of
        64, d_ff 10240, gated-gelu, vocabulary 32128 (4.76B)
  clip  transformers' CLIPTextModel as openai/clip-vit-large-patch14: hidden 768, 12 layers, 12
        heads, intermediate 3072, 77 positions, vocabulary 49408 (123M)
Their tokenizers are word-level ones built here over the captions' words; T5 still runs on
--text-seq-len tokens and CLIP on 77, as encode_dataset pads them.

--images synthetic JPEGs (smooth random colours, shapes and grain, from 0.75x to 2x the
resolution in several aspect ratios, so resizing and cropping run) with captions of 15 to 90
words are written to WORK/images with their .txt captions. Each pass (every --batch with every
--workers) runs encode_dataset's own code on that folder (collect_items, Encoder, encode_items):
a warm-up on --warmup-batches batches into a scratch folder, then every image into fresh
shards, timed. For each pass the JSON holds images/s (images over the wall-clock time of the
whole run), the seconds of each stage of the encoding loop and the images/s that stage alone
would allow, and the peak GPU memory (torch.cuda.max_memory_allocated):
  decode_wait  waiting for decoded, resized, cropped images (--workers threads decode them
               while the encoders run)
  vae          the VAE's encoder, pixels to the device and the posterior back
  t5 / clip    tokenizing and the text encoder, its output back
  write        the shards' tar files (.npy members)
  other        the rest: the empty prompt, the manifest, the progress bar
The JSON is rewritten after each pass, so a run cut short keeps the passes it finished. WORK
is --work-dir (kept: images, each pass's shards-bB-wW/) or a temporary folder, removed.

Needs torch, diffusers, transformers, tokenizers, Pillow, numpy. Exit status: 0 done; 1 an
error; 3 a package is missing.
"""
import argparse
import collections
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import encode_dataset as ed  # noqa: E402
import flux_encoders as fe  # noqa: E402

TOOL = "encode_throughput"
STAGES = ("decode_wait", "vae", "t5", "clip", "write")
GiB = float(1 << 30)

# FLUX.1's vae/config.json, text_encoder_2/config.json (T5 v1.1 XXL) and text_encoder/config.json
# (CLIP ViT-L/14); token ids are the word-level tokenizers' (see word_tokenizer).
FULL = {
    "vae": dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024, scaling_factor=0.3611,
                shift_factor=0.1159, force_upcast=True, use_quant_conv=False, use_post_quant_conv=False,
                mid_block_add_attention=True),
    "t5": dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
               layer_norm_epsilon=1e-6, tie_word_embeddings=False),
    "clip": dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768,
                 layer_norm_eps=1e-5),
}
# The same architectures, small enough for the CPU in seconds.
TINY = {
    "vae": dict(FULL["vae"], block_out_channels=(16, 16, 32, 32), layers_per_block=1, norm_num_groups=8,
                sample_size=64),
    "t5": dict(FULL["t5"], vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
    "clip": dict(FULL["clip"], vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, projection_dim=32),
}
SIZES = {"full": dict(configs=FULL, images=256, resolution=1024, text_seq_len=512),
         "tiny": dict(configs=TINY, images=6, resolution=64, text_seq_len=32)}

CAPTION_WORDS = (
    "a an the of on in with and at near under behind beside through over its their two three "
    "photo picture painting close-up view portrait landscape illustration render shot "
    "red orange yellow green blue purple pink brown black white grey golden silver pale dark bright "
    "old young small large tall wooden stone glass metal soft sharp warm cold misty sunny rainy quiet busy "
    "woman man child dog cat horse bird fox deer tree forest river lake mountain city street house "
    "window door bridge boat car bicycle table chair cup book lamp flower garden field beach sky cloud "
    "sun moon light shadow snow sand road market kitchen room wall roof hill valley harbour tower "
    "standing sitting walking running reflecting glowing covered surrounded lit seen framed "
    "morning evening night sunset autumn winter summer spring background foreground detailed "
    "cinematic lighting soft focus depth field texture colours composition style , .").split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="the JSON file to write")
    p.add_argument("--size", choices=sorted(SIZES), default="full",
                   help="full: the real encoders' sizes (needs a GPU); tiny: small ones (default %(default)s)")
    p.add_argument("--images", type=int, help="images per pass (default 256; tiny 6)")
    p.add_argument("--resolution", type=int, help="image side in pixels (default 1024; tiny 64)")
    p.add_argument("--text-seq-len", type=int, help="T5 tokens (default 512; tiny 32)")
    p.add_argument("--batch", default="8", help="images per encoder call, comma-separated: one pass each "
                   "(default %(default)s, encode_dataset's)")
    p.add_argument("--workers", default="4", help="decoding threads, comma-separated: one pass each "
                   "(default %(default)s, encode_dataset's)")
    p.add_argument("--warmup-batches", type=int, default=2, help="untimed batches before each pass "
                   "(default %(default)s)")
    p.add_argument("--shard-size", type=int, help="samples per shard (default: encode_dataset's)")
    p.add_argument("--storage", choices=["bf16", "f32"], help="stored dtype (default: encode_dataset's)")
    p.add_argument("--device", help="torch device (default: cuda when there is one)")
    p.add_argument("--encoder-dtype", choices=["float32", "bfloat16", "float16"],
                   help="the encoders' dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--work-dir", help="keep the images and shards here (default: a temporary folder, removed)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, images and captions")
    args = p.parse_args(argv)
    for key, value in SIZES[args.size].items():
        if key != "configs" and getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.batch = [int(b) for b in args.batch.split(",")]
        args.workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        p.error(f"--batch {args.batch} / --workers {args.workers}: comma-separated whole numbers")
    if args.images < 1 or min(args.batch + args.workers) < 1 or args.warmup_batches < 0:
        p.error("--images, --batch and --workers must be at least 1, --warmup-batches at least 0")
    return args


# ---- encoders -----------------------------------------------------------------------------------

def word_tokenizer(template, specials):
    """A word-level tokenizer over CAPTION_WORDS; pads with specials[0], ends with specials[1]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(specials + sorted(set(CAPTION_WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=template,
                                                       special_tokens=[(s, vocab[s]) for s in specials])
    named = {"pad_token": specials[0], "eos_token": specials[1], "unk_token": "<unk>"}
    if "<s>" in specials:
        named["bos_token"] = "<s>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **named)


@contextlib.contextmanager
def made_on(device, dtype):
    """Modules made inside are allocated and initialised on `device`, in `dtype`."""
    import torch
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def build_encoders(size, device, dtype, seed=0):
    """(built, facts): encode_dataset.Encoder's `built` with random weights at the configs of
    `size`, and {name: {"params", "seconds"}}. On device "meta" nothing is allocated."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    configs = SIZES[size]["configs"]
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    makers = {
        "vae": lambda: AutoencoderKL(**configs["vae"]),
        "t5": lambda: T5EncoderModel._from_config(
            T5Config(**configs["t5"], pad_token_id=0, eos_token_id=1, decoder_start_token_id=0), dtype=dtype),
        "clip": lambda: CLIPTextModel._from_config(
            CLIPTextConfig(**configs["clip"], pad_token_id=0, eos_token_id=1, bos_token_id=3), dtype=dtype),
    }
    built, facts = {"names": {}}, {}
    for name, make in makers.items():
        torch.manual_seed(seed)
        sync()
        t0 = time.perf_counter()
        with made_on(device, dtype):
            built[name] = make().eval()
        sync()
        facts[name] = {"params": sum(p.numel() for p in built[name].parameters()),
                       "seconds": round(time.perf_counter() - t0, 3)}
        built["names"][name] = [f"random {size} {name} ({TOOL})", None]
    built["t5_tokenizer"] = word_tokenizer("$A </s>", ["<pad>", "</s>", "<unk>"])
    built["clip_tokenizer"] = word_tokenizer("<s> $A </s>", ["<pad>", "</s>", "<unk>", "<s>"])
    return built, facts


# ---- images -------------------------------------------------------------------------------------

# (width, height) / resolution: square, 3:2 both ways, 1920x1080 at 1024, an upscaled 3:4, 4:3,
# a 4-megapixel square and 4:5.
SHAPES = ((1, 1), (1.5, 1), (1, 1.5), (1.875, 1.055), (0.75, 1), (1.333, 1), (2, 2), (1, 1.25))


def synthetic_image(path, i, resolution, seed):
    """Image i as a JPEG at path, and its caption beside it in a .txt."""
    import numpy as np
    from PIL import Image, ImageDraw
    rng = np.random.default_rng([seed, i])
    fw, fh = SHAPES[i % len(SHAPES)]
    w, h = max(8, round(fw * resolution)), max(8, round(fh * resolution))
    field = rng.integers(0, 256, (int(rng.integers(3, 10)), int(rng.integers(3, 10)), 3), dtype=np.uint8)
    im = Image.fromarray(field).resize((w, h), Image.BICUBIC)
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(3, 9))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, w, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, h, 2))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=fill)
    # Grain, so that the JPEG holds texture as photographs do: one tile of noise repeated.
    tile = rng.integers(-12, 13, (64, 64, 1), dtype=np.int16)
    pixels = np.asarray(im, dtype=np.int16) + np.tile(tile, (h // 64 + 1, w // 64 + 1, 1))[:h, :w]
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(path, quality=90)
    words = rng.choice(CAPTION_WORDS[:-2], int(rng.integers(15, 91)))
    with open(os.path.splitext(path)[0] + ".txt", "w", encoding="utf-8") as f:
        f.write("a photo of " + " ".join(words) + " .\n")


def synthetic_images(folder, n, resolution, seed):
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda i: synthetic_image(os.path.join(folder, f"img_{i:06d}.jpg"), i, resolution, seed),
                      range(n)))


# ---- passes -------------------------------------------------------------------------------------

class StageClock:
    """Seconds per stage of the encoding loop; the device is synchronised at both ends of a
    stage, so that its GPU work counts in it."""

    def __init__(self, device):
        import torch
        self.seconds = collections.defaultdict(float)
        self.sync = (lambda: torch.cuda.synchronize(device)) if str(device).startswith("cuda") else (lambda: None)

    @contextlib.contextmanager
    def stage(self, name):
        self.sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] += time.perf_counter() - t0


def dataset_args(args, images, out, batch, workers):
    """encode_dataset's arguments for a pass."""
    argv = [images, "--out", out, "--resolution", str(args.resolution), "--text-seq-len", str(args.text_seq_len),
            "--batch", str(batch), "--workers", str(workers), "--device", args.device]
    for flag, value in (("--shard-size", args.shard_size), ("--storage", args.storage),
                        ("--encoder-dtype", args.encoder_dtype)):
        if value is not None:
            argv += [flag, str(value)]
    return ed.parse_args(argv)


def run_pass(args, built, work, batch, workers):
    """encode_dataset on WORK/images: a warm-up, then every image timed."""
    import torch
    cuda = args.device.startswith("cuda")
    out = os.path.join(work, f"shards-b{batch}-w{workers}")
    shutil.rmtree(out, ignore_errors=True)  # finished shards would be skipped, not timed
    dargs = dataset_args(args, os.path.join(work, "images"), out, batch, workers)
    enc = ed.Encoder(dargs, built)
    items = ed.collect_items(dargs)
    if args.warmup_batches:
        warm = dataset_args(args, dargs.inputs[0], os.path.join(work, "warmup"), batch, workers)
        ed.encode_items(warm, items[:batch * args.warmup_batches], enc)
        shutil.rmtree(warm.out)
    clock = StageClock(args.device)
    if cuda:
        torch.cuda.synchronize(args.device)
        torch.cuda.reset_peak_memory_stats(args.device)
    t0 = time.perf_counter()
    shards = ed.encode_items(dargs, items, enc, clock)
    clock.sync()
    seconds = time.perf_counter() - t0
    images = sum(s["samples"] for s in shards.values())
    stages = dict(clock.seconds)
    stages["other"] = max(0.0, seconds - sum(stages.values()))
    result = {"batch": batch, "workers": workers, "images": images,
              "skipped": sum(s["skipped"] for s in shards.values()), "seconds": round(seconds, 6),
              "images_per_s": round(images / seconds, 3),
              "stages": {k: {"seconds": round(stages.get(k, 0.0), 6),
                             "images_per_s": round(images / stages[k], 3) if stages.get(k) else None}
                         for k in STAGES + ("other",)},
              "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated(args.device) / GiB, 3) if cuda else None,
              "shards": {k: s["samples"] for k, s in sorted(shards.items())},
              "shard_bytes": sum(os.path.getsize(os.path.join(out, k)) for k in shards if shards[k]["samples"])}
    if args.work_dir:
        result["out"] = out
    else:
        shutil.rmtree(out)
    return result


# ---- report -------------------------------------------------------------------------------------

def device_name(device):
    import torch
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    import peer_bench
    return peer_bench.cpu_device_name()


def versions():
    import diffusers
    import PIL
    import tokenizers
    import torch
    import transformers
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "diffusers": diffusers.__version__, "tokenizers": tokenizers.__version__, "pillow": PIL.__version__}


def count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def describe_pass(r):
    lines = [f"batch {r['batch']}, workers {r['workers']}: {r['images_per_s']:.2f} images/s "
             f"({r['images']} images in {r['seconds']:.2f} s)"
             + (f", peak GPU memory {r['peak_gpu_memory_gib']:.1f} GiB" if r["peak_gpu_memory_gib"] is not None
                else ""),
             f"  {'stage':<12} {'seconds':>9} {'share':>6} {'images/s alone':>15}"]
    for name, s in r["stages"].items():
        alone = f"{s['images_per_s']:.2f}" if s["images_per_s"] else "-"
        lines.append(f"  {name:<12} {s['seconds']:>9.3f} {100 * s['seconds'] / r['seconds']:>5.1f}% {alone:>15}")
    return "\n".join(lines)


def write_json(path, value):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def measure(args, work):
    import torch
    t0 = time.perf_counter()
    synthetic_images(os.path.join(work, "images"), args.images, args.resolution, args.seed)
    image_seconds = time.perf_counter() - t0
    dtype = fe.device_and_dtype(args)[1]
    built, facts = build_encoders(args.size, args.device, dtype, args.seed)
    cuda = args.device.startswith("cuda")
    dargs = dataset_args(args, work, work, args.batch[0], args.workers[0])  # encode_dataset's defaults
    result = {"tool": "tools/encode_throughput.py", "size": args.size, "device": device_name(args.device),
              "versions": versions(),
              "settings": {"images": args.images, "resolution": args.resolution, "text_seq_len": args.text_seq_len,
                           "dtype": str(dtype).replace("torch.", ""), "warmup_batches": args.warmup_batches,
                           "shard_size": dargs.shard_size, "storage": dargs.storage,
                           "image_generation_seconds": round(image_seconds, 2)},
              "encoders": {k: dict(facts[k], config=SIZES[args.size]["configs"][k]) for k in facts},
              "weights_gpu_memory_gib": round(torch.cuda.memory_allocated(args.device) / GiB, 3) if cuda else None,
              "passes": []}
    print(f"{TOOL}: {result['device']}, {result['settings']['dtype']}; {args.images} images at {args.resolution} px "
          f"(made in {image_seconds:.2f} s), T5 {args.text_seq_len} tokens\nencoders ({args.size}): "
          + ", ".join(f"{k} {count(f['params'])} parameters built in {f['seconds']:.2f} s" for k, f in facts.items())
          + (f"; weights {result['weights_gpu_memory_gib']:.1f} GiB on the GPU" if cuda else ""), flush=True)
    write_json(args.json, result)
    for batch in args.batch:
        for workers in args.workers:
            r = run_pass(args, built, work, batch, workers)
            result["passes"].append(r)
            write_json(args.json, result)
            print(describe_pass(r), flush=True)
    return result


def main(argv=None):
    args = parse_args(argv)
    fe.import_torch_stack(TOOL)
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.size == "full" and not args.device.startswith("cuda"):
        fe.fail(TOOL, f"--size full builds a 4.7B-parameter T5 (9.5 GB in bfloat16) and needs a CUDA GPU, "
                      f"not {args.device}; --size tiny runs on the CPU")
    if args.resolution < 16 or args.resolution % 16:
        fe.fail(TOOL, f"--resolution {args.resolution}: must be a positive multiple of 16")
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
        measure(args, os.path.abspath(args.work_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="encode_throughput.") as work:
            measure(args, work)
    print(f"{TOOL}: wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
