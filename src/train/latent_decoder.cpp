#include "train/latent_decoder.h"

#include <fmt/core.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

extern char** environ;

namespace flux8 {

namespace {

// tools/decode_latents.py's exit status when torch, diffusers, safetensors or Pillow is missing.
constexpr int kMissingPackagesStatus = 3;

// Runs argv[0] (looked up on PATH) with `args`, without a shell; its exit status, or -1 with
// errno's text in `error` when it could not be started.
int run_command(const std::vector<std::string>& args, std::string& error) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (rc != 0) {
    error = std::strerror(rc);
    return -1;
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) {
      error = std::strerror(errno);
      return -1;
    }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  error = fmt::format("killed by signal {}", WTERMSIG(status));
  return -1;
}

DecodeOutcome run_decoder(const LatentDecoder& d, std::vector<std::string> args) {
  using Status = DecodeOutcome::Status;
  const std::string python = LatentDecoder::python();
  if (!std::filesystem::is_regular_file(d.script))
    return {Status::failed, fmt::format("the decoder {} is missing (it ships in flux8's tools/)", d.script)};
  if (d.vae.empty()) return {Status::failed, "no VAE given (sample_vae in the config, --vae for flux8 sample)"};
  args.insert(args.begin(), {python, d.script});
  args.insert(args.end(), {"--vae", d.vae});
  std::string error;
  const int rc = run_command(args, error);
  if (rc == 0) return {Status::ok, ""};
  if (rc < 0 && error == std::strerror(ENOENT))
    return {
        Status::no_python,
        fmt::format("there is no Python interpreter '{}' (set FLUX8_PYTHON to one with torch and diffusers)", python)};
  if (rc == kMissingPackagesStatus)
    return {Status::missing_packages,
            fmt::format("{} lacks torch, diffusers, safetensors or Pillow (pip install torch diffusers safetensors "
                        "pillow, or set FLUX8_PYTHON to an interpreter that has them)",
                        python)};
  return {Status::failed,
          rc < 0 ? fmt::format("{} {}: {}", python, d.script, error)
                 : fmt::format("{} {} failed with exit status {} (its message is above)", python, d.script, rc)};
}

}  // namespace

std::string LatentDecoder::python() {
  const char* p = std::getenv("FLUX8_PYTHON");
  return p && *p ? p : "python3";
}

DecodeOutcome decode_latents_to_png(const LatentDecoder& decoder, const std::string& latents, const std::string& png) {
  return run_decoder(decoder, {latents, "--out", png});
}

DecodeOutcome check_latent_decoder(const LatentDecoder& decoder) { return run_decoder(decoder, {"--check"}); }

}  // namespace flux8
