// The Euler sampler (train/sampler.h), the PNG writer (io/png.h) and `flux8 sample`.
#include <gtest/gtest.h>
#include <png.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "backend/backend.h"
#include "config/config.h"
#include "core/error.h"
#include "io/png.h"
#include "io/safetensors.h"
#include "model/weights_io.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/objective.h"
#include "train/sampler.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;
using testing::run_flux8;
using testing::TempDir;

// A tiny model whose tokens are 3-channel 2×2 patches (in_channels 12).
FluxConfig sampler_config(bool guidance) {
  FluxConfig c = testing::odd_config(1, 1, guidance);
  c.latent_channels = 3;
  c.patch_size = 2;
  c.in_channels = c.out_channels = 12;
  return c;
}

TextEncoding random_encoding(const FluxConfig& c, int64_t Lt, uint64_t stream) {
  TextEncoding e{{{Lt, c.context_dim}, {}}, {{c.vec_dim}, {}}};
  for (int64_t i = 0; i < Lt * c.context_dim; ++i) e.t5.data.push_back(rng_normal(99, stream, i));
  for (int64_t i = 0; i < c.vec_dim; ++i) e.clip.data.push_back(rng_normal(99, stream + 1000, i));
  return e;
}

struct TinyModel {
  explicit TinyModel(bool guidance) : be(make_backend("cpu")), model(sampler_config(guidance), *be) {
    testing::randomize_params(model.params(), 7);
  }
  std::unique_ptr<Backend> be;
  FluxModel model;
};

SamplerOptions small_options() {
  SamplerOptions o;
  o.steps = 3;
  o.shift = true;
  o.seed = 11;
  o.images_per_prompt = 2;
  o.height = 4;
  o.width = 6;
  return o;
}

bool same(const std::vector<HostTensor>& a, const std::vector<HostTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].shape != b[i].shape || a[i].data != b[i].data) return false;
  return true;
}

TEST(Sampler, DeterministicForASeedDifferentAcrossSeeds) {
  TinyModel m(true);
  const std::vector<TextEncoding> prompts = {random_encoding(m.model.config(), 3, 1),
                                             random_encoding(m.model.config(), 3, 2)};
  SamplerOptions o = small_options();
  const auto a = sample_images(m.model, prompts, nullptr, o);
  const auto b = sample_images(m.model, prompts, nullptr, o);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a[0].shape, (std::vector<int64_t>{3, 4, 6}));
  EXPECT_TRUE(same(a, b)) << "same seed, same images";
  EXPECT_NE(a[0].data, a[1].data) << "images of one prompt must get different noise";
  o.seed = 12;
  const auto c = sample_images(m.model, prompts, nullptr, o);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NE(a[i].data, c[i].data) << "image " << i;
}

// Noise is keyed by (seed, prompt, image): prompt 1's images do not depend on prompt 0 being
// sampled with them. Same batch shapes on both sides, so equality is exact.
TEST(Sampler, ImagesDoNotDependOnOtherPrompts) {
  TinyModel m(false);
  const TextEncoding p0 = random_encoding(m.model.config(), 3, 1), p1 = random_encoding(m.model.config(), 3, 2);
  const SamplerOptions o = small_options();
  const auto both = sample_images(m.model, {p0, p1}, nullptr, o);
  // Alone, p1 is prompt 0, so its noise differs; with p0 in front it matches.
  const auto again = sample_images(m.model, {p0, p1}, nullptr, o);
  const auto alone = sample_images(m.model, {p1}, nullptr, o);
  EXPECT_TRUE(same(both, again));
  EXPECT_NE(alone[0].data, both[2].data);
  const HostTensor n = sampler_noise(o.seed, 1, 0, 3, 4, 6);
  EXPECT_EQ(n.data, sampler_noise(o.seed, 1, 0, 3, 4, 6).data);
  EXPECT_NE(n.data, sampler_noise(o.seed, 0, 1, 3, 4, 6).data) << "(prompt, image) must not commute";
}

// One unshifted step from t = 1 to 0 is x = ε + (0 − 1)·v(ε, t = 1), computed here with a
// direct model.forward on the same inputs. Both sides run identical operations, so they agree
// exactly.
TEST(Sampler, OneStepEqualsNoiseMinusVelocity) {
  TinyModel m(true);
  const FluxConfig& c = m.model.config();
  const TextEncoding p = random_encoding(c, 4, 3);
  SamplerOptions o = small_options();
  o.steps = 1;
  o.shift = false;
  o.guidance = 2.5;
  const auto got = sample_images(m.model, {p}, nullptr, o);

  const int64_t K = o.images_per_prompt, Li = 2 * 3, F = 12;
  std::vector<double> x, ids, txt, y;
  for (int64_t k = 0; k < K; ++k) {
    int64_t rows = 0, cols = 0;
    const auto tok = pack_patches(sampler_noise(o.seed, 0, k, 3, 4, 6), 2, &rows, &cols);
    x.insert(x.end(), tok.begin(), tok.end());
    const auto id = image_position_ids(4, 6, 2);
    ids.insert(ids.end(), id.begin(), id.end());
    txt.insert(txt.end(), p.t5.data.begin(), p.t5.data.end());
    y.insert(y.end(), p.clip.data.begin(), p.clip.data.end());
  }
  InputBatch batch(*m.be, DType::f32);
  FluxInputs in;
  in.img = batch.make(Shape{K, Li, F}, x);
  in.img_ids = batch.make(Shape{K, Li, 3}, ids);
  in.txt = batch.make(Shape{K, 4, c.context_dim}, txt);
  in.txt_ids = batch.make(Shape{K, 4, 3}, std::vector<double>(static_cast<size_t>(K * 4 * 3), 0.0));
  in.y = batch.make(Shape{K, c.vec_dim}, y);
  in.timesteps = batch.make(Shape{K}, {1.0, 1.0});
  in.guidance = batch.make(Shape{K}, {2.5, 2.5});
  const std::vector<double> v = to_host(*m.be, m.model.forward(in));
  double max_v = 0;
  for (size_t j = 0; j < x.size(); ++j) {
    x[j] -= v[j];
    max_v = std::max(max_v, std::abs(v[j]));
  }
  ASSERT_GT(max_v, 0.1) << "a zero velocity would make this test pass by construction";
  for (int64_t k = 0; k < K; ++k) {
    const auto want = unpack_patches(x.data() + k * Li * F, 3, 4, 6, 2);
    ASSERT_EQ(got[k].data.size(), want.size());
    for (size_t j = 0; j < want.size(); ++j)
      ASSERT_EQ(got[k].data[j], static_cast<float>(want[j])) << "image " << k << " element " << j;
  }
  // Guidance reaches the model: another value gives other images.
  o.guidance = 4.0;
  EXPECT_NE(sample_images(m.model, {p}, nullptr, o)[0].data, got[0].data);
}

TEST(Sampler, CfgScaleOneEqualsNoCfg) {
  TinyModel m(false);
  const FluxConfig& c = m.model.config();
  const TextEncoding p = random_encoding(c, 3, 4), empty = random_encoding(c, 2, 5);
  SamplerOptions o = small_options();
  const auto plain = sample_images(m.model, {p}, nullptr, o);
  EXPECT_TRUE(same(sample_images(m.model, {p}, &empty, o), plain));
  // CFG at any scale with the prompt as its own "empty" prompt is v_u + s·0 = v exactly: this
  // checks the CFG arithmetic and that both forwards see the same image and timestep.
  o.cfg_scale = 3.0;
  EXPECT_TRUE(same(sample_images(m.model, {p}, &p, o), plain));
  // A real empty prompt changes the result, and CFG without one is refused.
  EXPECT_FALSE(same(sample_images(m.model, {p}, &empty, o), plain));
  EXPECT_THROW(sample_images(m.model, {p}, nullptr, o), Error);
}

TEST(Sampler, CfgStepIsUncondPlusScaledDifference) {
  TinyModel m(false);
  const FluxConfig& c = m.model.config();
  const TextEncoding p = random_encoding(c, 3, 4), empty = random_encoding(c, 3, 5);
  SamplerOptions o = small_options();
  o.steps = 1;
  o.shift = false;
  const auto cond = sample_images(m.model, {p}, nullptr, o);        // ε − v_c
  const auto uncond = sample_images(m.model, {empty}, nullptr, o);  // prompt index 0: same ε
  o.cfg_scale = 4.0;
  const auto guided = sample_images(m.model, {p}, &empty, o);
  // ε − (v_u + s(v_c − v_u)) = (1 − s)(ε − v_u) + s(ε − v_c). The three runs share every
  // forward's inputs, so the only differences are the f32 roundings of the stored results:
  // half an ulp (6e-8 relative) of each term, allowed twice.
  for (size_t k = 0; k < guided.size(); ++k)
    for (size_t j = 0; j < guided[k].data.size(); ++j) {
      const double g = guided[k].data[j], u = uncond[k].data[j], cv = cond[k].data[j];
      const double tol = 1.2e-7 * (std::abs(g) + 3 * std::abs(u) + 4 * std::abs(cv));
      EXPECT_NEAR(g, -3.0 * u + 4.0 * cv, tol) << "image " << k << " element " << j;
    }
}

TEST(Sampler, TimestepsLinearAndShifted) {
  const auto t = sampling_timesteps(4, false, 1024);
  EXPECT_EQ(t, (std::vector<double>{1.0, 0.75, 0.5, 0.25, 0.0}));
  const auto s = sampling_timesteps(2, true, 256);  // μ = 0.5
  ASSERT_EQ(s.size(), 3u);
  EXPECT_DOUBLE_EQ(s[0], 1.0);
  EXPECT_DOUBLE_EQ(s[1], std::exp(0.5) / (std::exp(0.5) + 1.0));
  EXPECT_DOUBLE_EQ(s[2], 0.0);
  EXPECT_THROW(sampling_timesteps(0, false, 4), Error);
}

TEST(Sampler, WrongShapesAreRefused) {
  TinyModel m(false);
  SamplerOptions o = small_options();
  TextEncoding bad = random_encoding(m.model.config(), 3, 1);
  bad.clip.data.pop_back();
  bad.clip.shape = {2};
  EXPECT_THROW(sample_images(m.model, {bad}, nullptr, o), Error);
  o.height = 5;  // not a multiple of the patch size
  EXPECT_THROW(sample_images(m.model, {random_encoding(m.model.config(), 3, 1)}, nullptr, o), Error);
}

// ---- PNG ------------------------------------------------------------------------------------

// Reads a PNG back through libpng's simplified API as RGB8.
std::vector<uint8_t> read_png(const std::string& path, int64_t* w, int64_t* h) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&img, path.c_str())) {
    ADD_FAILURE() << path << ": " << img.message;
    return {};
  }
  img.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> px(PNG_IMAGE_SIZE(img));
  if (!png_image_finish_read(&img, nullptr, px.data(), 0, nullptr)) ADD_FAILURE() << img.message;
  *w = img.width;
  *h = img.height;
  return px;
}

TEST(Png, WriteThenReadBackGivesSamePixels) {
  TempDir dir;
  const int64_t W = 7, H = 5;  // odd sizes: row stride 21 bytes, no padding assumptions
  std::vector<uint8_t> rgb(W * H * 3);
  for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<uint8_t>(i * 37 + 11);
  write_png_rgb8(dir.file("a.png"), W, H, rgb);
  int64_t w = 0, h = 0;
  EXPECT_EQ(read_png(dir.file("a.png"), &w, &h), rgb);
  EXPECT_EQ(w, W);
  EXPECT_EQ(h, H);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator{}), 1)
      << "the temporary file must be renamed, not left behind";
}

TEST(Png, ErrorsNameThePath) {
  const std::string path = "/nonexistent-flux8-dir/grid.png";
  try {
    write_png_rgb8(path, 1, 1, {0, 0, 0});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  try {
    write_image_grid(path, {HostTensor{{1, 2, 2}, std::vector<float>(4)}}, 1, 1);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_THROW(write_png_rgb8("/tmp/x.png", 2, 2, {0, 0, 0}), Error);  // too few bytes
}

TEST(Png, GridLayoutScaleGutterAndValueMapping) {
  TempDir dir;
  // Three 2×3 images (h=2, w=3), each a constant colour, except image 0's pixel (1, 2).
  auto constant = [](float r, float g, float b) {
    HostTensor t{{3, 2, 3}, {}};
    for (float v : {r, g, b}) t.data.insert(t.data.end(), 6, v);
    return t;
  };
  std::vector<HostTensor> imgs = {constant(-1, 0, 1), constant(1, 1, 1), constant(-1, -1, -1)};
  imgs[0].data[0 * 6 + 1 * 3 + 2] = 0.5f;  // red channel of row 1, column 2
  imgs[2].data[0] = 7.0f;                  // out of range: clamps to 255
  write_image_grid(dir.file("g.png"), imgs, 2, 2, /*scale=*/2, /*gutter=*/2);
  int64_t W = 0, H = 0;
  const std::vector<uint8_t> px = read_png(dir.file("g.png"), &W, &H);
  ASSERT_EQ(W, 2 * 6 + 2);  // cols·w·scale + (cols−1)·gutter
  ASSERT_EQ(H, 2 * 4 + 2);
  auto at = [&](int64_t x, int64_t y) {
    const size_t i = static_cast<size_t>((y * W + x) * 3);
    return std::vector<int>{px[i], px[i + 1], px[i + 2]};
  };
  const std::vector<int> grey{kGridGutterValue, kGridGutterValue, kGridGutterValue};
  EXPECT_EQ(at(0, 0), (std::vector<int>{0, 128, 255}));    // image 0: −1→0, 0→round(127.5), 1→255
  EXPECT_EQ(at(4, 2), (std::vector<int>{191, 128, 255}));  // (0.5+1)·127.5 = 191.25, pixel (1,2)×2
  EXPECT_EQ(at(5, 3), (std::vector<int>{191, 128, 255}));  // nearest: the 2×2 block repeats it
  EXPECT_EQ(at(3, 2), (std::vector<int>{0, 128, 255}));
  EXPECT_EQ(at(6, 0), grey);  // vertical gutter: x = 6, 7
  EXPECT_EQ(at(7, 9), grey);
  EXPECT_EQ(at(8, 0), (std::vector<int>{255, 255, 255}));  // image 1: row 0, column 1
  EXPECT_EQ(at(0, 4), grey);                               // horizontal gutter: y = 4, 5
  EXPECT_EQ(at(0, 6), (std::vector<int>{255, 0, 0}));      // image 2: row 1, column 0, clamped
  EXPECT_EQ(at(1, 6), (std::vector<int>{255, 0, 0}));
  EXPECT_EQ(at(2, 6), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(at(13, 9), grey);                                      // empty 4th cell
  EXPECT_THROW(image_grid_rgb8(imgs, 1, 2, 1, 2, &W, &H), Error);  // 3 images on 2 cells
}

// ---- flux8 sample -------------------------------------------------------------------------

const char* kTinyModelYaml = R"(hidden_size: 20
num_attention_heads: 2
num_double_blocks: 1
num_single_blocks: 1
context_dim: 7
vec_dim: 3
mlp_ratio: 2.35
axes_dim: [2, 4, 4]
patch_size: 2
text_seq_len: 5
)";

struct CliFixture {
  TempDir dir;
  std::string log;
  // Writes NAME.yaml (tiny model + extra keys) and NAME.safetensors (random weights).
  std::pair<std::string, std::string> model(const std::string& name, const std::string& extra) {
    const std::string yaml = dir.file(name + ".yaml"), weights = dir.file(name + ".safetensors");
    std::ofstream(yaml) << kTinyModelYaml << "model_name: " << name << "\n" << extra;
    const FluxConfig c = FluxConfig::from_config(Config::load(yaml));
    auto be = make_backend("cpu");
    ParamStore store(c, *be, DType::f32);
    testing::randomize_params(store, 3);
    save_weights(store, c, weights, DType::f32, WeightNaming::reference);
    return {yaml, weights};
  }
  int run(const std::string& args) { return run_flux8("sample " + args, dir.file("log.txt"), &log); }
  bool logged(const std::string& s) const { return log.find(s) != std::string::npos; }
};

const char* kPixelKeys = "in_channels: 12\nlatent_channels: 3\nvae_downsample: 1\nimage_size: 8\n";
const char* kLatentKeys =
    "in_channels: 16\nlatent_channels: 4\nvae_downsample: 8\nimage_size: 32\n"
    "guidance_embed: true\nvae_scale_factor: 0.5\nvae_shift_factor: 0.25\n";

TEST(SamplerCli, PixelModelWritesPngGridOneRowPerPrompt) {
  CliFixture f;
  const auto [yaml, weights] = f.model("pix", kPixelKeys);
  const std::string png = f.dir.file("grid.png");
  ASSERT_EQ(f.run(fmt::format("--checkpoint {} -c {} --prompt 'a red square' --prompt 'blue' "
                              "--per-prompt 3 --steps 2 --out {}",
                              weights, yaml, png)),
            0)
      << f.log;
  int64_t W = 0, H = 0;
  read_png(png, &W, &H);
  EXPECT_EQ(W, 3 * 8 * 16 + 2 * 2) << "8 px cells shown x16 (>= 128 px), 3 per row";
  EXPECT_EQ(H, 2 * 8 * 16 + 2);
  EXPECT_TRUE(f.logged("shift off")) << f.log;  // pixel models default to no shift

  // Misuse: latent output for a pixel model, guidance on a model without the embedding.
  EXPECT_NE(f.run(fmt::format("--checkpoint {} -c {} --prompt x --out {}", weights, yaml, f.dir.file("l.safetensors"))),
            0);
  EXPECT_TRUE(f.logged("must end in .png")) << f.log;
  EXPECT_NE(f.run(fmt::format("--checkpoint {} -c {} --prompt x --guidance 2 --out {}", weights, yaml, png)), 0);
  EXPECT_TRUE(f.logged("no guidance embedding")) << f.log;
  EXPECT_NE(f.run(fmt::format("--checkpoint {} --prompt x --out {}", weights, png)), 0);
  EXPECT_TRUE(f.logged("-c/--config")) << f.log;
}

TEST(SamplerCli, CheckpointDirectoryCarriesItsConfig) {
  CliFixture f;
  const auto [yaml, weights] = f.model("pix", kPixelKeys);
  const fs::path ckpt = fs::path(f.dir.path()) / "step-0000005";
  fs::create_directories(ckpt);
  fs::copy_file(weights, ckpt / "model.safetensors");
  TrainerState st;
  st.step = 5;
  st.config_yaml = Config::load(yaml).dump();
  std::ofstream(ckpt / "trainer_state.json") << trainer_state_to_json(st);
  const std::string png = f.dir.file("grid.png");
  ASSERT_EQ(f.run(fmt::format("--checkpoint {} --prompt hello --per-prompt 1 --steps 1 --out {}", ckpt.string(), png)),
            0)
      << f.log;
  EXPECT_TRUE(fs::exists(png));
  EXPECT_NE(f.run(fmt::format("--checkpoint {} -c {} --prompt x --out {}", ckpt.string(), yaml, png)), 0);
  EXPECT_TRUE(f.logged("carries the run's config")) << f.log;
}

TEST(SamplerCli, LatentModelNeedsEmbeddingsAndWritesUnscaledLatents) {
  CliFixture f;
  const auto [yaml, weights] = f.model("lat", kLatentKeys);
  const std::string lat = f.dir.file("out.safetensors");
  EXPECT_NE(f.run(fmt::format("--checkpoint {} -c {} --prompt x --out {}", weights, yaml, weights)), 0);
  EXPECT_TRUE(f.logged("would overwrite")) << f.log;
  EXPECT_NE(f.run(fmt::format("--checkpoint {} -c {} --prompt x --out {}", weights, yaml, lat)), 0);
  EXPECT_TRUE(f.logged("--text-embeddings")) << f.log;

  // Two prompts' encodings, no empty prompt.
  const std::string emb = f.dir.file("emb.safetensors");
  std::vector<float> t5(4 * 7), clip(3);
  for (size_t i = 0; i < t5.size(); ++i) t5[i] = std::sin(static_cast<float>(i));
  for (size_t i = 0; i < clip.size(); ++i) clip[i] = std::cos(static_cast<float>(i));
  SafetensorsWriter w;
  for (const char* i : {"0", "1"}) {
    w.add(std::string("t5.") + i, DType::f32, {4, 7}, t5.data());
    w.add(std::string("clip.") + i, DType::f32, {3}, clip.data());
  }
  w.write(emb);
  EXPECT_NE(f.run(fmt::format("--checkpoint {} -c {} --text-embeddings {} --out {}", weights, yaml, emb,
                              f.dir.file("g.png"))),
            0);
  EXPECT_TRUE(f.logged("--out FILE.safetensors")) << f.log;
  EXPECT_NE(
      f.run(fmt::format("--checkpoint {} -c {} --text-embeddings {} --cfg-scale 2 --out {}", weights, yaml, emb, lat)),
      0);
  EXPECT_TRUE(f.logged("t5.empty")) << f.log;
  EXPECT_NE(f.run(fmt::format("--checkpoint {} -c {} --text-embeddings {} --prompt only-one --out {}", weights, yaml,
                              emb, lat)),
            0);
  EXPECT_TRUE(f.logged("holds 2 prompts")) << f.log;

  ASSERT_EQ(f.run(fmt::format("--checkpoint {} -c {} --text-embeddings {} --prompt a --prompt b "
                              "--per-prompt 2 --steps 2 --seed 5 --out {}",
                              weights, yaml, emb, lat)),
            0)
      << f.log;
  EXPECT_TRUE(f.logged("shift on")) << f.log;  // latent models default to the shift
  EXPECT_TRUE(f.logged("guidance 3.5")) << f.log;
  const SafetensorsReader r(lat);
  EXPECT_EQ(r.tensor("latents").shape, (std::vector<int64_t>{4, 4, 4, 4}));
  EXPECT_EQ(r.metadata().at("prompts"), R"(["a","b"])");
  EXPECT_EQ(r.metadata().at("images_per_prompt"), "2");

  // The file holds z = x / 0.5 + 0.25 of the sampler's output (same seed, same steps).
  const Config cfg = Config::load(yaml);
  auto be = make_backend("cpu");
  FluxModel model(FluxConfig::from_config(cfg), *be);
  load_weights(model.params(), model.config(), weights);
  SamplerOptions o;
  o.steps = 2;
  o.seed = 5;
  o.images_per_prompt = 2;
  o.height = o.width = 4;
  const TextEncoding e{{{4, 7}, t5}, {{3}, clip}};
  const auto x = sample_images(model, {e, e}, nullptr, o);
  std::vector<float> z(static_cast<size_t>(r.tensor("latents").numel()));
  r.read_f32("latents", z.data());
  for (size_t i = 0; i < z.size(); ++i)
    EXPECT_FLOAT_EQ(z[i], static_cast<float>(x[i / 64].data[i % 64] / 0.5 + 0.25)) << i;
}

}  // namespace
}  // namespace flux8
