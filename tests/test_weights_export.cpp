// `flux8 export` and the weights it and other programs write: the sharded-safetensors index
// (parsing, refusals, shard assignment), the diffusers folder's layout and config.json, the FP8
// layout with per-tensor scales, and loading all of them back exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "fp8/format.h"
#include "io/safetensors.h"
#include "io/safetensors_index.h"
#include "model/name_map.h"
#include "model/weight_source.h"
#include "model/weights_export.h"
#include "model/weights_io.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/checkpoint.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::error_of;
using testing::TempDir;

void expect_has(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "missing '" << part << "' in:\n" << text;
}

TEST(SafetensorsIndex, ReadsTheWeightMap) {
  const SafetensorsIndex index = SafetensorsIndex::parse(
      R"({"metadata": {"total_size": 24}, "weight_map": {"a": "m-00001-of-00002.safetensors",
          "b": "m-00002-of-00002.safetensors", "c": "m-00001-of-00002.safetensors"}})",
      "i.json");
  EXPECT_EQ(index.weight_map.size(), 3u);
  EXPECT_EQ(index.weight_map.at("b"), "m-00002-of-00002.safetensors");
  EXPECT_EQ(index.shards, (std::vector<std::string>{"m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors"}));
  // No metadata is fine (transformers' older indexes); the map is what matters.
  EXPECT_EQ(SafetensorsIndex::parse(R"({"weight_map": {"a": "x.safetensors"}})", "i.json").shards.size(), 1u);
}

TEST(SafetensorsIndex, RefusesWhatCannotBeAnIndex) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "not valid JSON"},
      {"[]", "not a JSON object"},
      {R"({"metadata": {}})", "no \"weight_map\" object"},
      {R"({"weight_map": {}})", "lists no tensor"},
      {R"({"weight_map": {"a": 3}})", "'a' is not a file name string"},
      {R"({"weight_map": {"a": "../x.safetensors"}})", "a path; shards must be files in the index's folder"},
      {R"({"weight_map": {"a": "/etc/x.safetensors"}})", "a path"},
      {R"({"weight_map": {"a": ".."}})", "not a file name"},
      {R"({"weight_map": {"a": "x.bin"}})", "not a .safetensors file"},
      {R"({"weight_map": {"": "x.safetensors"}})", "empty tensor name"},
      {R"({"metadata": {"total_size": -1}, "weight_map": {"a": "x.safetensors"}})", "total_size is not a byte count"},
      {R"({"metadata": 5, "weight_map": {"a": "x.safetensors"}})", "\"metadata\" is not an object"},
  };
  for (const auto& [text, why] : cases) {
    const std::string e = error_of([&] { SafetensorsIndex::parse(text, "dir/i.json"); });
    expect_has(e, "safetensors index 'dir/i.json'");
    expect_has(e, why);
  }
}

TEST(SafetensorsIndex, ShardsAndSizes) {
  // Hugging Face's rule: a tensor that would overflow the shard starts the next one; one larger
  // than the limit gets a shard of its own.
  EXPECT_EQ(assign_shards({5, 5, 5}, 10), (std::vector<size_t>{0, 0, 1}));
  EXPECT_EQ(assign_shards({3, 20, 3, 3}, 10), (std::vector<size_t>{0, 1, 2, 2}));
  EXPECT_EQ(assign_shards({20}, 10), (std::vector<size_t>{0}));
  EXPECT_EQ(assign_shards({}, 10), (std::vector<size_t>{}));
  EXPECT_EQ(parse_byte_size("10GB", "x"), 10'000'000'000u);
  EXPECT_EQ(parse_byte_size("500mb", "x"), 500'000'000u);
  EXPECT_EQ(parse_byte_size("2GiB", "x"), 2ull << 30);
  EXPECT_EQ(parse_byte_size("123", "x"), 123u);
  EXPECT_EQ(parse_byte_size("64KB", "x"), 64'000u);
  for (const char* bad : {"", "0", "GB", "1.5GB", "10 GB", "-1", "99999999999TB", "12XB"})
    expect_has(error_of([&] { parse_byte_size(bad, "--max-shard-size"); }), "--max-shard-size: '");
}

// Two shards holding a, b and c, d, and their index.
struct ShardedFolder {
  TempDir tmp;
  std::vector<float> values{1, 2, 3, 4};
  ShardedFolder() {
    write_shard("s-1.safetensors", {"a", "b"});
    write_shard("s-2.safetensors", {"c", "d"});
    write_index(
        {{"a", "s-1.safetensors"}, {"b", "s-1.safetensors"}, {"c", "s-2.safetensors"}, {"d", "s-2.safetensors"}});
  }
  void write_shard(const std::string& name, const std::vector<std::string>& tensors) {
    SafetensorsWriter w;
    for (const std::string& t : tensors) w.add(t, DType::f32, {2}, values.data());
    w.write(tmp.file(name));
  }
  void write_index(const std::map<std::string, std::string>& map) {
    tmp.write("index.json", safetensors_index_json(map, 32));
  }
};

TEST(SafetensorsSet, OpensTheShardsOfAnIndex) {
  ShardedFolder f;
  const SafetensorsSet set = SafetensorsSet::open_index(f.tmp.file("index.json"));
  EXPECT_TRUE(set.sharded());
  EXPECT_EQ(set.names().size(), 4u);
  EXPECT_EQ(set.file_of("c").path(), f.tmp.file("s-2.safetensors"));
  float v[2];
  set.file_of("d").read_f32("d", v);
  EXPECT_EQ(v[1], 2.0f);
  expect_has(error_of([&] { set.file_of("e"); }), "has no tensor 'e'");
}

TEST(SafetensorsSet, RefusesPartialAndMixedFolders) {
  {
    ShardedFolder f;
    fs::remove(f.tmp.file("s-2.safetensors"));
    const std::string e = error_of([&] { SafetensorsSet::open_index(f.tmp.file("index.json")); });
    expect_has(e, "puts tensor 'c' (and maybe others) in shard 's-2.safetensors', which is missing");
  }
  {
    ShardedFolder f;  // the index says c is in s-1
    f.write_index(
        {{"a", "s-1.safetensors"}, {"b", "s-1.safetensors"}, {"c", "s-1.safetensors"}, {"d", "s-2.safetensors"}});
    expect_has(error_of([&] { SafetensorsSet::open_index(f.tmp.file("index.json")); }),
               "s-1.safetensors', which has no such tensor");
  }
  {
    ShardedFolder f;  // d is in s-2 but not in the index
    f.write_index({{"a", "s-1.safetensors"}, {"b", "s-1.safetensors"}, {"c", "s-2.safetensors"}});
    expect_has(error_of([&] { SafetensorsSet::open_index(f.tmp.file("index.json")); }),
               "holds tensor 'd', which its index");
  }
}

// A small model whose every setting diffusers can express (mlp_ratio 4), with random weights.
struct ExportModel {
  FluxConfig cfg = [] {
    FluxConfig c = testing::odd_config(1, 1, true);
    c.mlp_ratio = 4.0;
    return c;
  }();
  std::unique_ptr<Backend> be = make_backend("cpu");
  ParamStore store{cfg, *be, DType::f32};
  TempDir tmp;
  std::string weights = tmp.file("w.safetensors");
  ExportModel() {
    testing::randomize_params(store, 3);
    save_weights(store, cfg, weights, DType::f32, WeightNaming::reference);
  }
  std::vector<double> load(const std::string& path) const {
    ParamStore back(cfg, *be, DType::f32);
    load_weights(back, cfg, path);
    return to_host(*be, back.flat_params());
  }
};

TEST(WeightsExport, DiffusersFolderLayout) {
  ExportModel m;
  ExportOptions o;
  o.format = ExportFormat::diffusers;
  o.dtype = ExportDtype::f32;
  o.max_shard_bytes = 4000;
  const std::string out = m.tmp.file("dif");
  const ExportResult r = export_weights(WeightSource::open(m.weights), m.cfg, out, o);
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(out)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  const size_t shards = files.size() - 2;
  ASSERT_GE(shards, 3u);
  EXPECT_EQ(files.front(), "config.json");
  EXPECT_EQ(files.back(), "diffusion_pytorch_model.safetensors.index.json");
  for (size_t s = 0; s < shards; ++s)
    EXPECT_EQ(files[1 + s], fmt::format("diffusion_pytorch_model-{:05d}-of-{:05d}.safetensors", s + 1, shards));
  EXPECT_EQ(r.files.size(), files.size());

  // Every diffusers tensor once, in the shard the index names, each shard within the limit
  // unless it holds one tensor.
  const json index = json::parse(testing::read_bytes(fs::path(out) / files.back()));
  const std::vector<DiffusersTensor> expected = diffusers_tensors(m.store.layout(), m.cfg);
  EXPECT_EQ(index["weight_map"].size(), expected.size());
  uint64_t total = 0;
  for (size_t s = 0; s < shards; ++s) {
    const SafetensorsReader shard((fs::path(out) / files[1 + s]).string());
    uint64_t bytes = 0;
    for (const std::string& name : shard.names()) {
      EXPECT_EQ(index["weight_map"][name], files[1 + s]) << name;
      EXPECT_EQ(shard.tensor(name).dtype, "F32");
      bytes += shard.tensor(name).nbytes;
    }
    EXPECT_TRUE(bytes <= o.max_shard_bytes || shard.names().size() == 1) << files[1 + s];
    EXPECT_EQ(shard.metadata().at("format"), "pt");
    total += bytes;
  }
  EXPECT_EQ(index["metadata"]["total_size"], total);
  EXPECT_EQ(r.tensor_bytes, total);

  const json config = json::parse(testing::read_bytes(fs::path(out) / "config.json"));
  EXPECT_EQ(config["_class_name"], "FluxTransformer2DModel");
  EXPECT_EQ(config["patch_size"], 1);
  EXPECT_EQ(config["in_channels"], 5);
  EXPECT_TRUE(config["out_channels"].is_null());
  EXPECT_EQ(config["num_layers"], 1);
  EXPECT_EQ(config["num_single_layers"], 1);
  EXPECT_EQ(config["attention_head_dim"], 10);
  EXPECT_EQ(config["num_attention_heads"], 2);
  EXPECT_EQ(config["joint_attention_dim"], 7);
  EXPECT_EQ(config["pooled_projection_dim"], 3);
  EXPECT_EQ(config["guidance_embeds"], true);
  EXPECT_EQ(config["axes_dims_rope"], json({2, 4, 4}));

  // The folder loads back exactly: named directly, as a pipeline's transformer/ subfolder, and
  // through --init-from's resolution.
  const std::vector<double> src = to_host(*m.be, m.store.flat_params());
  EXPECT_EQ(m.load(out), src);
  fs::create_directory(m.tmp.file("pipeline"));
  fs::rename(out, m.tmp.file("pipeline/transformer"));
  EXPECT_EQ(m.load(m.tmp.file("pipeline")), src);
  EXPECT_EQ(resolve_weights_path(m.tmp.file("pipeline")), m.tmp.file("pipeline"));
}

TEST(WeightsExport, OneShardIsOneFileAndBf16IsRounded) {
  ExportModel m;
  ExportOptions o;
  o.format = ExportFormat::diffusers;
  o.dtype = ExportDtype::bf16;
  const std::string out = m.tmp.file("dif");
  export_weights(WeightSource::open(m.weights), m.cfg, out, o);
  EXPECT_TRUE(fs::exists(fs::path(out) / "diffusion_pytorch_model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(out) / "diffusion_pytorch_model.safetensors.index.json"));
  const std::vector<double> src = to_host(*m.be, m.store.flat_params()), back = m.load(out);
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(back[i], round_to_bf16(static_cast<float>(src[i]))) << i;
}

TEST(WeightsExport, Fp8LayoutReadsBackAsCodeTimesScale) {
  ExportModel m;
  ExportOptions o;
  o.format = ExportFormat::bfl;
  o.dtype = ExportDtype::fp8;
  const std::string out = m.tmp.file("fp8.safetensors");
  const ExportResult r = export_weights(WeightSource::open(m.weights), m.cfg, out, o);
  const SafetensorsReader file(out);
  const json layers = json::parse(file.metadata().at("_quantization_metadata"))["layers"];
  ParamStore back(m.cfg, *m.be, DType::f32);
  load_weights(back, m.cfg, out);
  size_t fp8 = 0;
  for (const ParamInfo& p : m.store.layout().params()) {
    const SafetensorsTensor& t = file.tensor(p.name);
    const std::vector<double> loaded = to_host(*m.be, back.param(p.name));
    const std::vector<double> original = to_host(*m.be, m.store.param(p.name));
    const bool block_linear = p.shape.rank == 2 && p.name.find("blocks.") != std::string::npos;
    if (!block_linear) {
      EXPECT_EQ(t.dtype, "BF16") << p.name;
      continue;
    }
    ++fp8;
    const std::string layer = p.name.substr(0, p.name.size() - 7);
    EXPECT_EQ(t.dtype, "F8_E4M3") << p.name;
    EXPECT_EQ(layers[layer]["format"], "float8_e4m3fn") << layer;
    const SafetensorsTensor& s = file.tensor(layer + ".weight_scale");
    ASSERT_EQ(s.dtype, "F32");
    EXPECT_TRUE(s.shape.empty());
    float scale;
    file.read_f32(s.name, &scale);
    double amax = 0;
    for (double v : original) amax = std::max(amax, std::abs(v));
    EXPECT_EQ(scale, static_cast<float>(amax / 448.0)) << p.name;
    for (size_t i = 0; i < loaded.size(); ++i) {
      ASSERT_EQ(loaded[i], static_cast<float>(double(e4m3_decode(t.data[i])) * scale)) << p.name << " " << i;
      // E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 relative, or 2^-10 · scale among subnormals.
      ASSERT_LE(std::abs(loaded[i] - original[i]), std::max(std::abs(original[i]) / 16, scale / 1024.0) * 1.000001);
    }
  }
  EXPECT_EQ(r.fp8_tensors, fp8);
  EXPECT_EQ(layers.size(), fp8);
}

TEST(WeightsExport, RefusesWhatTheTargetCannotHold) {
  ExportModel m;
  ExportOptions o;
  o.format = ExportFormat::diffusers;
  o.dtype = ExportDtype::fp8;
  const WeightSource source = WeightSource::open(m.weights);
  expect_has(error_of([&] { export_weights(source, m.cfg, m.tmp.file("a"), o); }), "--dtype fp8 is for --format bfl");
  o.dtype = ExportDtype::f32;
  FluxConfig odd = m.cfg;
  odd.mlp_ratio = 2.35;
  expect_has(error_of([&] { diffusers_config_json(odd); }), "mlp_ratio = 2.35");
  odd = m.cfg;
  odd.qkv_bias = false;
  expect_has(error_of([&] { diffusers_config_json(odd); }), "qkv_bias = false");
  m.tmp.write("full/keep.txt", "user file");
  expect_has(error_of([&] { export_weights(source, m.cfg, m.tmp.file("full"), o); }), "is not an empty folder");
  EXPECT_TRUE(fs::exists(m.tmp.file("full/keep.txt")));
  // The source is checked against the model before anything is written.
  FluxConfig bigger = m.cfg;
  bigger.num_single_blocks = 2;
  expect_has(error_of([&] { export_weights(source, bigger, m.tmp.file("b"), o); }),
             "missing: single_blocks.1.linear1.weight");
  EXPECT_FALSE(fs::exists(m.tmp.file("b")));
}

// A ComfyUI FP8 file: a scaled E4M3 weight, an unscaled one, and the tensors that say how to run
// them; every other parameter BF16.
TEST(WeightSource, ComfyFp8ScalesAndBadScales) {
  ExportModel m;
  const std::string fc1 = "double_blocks.0.img_mlp.0.weight";
  SafetensorsWriter w;
  std::vector<std::vector<uint8_t>> codes;  // img_in's, then fc1's (parameter order); the fills point at them
  codes.reserve(2);
  std::vector<std::vector<float>> keep;
  const float scale = 0.01f;
  for (const ParamInfo& p : m.store.layout().params()) {
    const std::vector<double> v = to_host(*m.be, m.store.param(p.name));
    const std::string name = "model.diffusion_model." + p.name;
    const std::vector<int64_t> shape(p.shape.d.begin(), p.shape.d.begin() + p.shape.rank);
    if (p.name == fc1 || p.name == "img_in.weight") {
      const float s = p.name == fc1 ? scale : 1.0f;
      codes.emplace_back();
      for (double x : v) codes.back().push_back(e4m3_encode(static_cast<float>(x / s)));
      w.add_filled_bytes(name, "F8_E4M3", shape, [c = &codes.back()](size_t first, size_t count, void* dst) {
        std::copy_n(c->data() + first, count, static_cast<uint8_t*>(dst));
      });
      continue;
    }
    keep.emplace_back(v.begin(), v.end());
    w.add_f32_as(name, shape, keep.back().data(), DType::bf16);
  }
  const std::string layer = "model.diffusion_model.double_blocks.0.img_mlp.0";
  w.add(layer + ".weight_scale", DType::f32, {}, &scale);
  w.add(layer + ".input_scale", DType::f32, {}, &scale);
  const std::string path = m.tmp.file("comfy.safetensors");
  w.write(path);
  ParamStore back(m.cfg, *m.be, DType::f32);
  load_weights(back, m.cfg, path);
  const std::vector<double> got = to_host(*m.be, back.param(fc1));
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], static_cast<float>(double(e4m3_decode(codes[1][i])) * scale)) << i;
  const std::vector<double> img = to_host(*m.be, back.param("img_in.weight"));
  for (size_t i = 0; i < img.size(); ++i) ASSERT_EQ(img[i], e4m3_decode(codes[0][i])) << i;

  // A scale that is not a positive number, and one beside a BF16 weight, are refused by name.
  const float negative = -2.0f;
  SafetensorsWriter bad = w;
  bad.add("model.diffusion_model.txt_in.weight_scale", DType::f32, {}, &negative);
  bad.write(m.tmp.file("bad.safetensors"));
  const std::string e = error_of([&] { load_weights(back, m.cfg, m.tmp.file("bad.safetensors")); });
  expect_has(e, "bad.safetensors");
  expect_has(e,
             "scale: model.diffusion_model.txt_in.weight_scale scales FP8 weights only, but "
             "model.diffusion_model.txt_in.weight is BF16");
  expect_has(e, "model.diffusion_model.txt_in.weight_scale is -2; it must be finite and positive");
}

}  // namespace
}  // namespace flux8
