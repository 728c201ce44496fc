// Checkpoint weights in the reference and diffusers naming: round trips, the name map's
// coverage at full Flux size, and that every mismatch is reported.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "backend/backend.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "model/name_map.h"
#include "model/weights_io.h"
#include "model_test_util.h"
#include "test_util.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

TEST(WeightsIo, RoundTripBothNamings) {
  const FluxConfig cfg = testing::odd_config(1, 1, true);
  auto be = make_backend("cpu");
  ParamStore src(cfg, *be, DType::f32), ref(cfg, *be, DType::f32), dif(cfg, *be, DType::f32);
  testing::randomize_params(src, 5);
  TempDir tmp;
  save_weights(src, cfg, tmp.file("ref.safetensors"), DType::f32, WeightNaming::reference);
  save_weights(src, cfg, tmp.file("dif.safetensors"), DType::f32, WeightNaming::diffusers);
  load_weights(ref, cfg, tmp.file("ref.safetensors"));
  load_weights(dif, cfg, tmp.file("dif.safetensors"));
  EXPECT_EQ(to_host(*be, src.flat_params()), to_host(*be, ref.flat_params()));
  EXPECT_EQ(to_host(*be, src.flat_params()), to_host(*be, dif.flat_params()));
  // The diffusers file really uses diffusers names.
  const SafetensorsReader f(tmp.file("dif.safetensors"));
  EXPECT_TRUE(f.contains("transformer_blocks.0.attn.to_q.weight"));
  EXPECT_TRUE(f.contains("norm_out.linear.weight"));
  EXPECT_FALSE(f.contains("img_in.weight"));
}

TEST(WeightsIo, Bf16FileHoldsRoundedValues) {
  const FluxConfig cfg = testing::odd_config(1, 0, false);
  auto be = make_backend("cpu");
  ParamStore src(cfg, *be, DType::f32), back(cfg, *be, DType::f32);
  testing::randomize_params(src, 6);
  TempDir tmp;
  save_weights(src, cfg, tmp.file("w.safetensors"), DType::bf16, WeightNaming::reference);
  EXPECT_EQ(SafetensorsReader(tmp.file("w.safetensors")).tensor("img_in.weight").dtype, "BF16");
  load_weights(back, cfg, tmp.file("w.safetensors"));
  const auto a = to_host(*be, src.flat_params()), b = to_host(*be, back.flat_params());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(b[i], round_to_bf16(static_cast<float>(a[i])));
}

TEST(WeightsIo, EveryMismatchIsReported) {
  const FluxConfig small = testing::odd_config(1, 1, false);
  FluxConfig other = small;
  other.num_double_blocks = 2;  // the file has a block the model lacks
  other.guidance_embed = true;
  other.in_channels = 6;  // img_in has another shape
  auto be = make_backend("cpu");
  ParamStore src(other, *be, DType::f32), dst(small, *be, DType::f32);
  TempDir tmp;
  save_weights(src, other, tmp.file("w.safetensors"), DType::f32, WeightNaming::reference);
  const std::string msg = error_of([&] { load_weights(dst, small, tmp.file("w.safetensors")); });
  EXPECT_NE(msg.find("w.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shape: img_in.weight is [20, 6] in the file, the model needs [20, 5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected: double_blocks.1.img_attn.qkv.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected: guidance_in.in_layer.weight"), std::string::npos) << msg;

  // And the other way: tensors the model needs that the file lacks.
  ParamStore big(other, *be, DType::f32);
  ParamStore small_src(small, *be, DType::f32);
  save_weights(small_src, small, tmp.file("s.safetensors"), DType::f32, WeightNaming::reference);
  const std::string msg2 = error_of([&] { load_weights(big, other, tmp.file("s.safetensors")); });
  EXPECT_NE(msg2.find("missing: double_blocks.1.txt_mlp.2.bias"), std::string::npos) << msg2;
  EXPECT_NE(msg2.find("missing: guidance_in.out_layer.weight"), std::string::npos) << msg2;
}

TEST(WeightsIo, NonFluxFileIsRefused) {
  const FluxConfig cfg = testing::odd_config(0, 1, false);
  auto be = make_backend("cpu");
  ParamStore store(cfg, *be, DType::f32);
  TempDir tmp;
  std::vector<float> data(100, 1.0f);
  SafetensorsWriter w;
  w.add("something_else", DType::f32, {1}, data.data());
  w.write(tmp.file("other.safetensors"));
  EXPECT_NE(error_of([&] {
              load_weights(store, cfg, tmp.file("other.safetensors"));
            }).find("is this a Flux transformer checkpoint"),
            std::string::npos);
}

TEST(WeightsIo, IntegerTensorIsRefusedByName) {
  // A hand-made file: every parameter F32 except img_in.bias stored as I32.
  const FluxConfig cfg = testing::odd_config(0, 1, false);
  auto be = make_backend("cpu");
  ParamStore store(cfg, *be, DType::f32);
  nlohmann::json header;
  size_t offset = 0;
  for (const ParamInfo& p : store.layout().params()) {
    const size_t bytes = static_cast<size_t>(p.shape.numel()) * 4;
    header[p.name] = {{"dtype", p.name == "img_in.bias" ? "I32" : "F32"},
                      {"shape", std::vector<int64_t>(p.shape.d.begin(), p.shape.d.begin() + p.shape.rank)},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  while (text.size() % 8) text += ' ';
  TempDir tmp;
  std::ofstream out(tmp.file("int.safetensors"), std::ios::binary);
  const uint64_t n = text.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << text << std::string(offset, '\0');
  out.close();
  const std::string msg = error_of([&] { load_weights(store, cfg, tmp.file("int.safetensors")); });
  EXPECT_NE(msg.find("dtype: img_in.bias is I32"), std::string::npos) << msg;
}

TEST(NameMap, CoversEveryRowOfEveryTensorOnceAtFullSize) {
  // flux_12b_dev: 19 double + 38 single blocks, guidance on.
  FluxConfig cfg;
  cfg.guidance_embed = true;
  const ParamLayout layout = ParamLayout::build(cfg);
  EXPECT_EQ(layout.total(), 11'901'408'320);
  const std::vector<DiffusersTensor> tensors = diffusers_tensors(layout, cfg);
  std::map<std::string, std::vector<int>> rows_seen;
  int64_t total = 0;
  for (const auto& t : tensors) {
    rows_seen[t.name].assign(static_cast<size_t>(t.shape[0]), 0);
    total += t.shape.numel();
  }
  EXPECT_EQ(total, layout.total());
  for (const ParamInfo& p : layout.params()) {
    std::vector<int> bfl_rows(static_cast<size_t>(p.shape[0]), 0);
    for (const NamePiece& piece : diffusers_pieces(p, cfg)) {
      for (int64_t r = 0; r < piece.rows; ++r) {
        ++rows_seen.at(piece.diffusers).at(static_cast<size_t>(piece.diffusers_row + r));
        ++bfl_rows.at(static_cast<size_t>(piece.bfl_row + r));
      }
    }
    for (int c : bfl_rows) ASSERT_EQ(c, 1) << p.name;
  }
  for (const auto& [name, seen] : rows_seen)
    for (int c : seen) ASSERT_EQ(c, 1) << name;
  // Spot checks against diffusers' module shapes.
  std::map<std::string, Shape> by_name;
  for (const auto& t : tensors) by_name[t.name] = t.shape;
  EXPECT_EQ(by_name.at("transformer_blocks.18.attn.add_k_proj.weight"), (Shape{3072, 3072}));
  EXPECT_EQ(by_name.at("single_transformer_blocks.37.proj_mlp.weight"), (Shape{12288, 3072}));
  EXPECT_EQ(by_name.at("single_transformer_blocks.0.proj_out.weight"), (Shape{3072, 15360}));
  EXPECT_EQ(by_name.at("time_text_embed.guidance_embedder.linear_1.weight"), (Shape{3072, 256}));
  EXPECT_EQ(by_name.at("norm_out.linear.weight"), (Shape{6144, 3072}));
}

TEST(ParamLayout, ExactReferenceCounts) {
  FluxConfig c;  // flux_12b_schnell defaults
  EXPECT_EQ(ParamLayout::build(c).total(), 11'891'178'560);
  c.num_double_blocks = 1;
  c.num_single_blocks = 1;
  EXPECT_EQ(ParamLayout::build(c).total(), 535'318'336);
  const ParamLayout L = ParamLayout::build(c);
  EXPECT_EQ(L.at("double_blocks.0.img_attn.qkv.weight").shape, (Shape{9216, 3072}));
  EXPECT_EQ(L.at("double_blocks.0.img_mod.lin.weight").shape, (Shape{18432, 3072}));
  EXPECT_EQ(L.at("single_blocks.0.linear1.weight").shape, (Shape{21504, 3072}));
  EXPECT_EQ(L.at("single_blocks.0.linear2.weight").shape, (Shape{3072, 15360}));
  EXPECT_EQ(L.at("final_layer.adaLN_modulation.1.weight").shape, (Shape{6144, 3072}));
  EXPECT_EQ(L.at("final_layer.linear.weight").shape, (Shape{64, 3072}));
  EXPECT_EQ(L.at("double_blocks.0.img_attn.norm.query_norm.scale").shape, (Shape{128}));
}

TEST(ParamStore, InitIsMlperfReference) {
  const FluxConfig cfg = testing::odd_config(1, 1, true);
  auto be = make_backend("cpu");
  ParamStore s(cfg, *be, DType::f64);
  s.init(42);
  auto stats = [&](const std::string& n) {
    const auto v = to_host(*be, s.param(n));
    double mx = 0, sum2 = 0;
    for (double x : v) mx = std::max(mx, std::abs(x)), sum2 += x * x;
    return std::pair{mx, std::sqrt(sum2 / static_cast<double>(v.size()))};
  };
  // Xavier-uniform bound √(6/(fan_in+fan_out)) on the fused qkv shape [60, 20].
  const auto [qmax, qrms] = stats("double_blocks.0.img_attn.qkv.weight");
  EXPECT_LE(qmax, std::sqrt(6.0 / 80.0));
  EXPECT_NEAR(qrms, std::sqrt(6.0 / 80.0) / std::sqrt(3.0), 0.03);
  EXPECT_NEAR(stats("time_in.in_layer.weight").second, 0.02, 0.004);
  EXPECT_EQ(stats("double_blocks.0.img_mod.lin.weight").first, 0.0);
  EXPECT_EQ(stats("single_blocks.0.modulation.lin.weight").first, 0.0);
  EXPECT_EQ(stats("final_layer.linear.weight").first, 0.0);
  EXPECT_EQ(stats("final_layer.adaLN_modulation.1.weight").first, 0.0);
  EXPECT_EQ(stats("double_blocks.0.img_attn.qkv.bias").first, 0.0);
  const auto scale = to_host(*be, s.param("single_blocks.0.norm.key_norm.scale"));
  for (double x : scale) EXPECT_EQ(x, 1.0);
  // Same seed, same weights; another seed, other weights.
  ParamStore s2(cfg, *be, DType::f64);
  s2.init(42);
  EXPECT_EQ(to_host(*be, s.flat_params()), to_host(*be, s2.flat_params()));
  s2.init(43);
  EXPECT_NE(to_host(*be, s.flat_params()), to_host(*be, s2.flat_params()));
}

}  // namespace
}  // namespace flux8
