#pragma once
// The one command that turns latents into pictures: tools/decode_latents.py, run with Python
// and diffusers' AutoencoderKL (flux8 has no VAE decoder of its own). `flux8 sample` and the
// trainer's previews call it when it can run; when it cannot (no Python, no torch/diffusers, a
// VAE that does not load) they say why and keep the latents file.
//
//   $FLUX8_PYTHON tools/decode_latents.py LATENTS.safetensors --vae VAE --out GRID.png
//
// FLUX8_PYTHON names the interpreter (a virtual environment's, say); python3 on PATH otherwise.
#include <string>

namespace flux8 {

struct LatentDecoder {
  std::string script;  // path of tools/decode_latents.py
  std::string vae;     // a local VAE or pipeline directory, or a Hugging Face id

  // The interpreter: FLUX8_PYTHON, else "python3".
  static std::string python();
};

struct DecodeOutcome {
  enum class Status { ok, no_python, missing_packages, failed } status = Status::failed;
  std::string reason;  // what went wrong and what to do, for a message; empty when ok
  bool ok() const { return status == Status::ok; }
};

// Decodes `latents` (written by write_sample_latents) into the PNG grid `png`; the decoder's
// own lines go to this process's stdout and stderr.
DecodeOutcome decode_latents_to_png(const LatentDecoder& decoder, const std::string& latents, const std::string& png);

// Whether the decoder can run: Python starts, the packages import and the VAE loads (the
// trainer asks once, before the first step, rather than at its first preview).
DecodeOutcome check_latent_decoder(const LatentDecoder& decoder);

}  // namespace flux8
