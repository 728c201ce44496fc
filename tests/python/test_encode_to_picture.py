#!/usr/bin/env python3
"""From images and captions to a trained latent model and its pictures, with tiny encoders.

    python3 tests/python/test_encode_to_picture.py <flux8 binary> <source dir>

The encoders are randomly initialised from small configs and saved as the libraries save real
ones (AutoencoderKL with the Flux VAE's shape: 16 latent channels, 8x downsampling, scale and
shift; T5EncoderModel and CLIPTextModel with word-level tokenizers built here), so the tools
load them through the same from_pretrained paths as the real models, and nothing is
downloaded. A tiny Flux model takes their dimensions (context_dim = T5's d_model, vec_dim =
CLIP's hidden size, in_channels = 16 x 2x2).

Checks
  1. tools/encode_dataset.py on 16 generated images (various sizes) in a folder with .txt
     captions, a WebDataset tar and a CSV, plus an undecodable image and an empty caption: those
     two are reported by name and skipped (and listed in skipped.txt); with --on-bad stop the run
     stops naming the first.
     Shards hold the MLPerf members with the expected shapes and bf16 storage; a solid-colour
     image's mean equals the VAE's own encoding and a caption's t5/clip equal the encoders' own;
     the empty prompt file and dataset.yaml hold what the trainer needs. A second run writes
     nothing (resume).
  2. tools/encode_prompts.py writes t5.<i>, clip.<i>, the empty prompt and the prompts' text.
  3. 20 steps of `flux8 train` on the shards: a preview at step 10 in save_dir/samples/ (latents
     and a PNG decoded through the VAE: shapes, size, a real picture), the end-of-run grid, and
     a metrics.jsonl record of kind "sample" for each.
  4. `flux8 sample --out grid.png` on the checkpoint: the latents and the PNG; with no usable
     Python it says so, keeps the latents and exits 1.

Needs torch, diffusers, transformers, tokenizers, Pillow, numpy, safetensors. Without them it
exits 77 (skipped), except under CI (CI=true), where it fails.
"""
import contextlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile

FLUX8 = os.path.abspath(sys.argv[1])
SRC = os.path.abspath(sys.argv[2])
TOOLS = os.path.join(SRC, "tools")
RES, TEXT_LEN, CTX, VEC = 64, 16, 32, 32  # image side, T5 tokens, T5 d_model, CLIP hidden
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}
SHAPES = ["circle", "square", "stripe", "cross"]

try:
    import numpy as np
    import torch
    from diffusers import AutoencoderKL
    from PIL import Image, ImageDraw
    from safetensors import safe_open
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel
except ImportError as e:
    if os.environ.get("CI") == "true":
        sys.exit(f"FAIL: {e}: CI must have the Python packages of scripts/install_deps.sh")
    print(f"SKIP: {e} (scripts/install_deps.sh installs the Python packages)")
    sys.exit(77)

failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what)
    failures += not ok


def run_tool(script, args, expect=0):
    """A tool's main() in this process (which has imported torch already: each new Python
    process spends seconds importing it): its exit status and what it wrote to stderr."""
    sys.path.insert(0, TOOLS)
    module = __import__(script)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            status = module.main(args)
    except SystemExit as e:
        status = e.code
    if status != expect:
        print(err.getvalue()[-4000:])
        sys.exit(f"FAIL: tools/{script}.py exited {status}, expected {expect}")
    return err.getvalue()


def run(args, expect=0, env=None):
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    if r.returncode != expect:
        print(r.stdout[-4000:], r.stderr[-4000:])
        sys.exit(f"FAIL: {' '.join(args[:3])} ... exited {r.returncode}, expected {expect}")
    return r


# ---- tiny encoders ------------------------------------------------------------------------------

def word_tokenizer(words, template, specials):
    vocab = {t: i for i, t in enumerate(specials + sorted(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=template,
                                                       special_tokens=[(s, vocab[s]) for s in specials])
    return tok, len(vocab)


def make_encoders(root, words):
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 8, 8),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, norm_num_groups=4, sample_size=RES, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    vae.save_pretrained(os.path.join(root, "vae"))
    tok, n = word_tokenizer(words, "$A </s>", ["<pad>", "</s>", "<unk>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(os.path.join(root, "t5"))
    T5EncoderModel(T5Config(vocab_size=n, d_model=CTX, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                            feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1,
                            decoder_start_token_id=0)).save_pretrained(os.path.join(root, "t5"))
    tok, n = word_tokenizer(words, "<s> $A </s>", ["<pad>", "</s>", "<unk>", "<s>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                            unk_token="<unk>").save_pretrained(os.path.join(root, "clip"))
    CLIPTextModel(CLIPTextConfig(vocab_size=n, hidden_size=VEC, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=77, projection_dim=VEC,
                                 pad_token_id=0, eos_token_id=1, bos_token_id=3)).save_pretrained(
        os.path.join(root, "clip"))


# ---- data ---------------------------------------------------------------------------------------

def shape_image(i):
    colour, shape = list(COLOURS)[i % 4], SHAPES[i // 4]
    w, h = [(RES, RES), (96, 64), (64, 80), (128, 128)][i % 4]
    im = Image.new("RGB", (w, h), (250, 250, 250))
    d = ImageDraw.Draw(im)
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=fill)
    elif shape == "square":
        d.rectangle((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=fill)
    elif shape == "stripe":
        d.rectangle((0, h // 3, w, 2 * h // 3), fill=fill)
    else:
        d.line((0, 0, w, h), fill=fill, width=8)
    return im, f"a {colour} {shape}"


def png_bytes(im):
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def make_inputs(tmp):
    """16 images of a coloured shape (sizes vary, so resizing and cropping run) as the three kinds
    of input: 12 in a folder with .txt captions (and two bad inputs), 2 in a WebDataset tar (a .txt
    and a .json caption), 2 in a CSV. Returns the inputs and {source name: caption}."""
    folder, expected = os.path.join(tmp, "images"), {}
    os.makedirs(os.path.join(tmp, "table", "pics"))
    os.makedirs(folder)
    tar = tarfile.open(os.path.join(tmp, "extra.tar"), "w")
    rows = []
    for i in range(16):
        im, caption = shape_image(i)
        name = f"img_{i:02d}"
        if i == 0:  # a solid colour: its encoding is checked against the VAE's own
            im = Image.new("RGB", (RES, RES), COLOURS["red"])
        if i < 12:
            im.save(os.path.join(folder, name + ".png"))
            with open(os.path.join(folder, name + ".txt"), "w") as f:
                f.write(caption + "\n")
            expected[name + ".png"] = caption
        elif i < 14:
            text = caption.encode() if i == 12 else json.dumps({"caption": caption}).encode()
            for member, data in ((name + ".png", png_bytes(im)), (name + (".txt" if i == 12 else ".json"), text)):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            expected[f"extra.tar:{name}"] = caption
        else:
            im.save(os.path.join(tmp, "table", "pics", name + ".png"))
            rows.append((f"pics/{name}.png", caption))
            expected[f"table.csv row {len(rows)} (pics/{name}.png)"] = caption
    tar.close()
    with open(os.path.join(tmp, "table", "table.csv"), "w") as f:
        f.write("image,caption\n" + "".join(f"{p},{c}\n" for p, c in rows))
    with open(os.path.join(folder, "bad_corrupt.png"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n this is not an image")
    with open(os.path.join(folder, "bad_corrupt.txt"), "w") as f:
        f.write("a broken file\n")
    Image.new("RGB", (RES, RES), (0, 0, 0)).save(os.path.join(folder, "bad_empty.png"))
    open(os.path.join(folder, "bad_empty.txt"), "w").close()
    return [folder, os.path.join(tmp, "extra.tar"), os.path.join(tmp, "table", "table.csv")], expected


def npy_member(tf, name):
    return np.load(io.BytesIO(tf.extractfile(name).read()))


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_shards(out):
    samples = {}
    for name in sorted(os.listdir(out)):
        if not name.endswith(".tar"):
            continue
        with tarfile.open(os.path.join(out, name)) as tf:
            for m in tf.getmembers():
                if m.name.endswith(".json"):
                    key = m.name[:-5]
                    s = {"shard": name, "json": json.loads(tf.extractfile(m).read())}
                    for field in ("mean", "logvar", "t5", "clip"):
                        s[field] = npy_member(tf, f"{key}.{field}.bytes")
                    samples[key] = s
    return samples


def encoders_args(enc):
    return ["--t5", os.path.join(enc, "t5"), "--clip", os.path.join(enc, "clip"), "--text-seq-len", str(TEXT_LEN),
            "--device", "cpu"]


def check_encoding(out, enc, expected):
    samples = read_shards(out)
    check(len(samples) == 16, f"16 samples encoded (got {len(samples)})")
    check(sorted(n for n in os.listdir(out) if n.endswith(".tar")) ==
          ["train-000000.tar", "train-000001.tar", "train-000002.tar", "val-000000.tar"],
          "shards train-000000..2 (6 inputs each) and val-000000 (the last 2 inputs)")
    by_source = {s["json"]["source"]: s for s in samples.values()}
    check({k: s["json"]["caption"] for k, s in by_source.items()} == expected,
          "each sample's json carries its caption and source: folder, tar (.txt and .json captions), CSV")
    check(sorted(s["shard"] for s in samples.values() if "table.csv" in s["json"]["source"]) ==
          ["val-000000.tar"] * 2, "the last two inputs (the CSV's) are the validation shard")
    shapes_ok = all(s["mean"].shape == (16, RES // 8, RES // 8) and s["logvar"].shape == s["mean"].shape and
                    s["t5"].shape == (TEXT_LEN, CTX) and s["clip"].shape == (VEC,) for s in samples.values())
    check(shapes_ok, "mean/logvar [16, 8, 8], t5 [16, 32], clip [32]")
    check(all(s[f].dtype == np.uint16 for s in samples.values() for f in ("mean", "logvar", "t5", "clip")),
          "stored as bf16 bits ('<u2', the MLPerf convention)")
    values = np.concatenate([bf16_to_f32(s[f]).ravel() for s in samples.values() for f in ("mean", "t5", "clip")])
    check(bool(np.isfinite(values).all()) and float(np.abs(values).max()) < 100, "values finite and bounded")

    vae = AutoencoderKL.from_pretrained(os.path.join(enc, "vae"))
    x = torch.tensor(COLOURS["red"], dtype=torch.float32).view(1, 3, 1, 1).expand(1, 3, RES, RES) / 127.5 - 1
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mean[0].numpy()
    got = bf16_to_f32(by_source["img_00.png"]["mean"])
    check(np.allclose(got, want, rtol=1e-2, atol=1e-2), "a solid red image's mean is the VAE's encoding of it")
    tok = PreTrainedTokenizerFast.from_pretrained(os.path.join(enc, "t5"))
    t5 = T5EncoderModel.from_pretrained(os.path.join(enc, "t5"))
    ids = tok([expected["img_05.png"]], padding="max_length", max_length=TEXT_LEN, return_tensors="pt").input_ids
    with torch.no_grad():
        want = t5(input_ids=ids).last_hidden_state[0].numpy()
    got = bf16_to_f32(by_source["img_05.png"]["t5"])
    check(np.allclose(got, want, rtol=1e-2, atol=1e-2), "a caption's t5 is T5's last hidden state of it")
    with safe_open(os.path.join(out, "empty_prompt.safetensors"), "np") as f:
        check(f.get_tensor("t5").shape == (TEXT_LEN, CTX) and f.get_tensor("clip").shape == (VEC,),
              "empty_prompt.safetensors: t5 [16, 32], clip [32]")
    skipped = open(os.path.join(out, "skipped.txt")).read()
    check("bad_corrupt.png" in skipped and "bad_empty.png\tempty caption" in skipped,
          "skipped.txt names the undecodable image and the empty caption")
    yaml = dict(ln.split(": ", 1) for ln in open(os.path.join(out, "dataset.yaml")).read().splitlines()
                if ln and not ln.startswith("#"))
    check(yaml == {"train_data": os.path.join(out, "train-*.tar"), "valid_data": os.path.join(out, "val-*.tar"),
                   "empty_prompt_file": os.path.join(out, "empty_prompt.safetensors"), "image_size": str(RES),
                   "text_seq_len": str(TEXT_LEN), "vae_scale_factor": "0.3611", "vae_shift_factor": "0.1159"},
          f"dataset.yaml: the shards, empty prompt, size and the VAE's factors ({yaml})")


def encode_dataset(tmp, enc, inputs, expected):
    out = os.path.join(tmp, "data")
    args = [*inputs, "--out", out, "--resolution", str(RES), "--vae", os.path.join(enc, "vae"), "--shard-size", "6",
            "--val-count", "2", "--batch", "4"] + encoders_args(enc)
    err = run_tool("encode_dataset", args + ["--on-bad", "stop"], expect=1)
    check("stopped at bad_corrupt.png: image does not decode" in err, "--on-bad stop names the bad image")
    shutil.rmtree(out)
    r = run([sys.executable, os.path.join(TOOLS, "encode_dataset.py")] + args)  # as a command, once
    check("skipped bad_empty.png: empty caption" in r.stderr and "skipped bad_corrupt.png" in r.stderr,
          "the bad inputs are reported by name")
    check_encoding(out, enc, expected)
    stamps = {n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out) if n.endswith(".tar")}
    err = run_tool("encode_dataset", args)
    check("(4 already written)" in err and stamps == {
        n: os.stat(os.path.join(out, n)).st_mtime_ns for n in os.listdir(out) if n.endswith(".tar")},
        "a second run finds every shard written and rewrites none")
    return out


# ---- training and pictures ----------------------------------------------------------------------

MODEL = """model_name: flux_tiny_latent
hidden_size: 32
num_attention_heads: 2
num_double_blocks: 1
num_single_blocks: 1
in_channels: 64
out_channels: 0
context_dim: 32
vec_dim: 32
mlp_ratio: 2.0
guidance_embed: true
qkv_bias: true
axes_dim: [4, 6, 6]
latent_channels: 16
patch_size: 2
vae_downsample: 8
"""


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24]) if head[1:4] == b"PNG" else (0, 0)


def check_picture(png, latents, rows, per_row, what):
    with safe_open(latents, "np") as f:
        z = f.get_tensor("latents")
        meta = f.metadata()
    check(z.shape == (rows * per_row, 16, RES // 8, RES // 8) and bool(np.isfinite(z).all()),
          f"{what}: latents [{rows * per_row}, 16, 8, 8], finite")
    w, h = png_size(png)
    want = (per_row * RES + (per_row - 1) * 2, rows * RES + (rows - 1) * 2)
    check((w, h) == want, f"{what}: {os.path.basename(png)} is a {want[0]}x{want[1]} grid (got {w}x{h})")
    pixels = np.asarray(Image.open(png).convert("RGB"), dtype=np.float32)
    check(float(pixels[:RES, :RES].std()) > 0.5, f"{what}: the decoded cells are pictures, not a flat fill")
    return meta


def train(tmp, data, enc, prompts, env):
    with open(os.path.join(tmp, "model.yaml"), "w") as f:
        f.write(MODEL)
    save = os.path.join(tmp, "run")
    with open(os.path.join(tmp, "run.yaml"), "w") as f:
        f.write(f"include: [model.yaml, {os.path.join(data, 'dataset.yaml')}]\n"
                f"backend: cpu\nmicro_batch_size: 4\ntrain_iters: 20\nlr: 1.0e-3\nlr_warmup_iters: 2\n"
                f"save_dir: {save}\nlog_interval: 5\ndata_shuffle_buffer: 16\n"
                f"sample_interval: 10\nsample_text_embeddings: {prompts}\nsample_vae: {os.path.join(enc, 'vae')}\n"
                f"sample_steps: 4\nsamples_per_prompt: 2\nsample_guidance: 4.0\n")
    run([FLUX8, "train", "-c", os.path.join(tmp, "run.yaml")], env=env)
    samples = os.path.join(save, "samples")
    check(sorted(os.listdir(samples)) == ["step-0000010.latents.safetensors", "step-0000010.png"],
          f"save_dir/samples holds the step-10 preview ({sorted(os.listdir(samples))})")
    meta = check_picture(os.path.join(samples, "step-0000010.png"),
                         os.path.join(samples, "step-0000010.latents.safetensors"), 2, 2, "preview")
    check(json.loads(meta["prompts"]) == ["a red circle", "a blue cross"] and meta["guidance"] == "4",
          "the preview's latents name the prompts and the guidance")
    check_picture(os.path.join(save, "samples.png"), os.path.join(save, "samples.latents.safetensors"), 2, 2,
                  "end of run")
    records = [json.loads(ln) for ln in open(os.path.join(save, "metrics.jsonl"))]
    pics = [(r["step"], r["tag"], os.path.basename(r["path"]), r["width"]) for r in records if r.get("kind") == "sample"]
    check(pics == [(10, "samples/preview", "step-0000010.png", 130), (20, "samples/final", "samples.png", 130)],
          f"metrics.jsonl: a record of kind 'sample' for each picture ({pics})")
    return os.path.join(save, "step-0000020")


def sample(tmp, ckpt, enc, prompts, env):
    out = os.path.join(tmp, "grid.png")
    cmd = [FLUX8, "sample", "--checkpoint", ckpt, "--text-embeddings", prompts, "--steps", "4", "--per-prompt", "3",
           "--vae", os.path.join(enc, "vae"), "--cfg-scale", "2"]
    run(cmd + ["--out", out], env=env)
    meta = check_picture(out, os.path.join(tmp, "grid.latents.safetensors"), 2, 3, "flux8 sample")
    check(meta["guidance"] == "4" and meta["shift"] == "true",
          "flux8 sample: guidance from the config's sample_guidance, the Flux time shift on")
    no_python = dict(env, FLUX8_PYTHON=os.path.join(tmp, "no-such-python"))
    r = run(cmd + ["--out", os.path.join(tmp, "nopy.png")], expect=1, env=no_python)
    check(not os.path.exists(os.path.join(tmp, "nopy.png")) and
          os.path.isfile(os.path.join(tmp, "nopy.latents.safetensors")) and "no Python interpreter" in r.stderr and
          "latents are kept" in r.stderr, "without Python: says so, keeps the latents, exit status 1")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        inputs, expected = make_inputs(tmp)
        words = {w for c in expected.values() for w in c.split()} | {"broken", "file"}
        enc = os.path.join(tmp, "encoders")
        make_encoders(enc, words)
        data = encode_dataset(tmp, enc, inputs, expected)
        prompts = os.path.join(tmp, "prompts.safetensors")
        run_tool("encode_prompts", ["--prompt", "a red circle", "--prompt", "a blue cross", "--out", prompts] +
                 encoders_args(enc))
        with safe_open(prompts, "np") as f:
            check(sorted(f.keys()) == ["clip.0", "clip.1", "clip.empty", "t5.0", "t5.1", "t5.empty"] and
                  f.get_tensor("t5.1").shape == (TEXT_LEN, CTX) and f.get_tensor("clip.0").shape == (VEC,),
                  "encode_prompts: t5.<i> [16, 32], clip.<i> [32] and the empty prompt")
        env = dict(os.environ, FLUX8_PYTHON=sys.executable, OMP_NUM_THREADS="2")
        ckpt = train(tmp, data, enc, prompts, env)
        sample(tmp, ckpt, enc, prompts, env)
    print(f"{failures} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
