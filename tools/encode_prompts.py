#!/usr/bin/env python3
"""Encode prompts with T5 and CLIP into the prompts file `flux8 sample` and the trainer's previews read.

    python3 tools/encode_prompts.py --flux-repo black-forest-labs/FLUX.1-dev --text-seq-len 512 \\
        --prompt "a red fox in the snow" --prompt "a lighthouse at dusk" --out prompts.safetensors
    python3 tools/encode_prompts.py --t5 google/t5-v1_1-xxl --clip openai/clip-vit-large-patch14 \\
        --text-seq-len 256 --prompts-file prompts.txt --out prompts.safetensors

The file (safetensors, float32) holds, for prompt i = 0, 1, ...
  t5.<i>    [text_seq_len, d_model]   T5's last hidden state (FLUX.1: [512, 4096])
  clip.<i>  [hidden]                  CLIP's pooled output (CLIP-L: [768])
and the empty prompt's t5.empty / clip.empty (classifier-free guidance, `flux8 sample
--cfg-scale`); its metadata "prompts" lists the prompts' text, which labels the rows of the
pictures. Use the encoders (and text_seq_len) the training data was encoded with:
tools/encode_dataset.py records them in DIR/dataset.json.

    build/flux8 sample --checkpoint RUN/step-N --text-embeddings prompts.safetensors --vae VAE --out grid.png
    # or in a run config: sample_text_embeddings: prompts.safetensors (previews, end-of-run grid)

Needs torch and transformers. Exit status: 0 done; 1 an error; 3 a package is missing.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flux_encoders as fe  # noqa: E402

TOOL = "encode_prompts"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a text file of prompts, one a line (blank lines and lines "
                   "starting with # are skipped)")
    p.add_argument("--out", required=True, help="the prompts file to write (.safetensors)")
    p.add_argument("--batch", type=int, default=16, help="prompts per encoder call (default %(default)s)")
    fe.add_encoder_args(p, vae=False)
    args = p.parse_args(argv)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as f:
                args.prompt += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        except OSError as e:
            p.error(f"--prompts-file {args.prompts_file}: {e.strerror}")
    if not args.prompt:
        p.error("give at least one --prompt or a --prompts-file")
    if not args.out.endswith(".safetensors"):
        p.error(f"--out {args.out}: must end in .safetensors")
    return args


def main(argv=None):
    args = parse_args(argv)
    fe.import_torch_stack(TOOL, vae=False)
    from safetensors.torch import save_file
    enc = fe.TextEncoders(args, TOOL)
    tensors = {}
    for start in range(0, len(args.prompt), args.batch):
        t5, clip = enc.encode(args.prompt[start:start + args.batch])
        for j in range(t5.shape[0]):
            tensors[f"t5.{start + j}"], tensors[f"clip.{start + j}"] = t5[j].contiguous(), clip[j].contiguous()
    t5, clip = enc.encode([""])
    tensors["t5.empty"], tensors["clip.empty"] = t5[0].contiguous(), clip[0].contiguous()
    meta = {"producer": "tools/encode_prompts.py", "prompts": json.dumps(args.prompt, ensure_ascii=False),
            "text_seq_len": str(args.text_seq_len), "t5": json.dumps(enc.names["t5"]),
            "clip": json.dumps(enc.names["clip"])}
    tmp = f"{args.out}.tmp.{os.getpid()}"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, args.out)
    print(f"{TOOL}: wrote {args.out}: {len(args.prompt)} prompts, t5 [{args.text_seq_len}, {enc.context_dim}], "
          f"clip [{enc.vec_dim}], and the empty prompt", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
