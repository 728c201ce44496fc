// `flux8 forward` inputs: the shapes in an inputs file are checked against each other and the
// model from the header alone, before anything is read or allocated, and every bad shape is an
// error naming the file and the tensor.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/flux_config.h"
#include "model/input_batch.h"
#include "model_test_util.h"
#include "test_util.h"

namespace flux8::testing {
namespace {

// The tiny test model: in_channels 5, context_dim 7, vec_dim 3.
FluxConfig model(bool guidance = false) { return odd_config(1, 1, guidance); }

// An inputs file with the given shapes (F32, values 0, 1, 2, ... per tensor); a tensor whose
// shape is absent from `shapes` is left out.
class InputsFile {
 public:
  explicit InputsFile(const TempDir& dir) : path_(dir.path("inputs.safetensors")) {}
  std::map<std::string, std::vector<int64_t>> shapes = {{"img", {2, 4, 5}},     {"img_ids", {4, 3}}, {"txt", {2, 3, 7}},
                                                        {"txt_ids", {2, 3, 3}}, {"timesteps", {2}},  {"y", {2, 3}},
                                                        {"guidance", {1}}};

  // Written directly (the writer's fsyncs would make these tests slow).
  std::string write() const {
    nlohmann::json header = nlohmann::json::object();
    std::string data;
    for (const auto& [name, shape] : shapes) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      const size_t begin = data.size();
      for (int64_t i = 0; i < n; ++i) {
        const auto v = static_cast<float>(i);
        data.append(reinterpret_cast<const char*>(&v), sizeof v);
      }
      header[name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {begin, data.size()}}};
    }
    const std::string text = header.dump();
    const uint64_t length = text.size();
    write_bytes(path_, std::string(reinterpret_cast<const char*>(&length), 8) + text + data);
    return path_;
  }
  std::string load_error(const FluxConfig& cfg) {
    const SafetensorsReader file(write());
    return error_of([&] { InputBatch::check(file, cfg); });
  }

 private:
  std::string path_;
};

TEST(ForwardInputs, SharedIdsAndScalarsAreBroadcastOverTheBatch) {
  TempDir dir;
  InputsFile f(dir);
  f.shapes["timesteps"] = {};
  auto be = make_backend("cpu");
  const SafetensorsReader file(f.write());
  InputBatch batch(*be, DType::f64);
  batch.load(file, model(true));
  EXPECT_EQ(batch.batch(), 2);
  EXPECT_EQ(batch.inputs().img_ids.shape, (Shape{2, 4, 3}));
  const std::vector<double> ids = to_host(*be, batch.inputs().img_ids);
  for (size_t i = 0; i < 12; ++i) {
    EXPECT_EQ(ids[i], static_cast<double>(i));
    EXPECT_EQ(ids[12 + i], static_cast<double>(i)) << "the second sample repeats the shared ids";
  }
  EXPECT_EQ(to_host(*be, batch.inputs().timesteps), (std::vector<double>{0, 0}));
  EXPECT_EQ(to_host(*be, batch.inputs().guidance), (std::vector<double>{0, 0}));
  EXPECT_EQ(to_host(*be, batch.inputs().txt_ids).size(), 18u);
}

TEST(ForwardInputs, EmptyBatchOrNoTokensNamesTheTensor) {
  TempDir dir;
  InputsFile f(dir);
  f.shapes["img"] = {0, 4, 5};
  expect_mentions(f.load_error(model()), {"inputs.safetensors", "'img'", "[0, 4, 5]", "no sample"});
  f.shapes["img"] = {2, 0, 5};
  expect_mentions(f.load_error(model()), {"'img'", "[2, 0, 5]", "no image tokens"});
  f.shapes["img"] = {2, 4, 5};
  f.shapes["txt"] = {2, 0, 7};
  expect_mentions(f.load_error(model()), {"'txt'", "[2, 0, 7]", "no text tokens"});
}

// A kilobyte file claiming a billion samples of zero tokens: each tensor holds no bytes, so the
// file is valid, and broadcasting the shared timestep over the batch would take gigabytes.
TEST(ForwardInputs, HugeClaimedBatchIsRefusedBeforeAllocating) {
  TempDir dir;
  InputsFile f(dir);
  const int64_t B = 1'000'000'000;
  f.shapes = {{"img", {B, 0, 5}},  {"img_ids", {0, 3}}, {"txt", {B, 0, 7}},
              {"txt_ids", {0, 3}}, {"timesteps", {1}},  {"y", {B, 0}}};
  const std::string path = f.write();
  EXPECT_LT(std::filesystem::file_size(path), 2048u);
  auto be = make_backend("cpu");
  const SafetensorsReader file(path);
  InputBatch batch(*be, DType::f32);
  expect_mentions(error_of([&] { batch.load(file, model()); }), {"'img'", "no image tokens"});
}

TEST(ForwardInputs, InconsistentShapesNameTheTensor) {
  TempDir dir;
  const std::map<std::string, std::vector<int64_t>> bad = {{"img", {2, 4, 6}},      // in_channels is 5
                                                           {"txt", {3, 3, 7}},      // batch 3, img's is 2
                                                           {"img_ids", {2, 5, 3}},  // 5 tokens, img has 4
                                                           {"txt_ids", {3, 2}},     // not [L, 3]
                                                           {"timesteps", {3}},      // not [B] or [1]
                                                           {"y", {2, 4}},           // vec_dim is 3
                                                           {"guidance", {2, 1}}};
  for (const auto& [name, shape] : bad) {
    InputsFile f(dir);
    f.shapes[name] = shape;
    expect_mentions(f.load_error(model(true)), {"inputs.safetensors", "'" + name + "'", "must be"});
  }
}

TEST(ForwardInputs, MissingInputOrUnconvertibleDtypeNamesTheTensor) {
  TempDir dir;
  InputsFile f(dir);
  f.shapes.erase("guidance");
  expect_mentions(f.load_error(model(true)), {"'guidance'", "missing"});

  SafetensorsWriter w;
  const std::vector<uint8_t> codes(40, 0);
  const std::vector<float> zeros(64, 0.f);
  w.add("img", DType::u8, {2, 4, 5}, codes.data());
  w.add("txt", DType::f32, {2, 3, 7}, zeros.data());
  w.write(dir.path("u8.safetensors"));
  const SafetensorsReader file(dir.path("u8.safetensors"));
  expect_mentions(error_of([&] { InputBatch::check(file, model()); }), {"u8.safetensors", "'img'", "dtype U8"});
}

struct ForwardCli {
  TempDir dir;
  std::string log;
  int run(const std::string& args) {
    const std::string config =
        dir.write("tiny.yaml", "include: " + std::string(FLUX8_SOURCE_DIR) + "/configs/models/flux_tiny_demo.yaml\n");
    return run_flux8(
        "forward --set backend=cpu -c " + config + " --init-seed 1 --out " + dir.path("out.safetensors") + " " + args,
        dir.file("log.txt"), &log);
  }
};

// The tiny demo model: in_channels 12, context_dim 32, vec_dim 32.
std::map<std::string, std::vector<int64_t>> demo_shapes(int64_t batch) {
  return {{"img", {batch, 4, 12}}, {"img_ids", {4, 3}}, {"txt", {batch, 2, 32}},
          {"txt_ids", {2, 3}},     {"timesteps", {1}},  {"y", {batch, 32}}};
}

TEST(ForwardInputs, CliNamesAnEmptyBatchInsteadOfFailingInAnOp) {
  ForwardCli cli;
  InputsFile f(cli.dir);
  f.shapes = demo_shapes(0);
  EXPECT_EQ(cli.run("--inputs " + f.write()), 1) << cli.log;
  expect_mentions(cli.log, {"inputs.safetensors", "'img'", "no sample"});
  EXPECT_EQ(cli.log.find("internal"), std::string::npos) << cli.log;
}

TEST(ForwardInputs, CliRefusesAProbeNotShapedLikePred) {
  ForwardCli cli;
  InputsFile f(cli.dir);
  f.shapes = demo_shapes(1);
  f.shapes["probe"] = {1, 4, 11};
  EXPECT_EQ(cli.run("--loss-grad --inputs " + f.write()), 1) << cli.log;
  expect_mentions(cli.log, {"'probe'", "[1, 4, 11]", "[1, 4, 12]"});
  EXPECT_FALSE(std::filesystem::exists(cli.dir.path("out.safetensors")));
}

}  // namespace
}  // namespace flux8::testing
