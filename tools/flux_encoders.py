"""The encoders a Flux model is trained on, as flux8's data and prompt files need them.

Shared by tools/encode_dataset.py, tools/encode_prompts.py and tools/encode_throughput.py:
  VAE   diffusers' AutoencoderKL (the Flux VAE: 16 latent channels, 8x downsampling); the
        shards keep its posterior (mean, logvar) and flux8 draws z and normalises it with
        vae_scale_factor / vae_shift_factor (the VAE's scaling_factor / shift_factor)
  T5    transformers' T5EncoderModel: last hidden state of the prompt padded to text_seq_len
        tokens, as FLUX.1 pipelines run it (no attention mask)       -> "t5" [text_seq_len, d_model]
  CLIP  transformers' CLIPTextModel: pooled output of the prompt padded to 77 tokens
                                                                     -> "clip" [hidden]

Each model comes from a local directory or a Hugging Face id. A FLUX.1 repository (or a local
copy of one) holds all three: --flux-repo R means vae/, text_encoder_2/ + tokenizer_2/ (T5) and
text_encoder/ + tokenizer/ (CLIP) of R. Hub downloads need network access and, for gated repos
such as black-forest-labs/FLUX.1-dev, a token (hf auth login).
"""
import contextlib
import io
import os
import sys

MISSING_PACKAGES = 3  # exit status when torch, diffusers or transformers is missing
CLIP_TOKENS = 77      # CLIP's context length, as FLUX.1 pipelines tokenize for it


class NoClock:
    """Stage timing switched off: what the tools run with unless tools/encode_throughput.py times
    the stages (its clock's stage(name) is a context manager that adds up the seconds)."""

    @staticmethod
    def stage(name):
        return contextlib.nullcontext()


NO_CLOCK = NoClock()


def fail(tool, msg, status=1):
    print(f"{tool}: error: {msg}", file=sys.stderr)
    sys.exit(status)


def import_torch_stack(tool, vae=True):
    """torch, transformers and (for the VAE) diffusers, or exit MISSING_PACKAGES saying what to
    install."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        if vae:
            import diffusers  # noqa: F401
    except ImportError as e:
        fail(tool, f"{e}; this tool needs torch, diffusers and transformers: "
                   "python3 -m pip install torch diffusers transformers pillow", MISSING_PACKAGES)


def add_encoder_args(p, vae=True):
    g = p.add_argument_group("encoders (a local directory or a Hugging Face id each)")
    g.add_argument("--flux-repo", help="a FLUX.1 repository holding all of them, e.g. "
                   "black-forest-labs/FLUX.1-dev: vae/, text_encoder_2/ + tokenizer_2/ (T5), "
                   "text_encoder/ + tokenizer/ (CLIP)")
    if vae:
        g.add_argument("--vae", help="AutoencoderKL (a folder with config.json, or one with a vae/ "
                       "subfolder)")
    g.add_argument("--t5", help="T5EncoderModel, e.g. google/t5-v1_1-xxl")
    g.add_argument("--t5-tokenizer", help="its tokenizer (default: the --t5 location, else its "
                   "tokenizer_2/ sibling)")
    g.add_argument("--clip", help="CLIPTextModel, e.g. openai/clip-vit-large-patch14")
    g.add_argument("--clip-tokenizer", help="its tokenizer (default: the --clip location)")
    p.add_argument("--text-seq-len", type=int, required=True,
                   help="T5 tokens per prompt: the model config's text_seq_len (FLUX.1-dev 512, "
                        "schnell and the MLPerf data 256)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when there is one)")
    p.add_argument("--encoder-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the encoders' compute dtype (default: bfloat16 on cuda, float32 on cpu)")


def locations(args, tool):
    """(model, subfolder) of each encoder the arguments name."""
    repo = args.flux_repo
    out = {}
    for name, sub, tok_sub in (("t5", "text_encoder_2", "tokenizer_2"), ("clip", "text_encoder", "tokenizer")):
        model = getattr(args, name)
        tok = getattr(args, f"{name}_tokenizer")
        if model is None and repo is None:
            fail(tool, f"give --{name} (or --flux-repo)")
        out[name] = (model, None) if model else (repo, sub)
        out[f"{name}_tokenizer"] = (tok, None) if tok else ((model, None) if model else (repo, tok_sub))
    if hasattr(args, "vae"):
        if args.vae is None and repo is None:
            fail(tool, "give --vae (or --flux-repo)")
        out["vae"] = (args.vae, None) if args.vae else (repo, "vae")
    return out


def _load(tool, what, cls, where, default_sub, **kw):
    """cls.from_pretrained at `where`, in its subfolder, or at its root then in default_sub."""
    model, sub = where
    tries = [sub] if sub is not None else [None, default_sub]
    errors = []
    for s in tries:
        try:
            return cls.from_pretrained(model, subfolder=s, **kw) if s else cls.from_pretrained(model, **kw)
        except Exception as e:  # from_pretrained raises several types for missing files
            errors.append(f"{model}{'/' + s if s else ''}: {e}")
    fail(tool, f"cannot load the {what}: " + "; ".join(errors))


def device_and_dtype(args):
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = args.encoder_dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return device, getattr(torch, name)


class TextEncoders:
    """T5 and CLIP with their tokenizers; encode() gives flux8's "t5" and "clip" per prompt.

    built: {"t5", "t5_tokenizer", "clip", "clip_tokenizer", "names"} made by the caller
    (tools/encode_throughput.py: random real-sized encoders) instead of the ones the arguments
    name; "names" holds what the settings record for "t5" and "clip"."""

    def __init__(self, args, tool, built=None):
        self.device, self.dtype = device_and_dtype(args)
        self.text_seq_len = args.text_seq_len
        if built is None:
            built = load_text_encoders(args, tool, self.dtype)
        self.t5_tok, self.clip_tok = built["t5_tokenizer"], built["clip_tokenizer"]
        self.t5 = built["t5"].to(self.device).eval()
        self.clip = built["clip"].to(self.device).eval()
        self.names = {"t5": built["names"]["t5"], "clip": built["names"]["clip"]}

    @property
    def context_dim(self):
        return self.t5.config.d_model

    @property
    def vec_dim(self):
        return self.clip.config.hidden_size

    def encode(self, prompts, clock=NO_CLOCK):
        """(t5 [n, text_seq_len, context_dim], clip [n, vec_dim]) as float32 CPU tensors."""
        import torch
        with torch.no_grad():
            with clock.stage("t5"):
                ids = self.t5_tok(prompts, padding="max_length", max_length=self.text_seq_len, truncation=True,
                                  return_tensors="pt").input_ids.to(self.device)
                t5 = self.t5(input_ids=ids).last_hidden_state.float().cpu()
            with clock.stage("clip"):
                ids = self.clip_tok(prompts, padding="max_length", max_length=CLIP_TOKENS, truncation=True,
                                    return_tensors="pt").input_ids.to(self.device)
                clip = self.clip(input_ids=ids).pooler_output.float().cpu()
        return t5, clip


def load_text_encoders(args, tool, dtype):
    """The tokenizers and models at the locations the arguments name, as TextEncoders takes them."""
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel
    where = locations(args, tool)
    return {"t5_tokenizer": _load(tool, "T5 tokenizer", AutoTokenizer, where["t5_tokenizer"], "tokenizer_2"),
            "clip_tokenizer": _load(tool, "CLIP tokenizer", AutoTokenizer, where["clip_tokenizer"], "tokenizer"),
            "t5": _load(tool, "T5 encoder", T5EncoderModel, where["t5"], "text_encoder_2", dtype=dtype),
            "clip": _load(tool, "CLIP text model", CLIPTextModel, where["clip"], "text_encoder", dtype=dtype),
            "names": {"t5": list(where["t5"]), "clip": list(where["clip"])}}


def load_vae(args, tool):
    from diffusers import AutoencoderKL
    device, dtype = device_and_dtype(args)
    vae = _load(tool, "VAE", AutoencoderKL, locations(args, tool)["vae"], "vae", torch_dtype=dtype)
    return vae.to(device).eval(), device, dtype


def vae_factors(vae):
    """The VAE's latent normalisation: flux8's vae_scale_factor and vae_shift_factor."""
    scale = getattr(vae.config, "scaling_factor", None)
    shift = getattr(vae.config, "shift_factor", None)
    return (1.0 if scale is None else float(scale)), (0.0 if shift is None else float(shift))


def vae_downsample(vae):
    """Pixels per latent cell: 2 for each down block after the first."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


def npy_bytes(tensor, storage):
    """A tensor as an .npy image: bf16 as '<u2' bits (the MLPerf shards' convention), or f32."""
    import numpy as np
    import torch
    buf = io.BytesIO()
    if storage == "bf16":
        bits = tensor.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        np.save(buf, bits)
    else:
        np.save(buf, tensor.detach().float().contiguous().numpy())
    return buf.getvalue()


def write_empty_prompt(path, t5, clip, metadata):
    """The empty prompt's encodings as flux8's empty_prompt_file reads them ("t5", "clip")."""
    from safetensors.torch import save_file
    tmp = f"{path}.tmp.{os.getpid()}"
    save_file({"t5": t5.contiguous(), "clip": clip.contiguous()}, tmp, metadata=metadata)
    os.replace(tmp, path)
