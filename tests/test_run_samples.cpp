// The pictures of a training run (train/run_samples.h): previews every sample_interval steps
// and the end-of-run grid, their metrics records, the keys' checks, latent samples kept as
// latents, the encoded-prompts file, and what the latent decoder's exit status means
// (train/latent_decoder.h). tests/python/test_encode_to_picture.py runs the real decoder.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/flux_model.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/latent_decoder.h"
#include "train/progress.h"
#include "train/run_samples.h"
#include "train/sample_files.h"
#include "train/train_config.h"
#include "train_test_util.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;

std::vector<nlohmann::json> sample_records(const fs::path& metrics) {
  std::vector<nlohmann::json> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") == "sample") out.push_back(j);
  }
  return out;
}

// FLUX8_PYTHON set for the life of the object (a script standing in for the interpreter).
struct FakePython {
  fs::path path;
  FakePython(const fs::path& dir, int exit_status) : path(dir / "fake-python") {
    std::ofstream(path) << "#!/bin/sh\nexit " << exit_status << "\n";
    ::chmod(path.c_str(), 0755);
    ::setenv("FLUX8_PYTHON", path.c_str(), 1);
  }
  ~FakePython() { ::unsetenv("FLUX8_PYTHON"); }
};

// A pixel-space run: previews at steps 2 and 4 (not at the last step, 6, which draws the
// end-of-run grid), each a PNG grid and a record of kind "sample".
TEST(RunSamples, PreviewsEverySampleIntervalAndTheEndOfRunGrid) {
  const testing::RunDir dir("run_samples");
  TrainOptions o = dir.options("run");
  o.overrides.insert(o.overrides.end(), {"sample_interval=2", "sample_prompts=red circle; blue square",
                                         "samples_per_prompt=2", "sample_steps=2"});
  EXPECT_EQ(run_training(o).steps_done, 6);
  const fs::path run = dir.root / "run";
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(run / "samples")) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"step-0000002.png", "step-0000004.png"}));
  EXPECT_TRUE(fs::is_regular_file(run / "samples.png"));
  const std::vector<nlohmann::json> recs = sample_records(run / "metrics.jsonl");
  ASSERT_EQ(recs.size(), 3u);
  const std::vector<std::pair<int64_t, std::string>> want{
      {2, "samples/preview"}, {4, "samples/preview"}, {6, "samples/final"}};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(recs[i]["step"].get<int64_t>(), want[i].first) << recs[i];
    EXPECT_EQ(recs[i]["tag"].get<std::string>(), want[i].second) << recs[i];
    // 8 px images shown x16 (128 px cells), 2 a row, a 2 px gutter.
    EXPECT_EQ(recs[i]["width"].get<int64_t>(), 258) << recs[i];
    EXPECT_EQ(recs[i]["height"].get<int64_t>(), 258) << recs[i];
    EXPECT_EQ(recs[i]["prompts"], nlohmann::json({"red circle", "blue square"})) << recs[i];
    EXPECT_TRUE(fs::is_regular_file(recs[i]["path"].get<std::string>())) << recs[i];
  }
}

TEST(RunSamples, SampleIntervalWithoutPromptsIsAnError) {
  const testing::RunDir dir("run_samples_keys");
  TrainOptions o = dir.options("run");
  o.overrides.push_back("sample_interval=2");
  const auto config_error = [&] {
    return testing::error_of([&] { (void)TrainConfig::from_config(Config::load(o.config_path, o.overrides)); });
  };
  testing::expect_mentions(config_error(), {"sample_interval is 2", "sample_prompts"});
  o.overrides.insert(o.overrides.end(),
                     {"vae_downsample=8", "latent_channels=16", "in_channels=64", "demo_data=false", "image_size=32"});
  testing::expect_mentions(config_error(),
                           {"sample_interval is 2", "sample_text_embeddings", "tools/encode_prompts.py"});
  o.overrides.push_back("sample_text_embeddings=" + (dir.root / "missing.safetensors").string());
  testing::expect_mentions(config_error(), {"missing.safetensors", "no such file"});
}

// Encoded prompts for a model with context_dim 8 and vec_dim 8; `labels` in the metadata.
void write_prompts(const fs::path& path, int count, const std::vector<std::string>& labels) {
  static const std::vector<float> t5(4 * 8, 0.5f), clip(8, -0.25f);
  SafetensorsWriter w;
  for (int i = 0; i < count; ++i) {
    w.add("t5." + std::to_string(i), DType::f32, {4, 8}, t5.data());
    w.add("clip." + std::to_string(i), DType::f32, {8}, clip.data());
  }
  if (!labels.empty()) w.set_metadata("prompts", nlohmann::json(labels).dump());
  w.write(path.string());
}

TEST(RunSamples, EncodedPromptsFile) {
  const testing::RunDir dir("run_samples_prompts");
  const fs::path p = dir.root / "prompts.safetensors";
  write_prompts(p, 2, {"a cat", "a dog"});
  EncodedPrompts e = read_encoded_prompts(p.string(), "test");
  ASSERT_EQ(e.prompts.size(), 2u);
  EXPECT_EQ(e.labels, (std::vector<std::string>{"a cat", "a dog"}));
  EXPECT_EQ(e.prompts[1].t5.shape, (std::vector<int64_t>{4, 8}));
  EXPECT_FALSE(e.empty.has_value());
  write_prompts(p, 2, {"only one label"});  // labels that do not fit: named by tensor instead
  e = read_encoded_prompts(p.string(), "test");
  EXPECT_EQ(e.labels[1], "<" + p.string() + " t5.1>");
  SafetensorsWriter w;
  const std::vector<float> t5(32);
  w.add("t5.0", DType::f32, {4, 8}, t5.data());
  w.write(p.string());
  testing::expect_mentions(testing::error_of([&] { (void)read_encoded_prompts(p.string(), "test"); }),
                           {"test", "prompts.safetensors", "t5.0 but no clip.0"});
}

// A latent model's samples: without sample_vae they stay latents (in the VAE's space, with what
// made them in the metadata); a decoder that lacks its packages leaves latents too; a VAE that
// does not load stops the run before it starts.
TEST(RunSamples, LatentSamplesKeptAsLatentsWhenTheyCannotBeDecoded) {
  const testing::RunDir dir("run_samples_latent");
  TrainOptions o = dir.options("run");
  write_prompts(dir.root / "prompts.safetensors", 2, {"a cat", "a dog"});
  o.overrides.insert(o.overrides.end(),
                     {"vae_downsample=8", "latent_channels=16", "in_channels=64", "demo_data=false", "image_size=32",
                      "guidance_embed=true", "samples_per_prompt=1", "sample_steps=2",
                      "sample_text_embeddings=" + (dir.root / "prompts.safetensors").string()});
  const TrainConfig cfg = TrainConfig::from_config(Config::load(o.config_path, o.overrides));
  auto be = make_backend("cpu");
  FluxModel model(cfg.model, *be, DType::f32);
  testing::randomize_params(model.params(), 5);
  const fs::path metrics = dir.root / "metrics.jsonl";
  Progress progress(metrics.string(), false, 0, 6, false);
  const std::string script = (fs::path(FLUX8_SOURCE_DIR) / "tools" / "decode_latents.py").string();

  RunSamples no_vae(cfg, script, progress);
  no_vae.write_preview(model, 3);
  const fs::path latents = fs::path(cfg.save_dir) / "samples" / "step-0000003.latents.safetensors";
  const SafetensorsReader f(latents.string());
  EXPECT_EQ(f.tensor("latents").shape, (std::vector<int64_t>{2, 16, 4, 4}));
  EXPECT_EQ(f.metadata().at("prompts"), nlohmann::json({"a cat", "a dog"}).dump());
  EXPECT_EQ(f.metadata().at("guidance"), "3.5");
  EXPECT_EQ(f.metadata().at("vae_scale_factor"), "0.3611");
  EXPECT_FALSE(fs::exists(fs::path(cfg.save_dir) / "samples" / "step-0000003.png"));
  const std::vector<nlohmann::json> recs = sample_records(metrics);
  ASSERT_EQ(recs.size(), 1u);
  EXPECT_EQ(recs[0]["latents"].get<std::string>(), latents.string());

  TrainConfig with_vae = cfg;
  with_vae.sample_vae = (dir.root / "vae").string();
  {
    const FakePython python(dir.root, 3);  // "a package is missing"
    RunSamples missing(with_vae, script, progress);
    missing.write_end_of_run(model, 6);
    EXPECT_TRUE(fs::is_regular_file(fs::path(cfg.save_dir) / "samples.latents.safetensors"));
  }
  {
    const FakePython python(dir.root, 1);  // the VAE did not load
    testing::expect_mentions(testing::error_of([&] { RunSamples bad(with_vae, script, progress); }),
                             {"sample_vae", "vae", "exit status 1"});
  }
}

TEST(LatentDecoder, ExitStatusSaysWhatWentWrong) {
  const testing::RunDir dir("latent_decoder");
  const fs::path script = dir.root / "decode.py";
  std::ofstream(script) << "\n";
  const LatentDecoder d{script.string(), "some/vae"};
  using Status = DecodeOutcome::Status;
  {
    const FakePython python(dir.root, 0);
    EXPECT_TRUE(decode_latents_to_png(d, "in.safetensors", "out.png").ok());
  }
  {
    const FakePython python(dir.root, 3);
    const DecodeOutcome r = check_latent_decoder(d);
    EXPECT_EQ(r.status, Status::missing_packages);
    EXPECT_NE(r.reason.find("diffusers"), std::string::npos) << r.reason;
  }
  {
    const FakePython python(dir.root, 2);
    EXPECT_EQ(check_latent_decoder(d).status, Status::failed);
  }
  ::setenv("FLUX8_PYTHON", (dir.root / "no-such-python").c_str(), 1);
  const DecodeOutcome r = check_latent_decoder(d);
  ::unsetenv("FLUX8_PYTHON");
  EXPECT_EQ(r.status, Status::no_python);
  EXPECT_NE(r.reason.find("FLUX8_PYTHON"), std::string::npos) << r.reason;
  EXPECT_EQ(check_latent_decoder(LatentDecoder{(dir.root / "missing.py").string(), "v"}).status, Status::failed);
}

}  // namespace
}  // namespace flux8
