#pragma once
// Random training data shaped like the MLPerf Flux reference's preprocessed CC12M, for
// throughput runs of `flux8 train` at a workload's real sizes (`flux8 data synthetic`): each
// sample a VAE posterior — fields "mean" and "logvar", [latent_channels, side, side] — T5
// features "t5" [text_seq_len, context_dim] and a pooled CLIP vector "clip" [vec_dim], as f32
// .npy members of WebDataset shards out_dir/train-000000.tar, ... Values are uniform noise
// (a pure function of seed and sample index): nothing to learn, so the loss says nothing; the
// point is what the loader, the batch assembly and the upload cost beside the step.
#include <cstdint>
#include <string>

#include "data/sample.h"

namespace flux8 {

struct SyntheticLatentSpec {
  int64_t latent_channels = 16, latent_side = 32;
  int64_t text_seq_len = 256, context_dim = 4096, vec_dim = 768;
  int64_t samples = 256, samples_per_shard = 64;
  uint64_t seed = 0;
};

// Sample `index` of such a dataset (key demo_key(index), the four fields; shard "<synthetic>").
// Also what `flux8 bench --data-path` assembles.
Sample synthetic_latent_sample(const SyntheticLatentSpec& spec, int64_t index);

// Writes the shards (each atomically, TarWriter) after removing train-*.tar left in out_dir.
// Returns the bytes of the .npy members written.
uint64_t write_synthetic_latent_dataset(const std::string& out_dir, const SyntheticLatentSpec& spec);

}  // namespace flux8
