#!/usr/bin/env python3
"""Encode images and captions into the WebDataset shards `flux8 train` reads.

    python3 tools/encode_dataset.py INPUT [INPUT ...] --out DIR --resolution 512 --text-seq-len 512 \\
        --flux-repo black-forest-labs/FLUX.1-dev          # or --vae ... --t5 ... --clip ...

INPUT is any of
  a folder        images (.jpg .jpeg .png .webp .bmp .gif .tif .tiff, searched recursively) with
                  their captions in same-named .txt files (photo.jpg + photo.txt)
  WebDataset tars image members (jpg, png, webp, ...) with a .txt caption or a .json whose
                  "caption" / "text" / "prompt" holds it; a glob ("shards/*.tar") is expanded
  a .csv/.parquet one row per image: --image-column (a path, relative to the table's folder;
                  in parquet also {"bytes": ...} or raw bytes) and --caption-column

Every image is resized (short side to --resolution, Lanczos) and centre-cropped to a square of
--resolution pixels: flux8 trains on one square resolution, it has no aspect-ratio buckets.

DIR receives (the MLPerf Flux preprocessed layout, one sample per image):
  train-NNNNNN.tar          KEY.mean.bytes, KEY.logvar.bytes  VAE posterior [16, r/8, r/8]
                            KEY.t5.bytes   T5 last hidden state [text_seq_len, 4096]
                            KEY.clip.bytes CLIP pooled output [768]
                            KEY.json       {"key", "caption", "source"}
                            (.bytes members are .npy images: bf16 as '<u2' bits, or f32)
  val-NNNNNN.tar            the last --val-count inputs, the same way (flux8's validation set)
  empty_prompt.safetensors  "t5" and "clip" of the empty prompt (text dropout: empty_prompt_file)
  dataset.yaml              the config keys for these shards: include it from a run config
  dataset.json              settings and the samples of each finished shard
  skipped.txt               the inputs left out, one per line with the reason

The inputs are read in the order given, each one's images sorted, and shard k holds images
[k*S, (k+1)*S) of that order (S = --shard-size), so a run that is stopped and started again with
the same arguments skips the shards already written (each is written to a temporary name and
renamed when complete) and encodes the rest. Images that do not decode and empty captions are
reported by name and skipped (--on-bad skip, the default) or stop the run (--on-bad stop). Work
runs in batches on the GPU when there is one.

tools/encode_throughput.py measures this tool's images/s (encode_items, with the stages timed).

Needs torch, diffusers, transformers and Pillow (pyarrow for parquet). Exit status: 0 done; 1 an
error or a bad input under --on-bad stop; 3 a package is missing.
"""
import argparse
import collections
import csv
import glob
import io
import json
import os
import sys
import tarfile
import threading
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flux_encoders as fe  # noqa: E402

TOOL = "encode_dataset"
IMAGE_EXTENSIONS = {"jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff"}
JSON_CAPTION_KEYS = ("caption", "text", "prompt")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="folders, WebDataset tars (globs too), .csv or .parquet files")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resolution", type=int, required=True,
                   help="image side in pixels (the config's image_size; a multiple of 16)")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="images per encoder call (default %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="threads decoding images (default %(default)s)")
    p.add_argument("--storage", choices=["bf16", "f32"], default="bf16",
                   help="dtype of the stored tensors (default %(default)s, as the MLPerf shards)")
    p.add_argument("--val-count", type=int, default=0,
                   help="the last N inputs go to val-*.tar for validation (default %(default)s)")
    p.add_argument("--on-bad", choices=["skip", "stop"], default="skip",
                   help="an image that does not decode or an empty caption: report and skip it, or "
                        "stop the run (default %(default)s)")
    p.add_argument("--image-column", default="image", help="table inputs: the image column (default %(default)s)")
    p.add_argument("--caption-column", default="caption",
                   help="table inputs: the caption column (default %(default)s)")
    fe.add_encoder_args(p)
    args = p.parse_args(argv)
    if args.resolution < 16 or args.resolution % 16:
        p.error(f"--resolution {args.resolution}: must be a positive multiple of 16 "
                "(VAE downsampling 8 x patch 2)")
    for name in ("shard_size", "batch", "workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.val_count < 0:
        p.error("--val-count must not be negative")
    return args


# ---- inputs -------------------------------------------------------------------------------------

class Item:
    """One input: where it came from (for reports), its caption, and how to read its image."""

    def __init__(self, source, caption, read_image, problem=None):
        self.source, self.caption, self.read_image, self.problem = source, caption, read_image, problem


def read_file(path):
    return lambda: open(path, "rb").read()


def folder_items(folder):
    items = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if ext[1:].lower() not in IMAGE_EXTENSIONS:
                continue
            path = os.path.join(root, name)
            txt = os.path.join(root, stem + ".txt")
            rel = os.path.relpath(path, folder)
            if not os.path.isfile(txt):
                items.append(Item(rel, "", read_file(path), f"no caption file {stem}.txt"))
                continue
            with open(txt, encoding="utf-8", errors="replace") as f:
                items.append(Item(rel, f.read().strip(), read_file(path)))
    return items


def tar_caption(tf, member, ext):
    data = tf.extractfile(member).read().decode("utf-8", errors="replace")
    if ext == "txt":
        return data.strip()
    meta = json.loads(data)
    for k in JSON_CAPTION_KEYS:
        if isinstance(meta, dict) and isinstance(meta.get(k), str):
            return meta[k].strip()
    return ""


def read_member(tf, member, lock):
    with lock:
        return tf.extractfile(member).read()


def tar_items(path):
    """Samples of a WebDataset tar: members grouped by key (path up to the basename's first dot)."""
    tf = tarfile.open(path)
    lock = threading.Lock()  # the decoding threads share the tar's file position
    groups = {}
    for m in tf.getmembers():
        if not m.isfile():
            continue
        d, base = os.path.split(m.name)
        if "." not in base or base.startswith("."):
            continue
        stem, ext = base.split(".", 1)
        groups.setdefault(os.path.join(d, stem), {})[ext.lower()] = m
    items = []
    for key in sorted(groups):
        members = groups[key]
        image = next((members[e] for e in sorted(members) if e in IMAGE_EXTENSIONS), None)
        source = f"{os.path.basename(path)}:{key}"
        if image is None:
            items.append(Item(source, "", None, "no image member"))
            continue
        caption, problem = "", "no .txt or .json caption"
        for ext in ("txt", "json"):
            if ext in members:
                try:
                    caption, problem = tar_caption(tf, members[ext], ext), None
                except ValueError as e:
                    problem = f"unreadable {ext} caption: {e}"
                break
        items.append(Item(source, caption, (lambda m=image: read_member(tf, m, lock)), problem))
    return items


def table_rows(path):
    if path.lower().endswith(".csv"):
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    try:
        import pyarrow.parquet as pq
    except ImportError:
        fe.fail(TOOL, f"{path}: reading parquet needs pyarrow (python3 -m pip install pyarrow)", fe.MISSING_PACKAGES)
    return pq.read_table(path).to_pylist()


def table_items(path, image_col, caption_col):
    rows = table_rows(path)
    if rows and (image_col not in rows[0] or caption_col not in rows[0]):
        fe.fail(TOOL, f"{path}: no column '{image_col}' or '{caption_col}' (columns: {sorted(rows[0])}); "
                      "name them with --image-column and --caption-column")
    base = os.path.dirname(os.path.abspath(path))
    items = []
    for i, row in enumerate(rows):
        image, caption = row[image_col], row[caption_col]
        caption = caption.strip() if isinstance(caption, str) else ""
        source = f"{os.path.basename(path)} row {i + 1}"
        if isinstance(image, dict) and image.get("bytes") is not None:
            items.append(Item(source, caption, (lambda b=image["bytes"]: b)))
        elif isinstance(image, (bytes, bytearray)):
            items.append(Item(source, caption, (lambda b=bytes(image): b)))
        elif isinstance(image, str) and image:
            full = image if os.path.isabs(image) else os.path.join(base, image)
            items.append(Item(f"{source} ({image})", caption, read_file(full)))
        else:
            items.append(Item(source, caption, None, f"no image in column '{image_col}'"))
    return items


def collect_items(args):
    items = []
    for spec in args.inputs:
        paths = sorted(glob.glob(spec)) if any(c in spec for c in "*?[") else [spec]
        if not paths:
            fe.fail(TOOL, f"{spec}: matches no file")
        for path in paths:
            if os.path.isdir(path):
                items += folder_items(path)
            elif path.lower().endswith(".tar"):
                items += tar_items(path)
            elif path.lower().endswith((".csv", ".parquet")):
                items += table_items(path, args.image_column, args.caption_column)
            else:
                fe.fail(TOOL, f"{path}: not a folder, .tar, .csv or .parquet")
    if not items:
        fe.fail(TOOL, f"no images found in {' '.join(args.inputs)}")
    return items


# ---- images -------------------------------------------------------------------------------------

def square_pixels(data, resolution):
    """Image bytes -> float tensor [3, r, r] in [-1, 1]: short side resized to r, centre-cropped."""
    import numpy as np
    import torch
    from PIL import Image, ImageOps
    with Image.open(io.BytesIO(data)) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            im = Image.new("RGB", rgba.size, (255, 255, 255))
            im.paste(rgba, mask=rgba.getchannel("A"))
        else:
            im = im.convert("RGB")
    w, h = im.size
    scale = resolution / min(w, h)
    size = (max(resolution, round(w * scale)), max(resolution, round(h * scale)))
    im = im.resize(size, Image.LANCZOS)
    left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    im = im.crop((left, top, left + resolution, top + resolution))
    x = torch.from_numpy(np.asarray(im, dtype=np.float32).copy()).permute(2, 0, 1)
    return x / 127.5 - 1.0


def prepare(item, resolution):
    """(pixels, None) or (None, why the item is left out)."""
    if item.problem:
        return None, item.problem
    if not item.caption:
        return None, "empty caption"
    try:
        return square_pixels(item.read_image(), resolution), None
    except Exception as e:  # PIL raises many types for damaged or unknown files
        return None, f"image does not decode: {type(e).__name__}: {e}"


# ---- shards -------------------------------------------------------------------------------------

def add_member(tf, name, data):
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tf.addfile(info, io.BytesIO(data))


def write_shard(path, records, storage):
    """records: (key, caption, source, mean, logvar, t5, clip); written whole, then renamed."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
        for key, caption, source, mean, logvar, t5, clip in records:
            meta = {"key": key, "caption": caption, "source": source}
            add_member(tf, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode())
            for field, t in (("mean", mean), ("logvar", logvar), ("t5", t5), ("clip", clip)):
                add_member(tf, f"{key}.{field}.bytes", fe.npy_bytes(t, storage))
    os.replace(tmp, path)


class Encoder:
    """The VAE and the text encoders the arguments name, or those in `built` (fe.TextEncoders'
    keys plus "vae", and "names" for "vae" too), made by the caller."""

    def __init__(self, args, built=None):
        self.text = fe.TextEncoders(args, TOOL, built)
        if built is None:
            self.vae, self.device, self.dtype = fe.load_vae(args, TOOL)
            self.vae_name = list(fe.locations(args, TOOL)["vae"])
        else:
            self.device, self.dtype = fe.device_and_dtype(args)
            self.vae, self.vae_name = built["vae"].to(self.device).eval(), built["names"]["vae"]

    def encode(self, pixels, captions, clock=fe.NO_CLOCK):
        import torch
        with torch.no_grad(), clock.stage("vae"):
            x = torch.stack(pixels).to(self.device, self.dtype)
            dist = self.vae.encode(x).latent_dist
            mean, logvar = dist.mean.float().cpu(), dist.logvar.float().cpu()
        t5, clip = self.text.encode(captions, clock)
        return mean, logvar, t5, clip


def prepared_batches(items, args, pool, clock=fe.NO_CLOCK):
    """Yields [(index, item, pixels, why)] a batch at a time; the next two batches decode on the
    pool's threads while one encodes, and at most three batches of pixels are held. The clock's
    "decode_wait" stage is the time spent waiting for those threads."""
    def ready(futures):
        with clock.stage("decode_wait"):
            return [(i, it, *f.result()) for i, it, f in futures]

    queue = collections.deque()
    for start in range(0, len(items), args.batch):
        chunk = list(enumerate(items[start:start + args.batch], start))
        queue.append([(i, it, pool.submit(prepare, it, args.resolution)) for i, it in chunk])
        if len(queue) > 2:
            yield ready(queue.popleft())
    while queue:
        yield ready(queue.popleft())


def encode_shard(enc, args, items, first, pool, bar, report, clock=fe.NO_CLOCK):
    """Encodes items (inputs first, first + 1, ...) into records; bad ones go to report(item, why)."""
    records = []
    for batch in prepared_batches(items, args, pool, clock):
        good = []
        for i, item, pixels, why in batch:
            if why:
                report(item, why)
            else:
                good.append((i, item, pixels))
        if good:
            mean, logvar, t5, clip = enc.encode([p for _, _, p in good], [it.caption for _, it, _ in good], clock)
            for j, (i, item, _) in enumerate(good):
                records.append((f"{first + i:09d}", item.caption, item.source, mean[j], logvar[j], t5[j], clip[j]))
        bar.update(len(batch))
    return records


# ---- the run ------------------------------------------------------------------------------------

class PlainBar:
    """A progress line for when tqdm is not installed."""

    def __init__(self, total, desc):
        self.total, self.n, self.desc, self.last = total, 0, desc, -1

    def update(self, k):
        self.n += k
        pct = 100 * self.n // max(1, self.total)
        if pct != self.last:
            self.last = pct
            print(f"\r{self.desc}: {self.n}/{self.total} ({pct}%)", end="", file=sys.stderr, flush=True)

    def close(self):
        print(file=sys.stderr)


def progress_bar(total, desc):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="img")
    except ImportError:
        return PlainBar(total, desc)


def shard_plan(n_items, args):
    """[(shard name, first item, end item)]: train shards, then the validation ones."""
    n_val = min(args.val_count, n_items)
    plan = []
    for prefix, start, end in (("train", 0, n_items - n_val), ("val", n_items - n_val, n_items)):
        for k, first in enumerate(range(start, end, args.shard_size)):
            plan.append((f"{prefix}-{k:06d}.tar", first, min(end, first + args.shard_size)))
    return plan


def settings_of(args, enc, n_items):
    scale, shift = fe.vae_factors(enc.vae)
    return {"resolution": args.resolution, "text_seq_len": args.text_seq_len, "storage": args.storage,
            "shard_size": args.shard_size, "val_count": args.val_count, "inputs": n_items,
            "vae": list(enc.vae_name), "t5": list(enc.text.names["t5"]),
            "clip": list(enc.text.names["clip"]), "vae_scale_factor": scale, "vae_shift_factor": shift,
            "context_dim": enc.text.context_dim, "vec_dim": enc.text.vec_dim,
            "vae_downsample": fe.vae_downsample(enc.vae), "latent_channels": enc.vae.config.latent_channels}


def load_manifest(path, settings):
    """The finished shards of an earlier run with the same settings; stops on other settings."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        old = json.load(f)
    if old.get("settings") != settings:
        changed = sorted(k for k in settings if old.get("settings", {}).get(k) != settings[k])
        fe.fail(TOOL, f"{path} was written with other settings ({', '.join(changed)} differ); "
                      "encode into a new --out, or delete the old shards and dataset.json")
    return old.get("shards", {})


def write_json(path, value):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
    os.replace(tmp, path)


def write_config(out, settings, shards):
    has_val = any(name.startswith("val-") for name in shards)
    lines = ["# The config keys of these shards (tools/encode_dataset.py): include this file after the",
             "# model's, e.g. `include: [models/flux_12b_dev.yaml, " + os.path.join(out, "dataset.yaml") + "]`.",
             f"# The model must take their encodings: context_dim {settings['context_dim']} (T5), "
             f"vec_dim {settings['vec_dim']} (CLIP),",
             f"# vae_downsample {settings['vae_downsample']}, in_channels {settings['latent_channels'] * 4} "
             f"({settings['latent_channels']} latent channels x 2x2 patches).",
             f"train_data: {os.path.join(out, 'train-*.tar')}"]
    if has_val:
        lines.append(f"valid_data: {os.path.join(out, 'val-*.tar')}")
    lines += [f"empty_prompt_file: {os.path.join(out, 'empty_prompt.safetensors')}",
              f"image_size: {settings['resolution']}",
              f"text_seq_len: {settings['text_seq_len']}",
              f"vae_scale_factor: {settings['vae_scale_factor']!r}",
              f"vae_shift_factor: {settings['vae_shift_factor']!r}"]
    with open(os.path.join(out, "dataset.yaml"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    args = parse_args(argv)
    fe.import_torch_stack(TOOL)
    items = collect_items(args)
    encode_items(args, items, Encoder(args))
    return 0


def encode_items(args, items, enc, clock=fe.NO_CLOCK):
    """The shards of items in args.out, those of an earlier run with the same settings kept;
    returns {shard name: {"samples", "skipped"}}. The clock times the stages: decode_wait, vae,
    t5, clip (Encoder.encode) and write."""
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    settings = settings_of(args, enc, len(items))
    manifest_path = os.path.join(out, "dataset.json")
    done = load_manifest(manifest_path, settings)
    # A finished shard is in the manifest and on disk (or held no usable input).
    finished = {k: v for k, v in done.items() if v["samples"] == 0 or os.path.isfile(os.path.join(out, k))}
    plan = [(name, a, b) for name, a, b in shard_plan(len(items), args) if name not in finished]
    t5, clip = enc.text.encode([""])
    fe.write_empty_prompt(os.path.join(out, "empty_prompt.safetensors"), t5[0], clip[0],
                          {"producer": "tools/encode_dataset.py", "text_seq_len": str(args.text_seq_len)})
    shards = dict(finished)
    print(f"{TOOL}: {len(items)} inputs, {len(shard_plan(len(items), args))} shards of up to {args.shard_size} "
          f"({len(shards)} already written); {args.resolution} px, T5 {args.text_seq_len} tokens, on "
          f"{enc.device} ({str(enc.dtype).replace('torch.', '')})", file=sys.stderr)
    bar = progress_bar(sum(b - a for _, a, b in plan), TOOL)
    skipped_total = 0
    with ThreadPoolExecutor(args.workers) as pool:
        for name, first, end in plan:
            skipped = []

            def report(item, why):
                print(f"\n{TOOL}: {'skipped' if args.on_bad == 'skip' else 'stopped at'} {item.source}: {why}",
                      file=sys.stderr)
                if args.on_bad == "stop":
                    fe.fail(TOOL, f"{item.source}: {why} (--on-bad skip leaves such inputs out); the shards "
                                  "written so far are kept, and a new run with the same arguments goes on from them")
                skipped.append(f"{item.source}\t{why}")

            records = encode_shard(enc, args, items[first:end], first, pool, bar, report, clock)
            if records:
                with clock.stage("write"):
                    write_shard(os.path.join(out, name), records, args.storage)
            shards[name] = {"samples": len(records), "skipped": len(skipped)}
            skipped_total += len(skipped)
            if skipped:
                with open(os.path.join(out, "skipped.txt"), "a", encoding="utf-8") as f:
                    f.write("\n".join(skipped) + "\n")
            write_json(manifest_path, {"producer": "tools/encode_dataset.py", "settings": settings, "shards": shards})
    bar.close()
    write_config(out, settings, {k: v for k, v in shards.items() if v["samples"]})
    samples = sum(v["samples"] for v in shards.values())
    print(f"{TOOL}: {samples} samples in {sum(1 for v in shards.values() if v['samples'])} shards in {out}"
          + (f"; {skipped_total} inputs skipped (listed in {os.path.join(out, 'skipped.txt')})" if skipped_total
             else "") + f"\n  train with: include {os.path.join(out, 'dataset.yaml')} in your run config",
          file=sys.stderr)
    return shards


if __name__ == "__main__":
    sys.exit(main())
