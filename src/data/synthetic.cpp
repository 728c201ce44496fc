#include "data/synthetic.h"

#include <fmt/format.h>

#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "data/demo.h"
#include "data/sample.h"
#include "data/tar.h"

namespace flux8 {

namespace fs = std::filesystem;

namespace {
// scale · U(−1, 1) + shift for every element, from (seed, stream, i).
HostTensor uniform(std::vector<int64_t> shape, uint64_t seed, uint64_t stream, double scale, double shift) {
  HostTensor t{std::move(shape), {}};
  const int64_t n = t.numel();
  t.data.resize(static_cast<size_t>(n));
#pragma omp parallel for schedule(static) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i)
    t.data[static_cast<size_t>(i)] =
        static_cast<float>(shift + scale * rng_uniform(seed, stream, static_cast<uint64_t>(i)));
  return t;
}
}  // namespace

Sample synthetic_latent_sample(const SyntheticLatentSpec& spec, int64_t index) {
  Sample s;
  s.key = demo_key(index);
  s.shard = "<synthetic>";
  const uint64_t stream = 4 * static_cast<uint64_t>(index);
  const int64_t C = spec.latent_channels, side = spec.latent_side;
  s.fields["mean"] = uniform({C, side, side}, spec.seed, stream, 1.0, 0.0);
  s.fields["logvar"] = uniform({C, side, side}, spec.seed, stream + 1, 1.0, -6.0);
  s.fields["t5"] = uniform({spec.text_seq_len, spec.context_dim}, spec.seed, stream + 2, 0.5, 0.0);
  s.fields["clip"] = uniform({spec.vec_dim}, spec.seed, stream + 3, 0.5, 0.0);
  return s;
}

uint64_t write_synthetic_latent_dataset(const std::string& out_dir, const SyntheticLatentSpec& spec) {
  for (const auto& [name, v] : {std::pair{"latent_channels", spec.latent_channels},
                                {"latent_side", spec.latent_side},
                                {"text_seq_len", spec.text_seq_len},
                                {"context_dim", spec.context_dim},
                                {"vec_dim", spec.vec_dim},
                                {"samples", spec.samples},
                                {"samples_per_shard", spec.samples_per_shard}})
    if (v < 1) fail("synthetic dataset: {} is {}; it must be at least 1", name, v);
  const fs::path dir(out_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("synthetic dataset: cannot create {}: {}", out_dir, ec.message());
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("train-", 0) == 0 && entry.path().extension() == ".tar") fs::remove(entry.path());
  }
  uint64_t bytes = 0;
  for (int64_t first = 0, shard = 0; first < spec.samples; first += spec.samples_per_shard, ++shard) {
    TarWriter tar((dir / fmt::format("train-{:06d}.tar", shard)).string());
    for (int64_t i = first; i < std::min(spec.samples, first + spec.samples_per_shard); ++i) {
      const Sample sample = synthetic_latent_sample(spec, i);
      for (const char* field : {"mean", "logvar", "t5", "clip"}) {
        const std::string npy = encode_npy_f32(sample.at(field));
        tar.add(sample.key + "." + field + ".npy", npy);
        bytes += npy.size();
      }
    }
    tar.finish();
  }
  return bytes;
}

}  // namespace flux8
