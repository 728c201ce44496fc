#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/<target>/: a few small
valid inputs per format and near-valid ones (one field off) that reach the error paths.
Standard library only; the output is deterministic. Run it again after changing a format."""
import hashlib
import io
import json
import os
import shutil
import struct
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def npy(descr, shape, payload, version=1, fortran=False):
    header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (
        descr, "True" if fortran else "False", "(%s)" % "".join("%d," % d for d in shape) if shape else "()")
    len_bytes = 2 if version == 1 else 4
    total = 6 + 2 + len_bytes + len(header) + 1
    header += " " * ((-total) % 64) + "\n"
    fmt = "<H" if version == 1 else "<I"
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack(fmt, len(header)) + header.encode("latin1") + payload


def safetensors(tensors, metadata=None, header_override=None):
    header, data = {}, b""
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    if metadata:
        header["__metadata__"] = metadata
    text = header_override if header_override is not None else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    raw += b" " * ((-len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def tar(members, fmt=tarfile.USTAR_FORMAT, pax=None):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(payload), 0, 0o644
            info.pax_headers = dict(pax or {})
            t.addfile(info, io.BytesIO(payload))
    # The end marker (two zero blocks) without tarfile's padding to a 10 KiB record.
    data = buf.getvalue()
    end = len(data.rstrip(b"\0"))
    return data[:end + (-end) % 512 + 1024]


def base256_sizes(archive):
    """The archive with its first header's size in GNU base-256 (valid, and what large members use)."""
    data = bytearray(archive)
    size = int(data[124:136].split(b"\0")[0] or b"0", 8)
    data[124:136] = b"\x80" + size.to_bytes(11, "big")
    data[148:156] = b" " * 8
    data[148:156] = b"%06o\0 " % sum(data[:512])
    return bytes(data)


def f32(*values):
    return struct.pack("<%df" % len(values), *values)


def corpus_safetensors():
    return {
        "f32_2x2": safetensors({"w": ("F32", [2, 2], f32(1, 2, 3, 4))}),
        "mixed_meta": safetensors({"a": ("BF16", [3], b"\x80\x3f\x00\x40\x40\x40"), "s": ("F64", [], struct.pack("<d", 0.5)),
                                   "i": ("I64", [1], struct.pack("<q", -7))}, metadata={"format": "pt"}),
        "empty_tensor": safetensors({"e": ("F16", [0, 4], b"")}),
        "empty_header": safetensors({}, header_override="{}"),
        "offsets_past_end": safetensors({"w": ("F32", [2], f32(1))},
                                        header_override='{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
        "header_length_too_large": struct.pack("<Q", 1 << 40) + b"{}",
    }


def corpus_npy():
    return {
        "f4_2x3_v1": npy("<f4", (2, 3), f32(*range(6))),
        "u2_v2": npy("<u2", (4,), struct.pack("<4H", 0x3F80, 0x4000, 0, 0xBF80), version=2),
        "f8_scalar_v3": npy("<f8", (), struct.pack("<d", 1.25), version=3),
        "f2_zero_size": npy("<f2", (0, 3), b""),
        "fortran_order": npy("<f4", (2,), f32(1, 2), fortran=True),
        "big_endian": npy(">f4", (1,), struct.pack(">f", 1.0)),
    }


def corpus_webdataset():
    sample = [("000000.image.npy", npy("<f4", (2, 2), f32(1, 2, 3, 4))), ("000000.txt", b"red circle top left"),
              ("000000.json", b'{"timestep": 3}')]
    raw = [("000001.t5.bytes", struct.pack("<4H", 0x3F80, 0, 0, 0)),
           ("000001.json", json.dumps({"shapes": {"t5": [2, 2]}, "dtypes": {"t5": "bf16"}}).encode())]
    st = [("000002.latents.safetensors", safetensors({"latent": ("F32", [1, 2], f32(5, 6))}))]
    long_name = [("d" * 120 + "/000003.clip.npy", npy("<f4", (2,), f32(7, 8)))]
    good = tar(sample + raw)
    return {
        "samples": good,
        "safetensors_member": tar(st),
        "gnu_long_name": tar(long_name, fmt=tarfile.GNU_FORMAT),
        "pax_long_name": tar(long_name, fmt=tarfile.PAX_FORMAT),
        "truncated": good[:len(good) - 1024 - 300],
        "gnu_base256_size": base256_sizes(tar(sample[:2])),
        "pax_size": tar([("000005.txt", b"pax sized caption")], fmt=tarfile.PAX_FORMAT, pax={"size": "17"}),
        "bad_json_shape": tar([("000004.t5.bytes", b"\0" * 8), ("000004.json", b'{"t5": {"shape": [3], "dtype": "f32"}}')]),
    }


def corpus_config():
    sep = "\n#--\n"
    model = ("hidden_size: 64\nnum_attention_heads: 2\nnum_double_blocks: 1\nnum_single_blocks: 1\n"
             "axes_dim: [8, 12, 12]\nmlp_ratio: 2.5\npatch_size: 2\nimage_size: 64\n")
    return {
        "demo": open(os.path.join(HERE, "..", "..", "configs", "demo.yaml")).read().replace(
            "include: models/flux_tiny_demo.yaml", "include: a.yaml") + sep +
        open(os.path.join(HERE, "..", "..", "configs", "models", "flux_tiny_demo.yaml")).read(),
        "include_chain": "include: a.yaml\nmicro_batch_size: 4\n" + sep + "bases: [b.yaml]\nlr: 2.0e-4\n" + sep +
        "image_size: 64\n" + sep + "train_iters=10\naxes_dim=[8,12,12]\n",
        "include_cycle": "include: a.yaml\n" + sep + "include: main.yaml\n",
        "overrides_only": "" + sep + sep + sep + "hidden_size=3072\nnum_attention_heads=24\nprecision=delayed\n",
        "model_small": model,
        "bad_value": "micro_batch_size: -1\nunknown_key: 3\n",
    }


def corpus_checkpoint_json():
    state = {"step": 1, "consumed_samples": 16, "data_epoch": 0, "data_position": 16, "seed": 1234,
             "skipped_steps": 0, "last_loss": 0.5, "config_yaml": "micro_batch_size: 16\n", "flux8_version": "0.1.0"}
    # The fuzz target's checkpoint directory holds these files (fuzz_checkpoint_json.cpp).
    files = {"model.safetensors": b"m", "optimizer.safetensors": b"op", "trainer_state.json": b"{}\n",
             "fp8_state.safetensors": b""}
    records = {n: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}
    manifest = {"format": "flux8-checkpoint", "format_version": 2, "step": 1, "files": records}
    pieces = dict(manifest, files=dict(records, **{"model.safetensors": {
        "bytes": 1, "piece_bytes": 1, "piece_sha256": [hashlib.sha256(b"m").hexdigest()]}}))
    wrong = dict(manifest, files=dict(records, **{"optimizer.safetensors": {"bytes": 2, "sha256": "0" * 64}}))
    return {
        "trainer_state": json.dumps(state, indent=2),
        "trainer_state_nan": json.dumps(dict(state, last_loss="nan")),
        "trainer_state_negative": json.dumps(dict(state, data_position=-1)),
        "manifest": json.dumps(manifest, indent=2),
        "manifest_pieces": json.dumps(pieces),
        "manifest_wrong_digest": json.dumps(wrong),
    }


def corpus_safetensors_index():
    # The fuzz target's folder holds s-1.safetensors (a, b) and s-2.safetensors (c)
    # (fuzz_safetensors_index.cpp).
    good = {"a": "s-1.safetensors", "b": "s-1.safetensors", "c": "s-2.safetensors"}
    index = lambda m, **meta: json.dumps({"metadata": dict({"total_size": 24}, **meta), "weight_map": m})  # noqa: E731
    return {
        "index": index(good),
        "index_wrong_shard": index(dict(good, c="s-1.safetensors")),
        "index_unlisted": index({"a": "s-1.safetensors", "c": "s-2.safetensors"}),
        "index_missing_shard": index(dict(good, d="s-3.safetensors")),
        "index_path": index(dict(good, a="../s-1.safetensors")),
        "index_bad_total": index(good, total_size=-1),
    }


def main():
    targets = {"safetensors": corpus_safetensors, "npy": corpus_npy, "webdataset": corpus_webdataset,
               "config": corpus_config, "checkpoint_json": corpus_checkpoint_json,
               "safetensors_index": corpus_safetensors_index}
    total = 0
    for target, make in targets.items():
        out = os.path.join(CORPUS, target)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        for name, content in make().items():
            data = content.encode() if isinstance(content, str) else content
            with open(os.path.join(out, name), "wb") as f:
                f.write(data)
            total += len(data)
    print(f"wrote {CORPUS}: {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
