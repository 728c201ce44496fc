#include "data/demo.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/error.h"
#include "core/rng.h"
#include "data/tar.h"
#include "data/text_encoder.h"

namespace flux8 {
namespace fs = std::filesystem;

// The spec's fields under their own names (the manifest's keys).
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(DemoSpec, image_size, text_seq_len, context_dim, vec_dim, train_samples, val_samples,
                                   samples_per_shard, seed)

namespace {

constexpr uint64_t kGeometryPurpose = 0x67656F6Dull;  // "geom"

void check_spec(const DemoSpec& s) {
  if (s.image_size < 8)
    fail("demo dataset: image_size {} is too small to draw a shape; use >= 8 (e.g. 16, 24, 32)", s.image_size);
  if (s.train_samples < 0 || s.val_samples < 0)
    fail("demo dataset: train_samples ({}) and val_samples ({}) must be >= 0", s.train_samples, s.val_samples);
  if (s.samples_per_shard < 1) fail("demo dataset: samples_per_shard is {}; it must be >= 1", s.samples_per_shard);
  if (s.train_samples + s.val_samples > 1000000)
    fail("demo dataset: {} samples exceed the six-digit keys (at most 1000000)", s.train_samples + s.val_samples);
}

// Length of [a0, a1) inside [b0, b1).
float overlap(float a0, float a1, float b0, float b1) { return std::max(0.0f, std::min(a1, b1) - std::max(a0, b0)); }

// Fraction of pixel (px, py) inside the shape. The square is exact (product of the 1-D
// overlaps). Circle and triangle integrate over four horizontal bands, each clipped to the
// shape's vertical extent and weighted by the exact horizontal overlap of the shape's chord at
// the clipped band's middle (midpoint rule: exact for the triangle's linear sides, except where
// a band holds the apex; within a few percent of the circle's area at 16 px).
float coverage(int shape, const DemoGeometry& g, int64_t px, int64_t py) {
  const float x = static_cast<float>(px), y = static_cast<float>(py);
  const float top = g.cy - g.half, bottom = g.cy + g.half;
  if (shape == 1) return overlap(x, x + 1, g.cx - g.half, g.cx + g.half) * overlap(y, y + 1, top, bottom);
  float area = 0;
  for (int b = 0; b < 4; ++b) {
    const float y0 = std::max(y + 0.25f * static_cast<float>(b), top);
    const float y1 = std::min(y + 0.25f * static_cast<float>(b + 1), bottom);
    if (y1 <= y0) continue;
    const float dy = 0.5f * (y0 + y1) - g.cy;
    // Chord half-width: circle sqrt(h^2 - dy^2); triangle with apex (0, -h) and base from
    // (-h, h) to (h, h) grows linearly, (dy + h) / 2.
    const float w = shape == 0 ? std::sqrt(std::max(0.0f, g.half * g.half - dy * dy)) : 0.5f * (dy + g.half);
    area += (y1 - y0) * overlap(x, x + 1, g.cx - w, g.cx + w);
  }
  return area;
}

void write_file(const fs::path& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) fail("demo dataset: cannot open {} for writing; check the directory is writable", path.string());
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) fail("demo dataset: writing {} failed (disk full?)", path.string());
}

nlohmann::json manifest_json(const DemoSpec& s) {
  nlohmann::json j = s;
  j["format"] = "flux8-demo";
  j["format_version"] = kDemoFormatVersion;
  j["text_encoder"] = DemoTextEncoder::kName;
  j["train_shards"] = demo_shard_names(s, "train");
  j["val_shards"] = demo_shard_names(s, "val");
  return j;
}

void write_split(const fs::path& dir, const DemoSpec& spec, std::string_view split, int64_t first_index,
                 int64_t count) {
  const std::vector<std::string> names = demo_shard_names(spec, split);
  for (size_t s = 0; s < names.size(); ++s) {
    TarWriter tar((dir / names[s]).string());
    const int64_t begin = static_cast<int64_t>(s) * spec.samples_per_shard;
    const int64_t end = std::min(count, begin + spec.samples_per_shard);
    for (int64_t i = begin; i < end; ++i) {
      const Sample smp = demo_sample(spec, first_index + i);
      tar.add(smp.key + ".image.npy", encode_npy_f32(smp.at("image")));
      tar.add(smp.key + ".t5.npy", encode_npy_f32(smp.at("t5")));
      tar.add(smp.key + ".clip.npy", encode_npy_f32(smp.at("clip")));
      tar.add(smp.key + ".txt", smp.caption);
    }
    tar.finish();
  }
}

}  // namespace

std::string DemoAttributes::caption() const {
  return fmt::format("{} {} {}", kDemoColours[static_cast<size_t>(colour)], kDemoShapes[static_cast<size_t>(shape)],
                     kDemoPositions[static_cast<size_t>(position)]);
}

DemoAttributes demo_attributes(int64_t index) {
  if (index < 0) fail("demo dataset: sample index {} is negative", index);
  DemoAttributes a;
  a.colour = static_cast<int>(index % 7);
  a.shape = static_cast<int>(index / 7 % 3);
  a.position = static_cast<int>(index / 21 % 5);
  return a;
}

DemoGeometry demo_geometry(uint64_t seed, int64_t index, int64_t image_size) {
  const DemoAttributes a = demo_attributes(index);
  const float S = static_cast<float>(image_size);
  const uint64_t stream = rng_stream(kGeometryPurpose, static_cast<uint64_t>(index));
  auto jitter = [&](uint64_t k) { return 2.0f * rng_uniform(seed, stream, k) - 1.0f; };  // [-1, 1)
  // Centre +-5% and half-side S/6 +-10%: the far edge stays below 0.25 + 0.05 + 0.1834 of
  // the side, inside the quadrant (or, for "center", inside the central half).
  const float qx[5] = {0.25f, 0.75f, 0.25f, 0.75f, 0.5f};
  const float qy[5] = {0.25f, 0.25f, 0.75f, 0.75f, 0.5f};
  DemoGeometry g;
  g.cx = S * (qx[a.position] + 0.05f * jitter(0));
  g.cy = S * (qy[a.position] + 0.05f * jitter(1));
  g.half = S / 6.0f * (1.0f + 0.1f * jitter(2));
  return g;
}

HostTensor render_demo_image(const DemoAttributes& a, const DemoGeometry& g, int64_t image_size) {
  const int64_t S = image_size;
  HostTensor img;
  img.shape = {3, S, S};
  img.data.resize(static_cast<size_t>(3 * S * S));
  const auto& col = kDemoColourRGB[static_cast<size_t>(a.colour)];
  for (int c = 0; c < 3; ++c) std::fill_n(img.data.begin() + c * S * S, S * S, 2.0f * kDemoBackgroundRGB[c] - 1.0f);
  const int64_t x0 = std::max<int64_t>(0, static_cast<int64_t>(std::floor(g.cx - g.half)));
  const int64_t x1 = std::min<int64_t>(S, static_cast<int64_t>(std::ceil(g.cx + g.half)));
  const int64_t y0 = std::max<int64_t>(0, static_cast<int64_t>(std::floor(g.cy - g.half)));
  const int64_t y1 = std::min<int64_t>(S, static_cast<int64_t>(std::ceil(g.cy + g.half)));
  for (int64_t y = y0; y < y1; ++y)
    for (int64_t x = x0; x < x1; ++x) {
      const float cov = coverage(a.shape, g, x, y);
      if (cov == 0.0f) continue;
      for (int c = 0; c < 3; ++c) {
        const float v = kDemoBackgroundRGB[c] + cov * (col[c] - kDemoBackgroundRGB[c]);
        img.data[static_cast<size_t>((c * S + y) * S + x)] = 2.0f * v - 1.0f;
      }
    }
  return img;
}

std::vector<std::string> demo_vocabulary() {
  std::vector<std::string> words;
  auto add = [&](std::string_view phrase) {
    for (std::string& w : DemoTextEncoder::words(phrase))
      if (std::find(words.begin(), words.end(), w) == words.end()) words.push_back(std::move(w));
  };
  for (auto c : kDemoColours) add(c);
  for (auto s : kDemoShapes) add(s);
  for (auto p : kDemoPositions) add(p);
  return words;
}

std::string demo_key(int64_t index) { return fmt::format("{:06d}", index); }

Sample demo_sample(const DemoSpec& spec, int64_t index) {
  check_spec(spec);
  const DemoAttributes a = demo_attributes(index);
  Sample s;
  s.key = demo_key(index);
  s.shard = "<demo>";
  s.caption = a.caption();
  s.fields["image"] = render_demo_image(a, demo_geometry(spec.seed, index, spec.image_size), spec.image_size);
  TextEncoding enc = DemoTextEncoder(spec.text_seq_len, spec.context_dim, spec.vec_dim).encode(s.caption);
  s.fields["t5"] = std::move(enc.t5);
  s.fields["clip"] = std::move(enc.clip);
  return s;
}

std::string encode_npy_f32(const HostTensor& t) {
  FLUX8_CHECK(static_cast<int64_t>(t.data.size()) == t.numel(), "tensor holds {} values for {} elements", t.data.size(),
              t.numel());
  std::string shape = "(";
  for (size_t i = 0; i < t.shape.size(); ++i) shape += fmt::format("{}, ", t.shape[i]);
  if (t.shape.size() == 1)
    shape.pop_back();  // "(8,)"
  else if (t.shape.size() > 1)
    shape.resize(shape.size() - 2);
  shape += ")";
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shape + ", }";
  // Magic (6) + version (2) + length (2) + header, padded with spaces and ended by '\n' to a
  // multiple of 64 bytes so the data is aligned (what numpy writes).
  const size_t total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.append(total - 10 - header.size() - 1, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(header.size() & 0xFF));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  static_assert(std::endian::native == std::endian::little, "npy writer assumes a little-endian host");
  out.append(reinterpret_cast<const char*>(t.data.data()), t.data.size() * sizeof(float));
  return out;
}

std::vector<std::string> demo_shard_names(const DemoSpec& spec, std::string_view split) {
  const int64_t n = split == "train" ? spec.train_samples : spec.val_samples;
  const int64_t shards = spec.samples_per_shard > 0 ? (n + spec.samples_per_shard - 1) / spec.samples_per_shard : 0;
  std::vector<std::string> names;
  for (int64_t s = 0; s < shards; ++s) names.push_back(fmt::format("{}-{:06d}.tar", split, s));
  return names;
}

void write_demo_dataset(const std::string& out_dir, const DemoSpec& spec) {
  check_spec(spec);
  const fs::path dir(out_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("demo dataset: cannot create directory {}: {}", out_dir, ec.message());
  fs::remove(dir / "manifest.json", ec);
  static const std::regex shard_name(R"((train|val)-\d{6}\.tar)");
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.is_regular_file() && std::regex_match(entry.path().filename().string(), shard_name))
      fs::remove(entry.path());

  write_split(dir, spec, "train", 0, spec.train_samples);
  write_split(dir, spec, "val", spec.train_samples, spec.val_samples);

  const TextEncoding empty = DemoTextEncoder(spec.text_seq_len, spec.context_dim, spec.vec_dim).encode("");
  write_file(dir / "empty_prompt.t5.npy", encode_npy_f32(empty.t5));
  write_file(dir / "empty_prompt.clip.npy", encode_npy_f32(empty.clip));

  write_file(dir / "manifest.json.tmp", manifest_json(spec).dump(2) + "\n");
  fs::rename(dir / "manifest.json.tmp", dir / "manifest.json", ec);
  if (ec) fail("demo dataset: cannot rename {}/manifest.json.tmp into place: {}", out_dir, ec.message());
}

bool demo_dataset_matches(const std::string& out_dir, const DemoSpec& spec) {
  const fs::path dir(out_dir);
  std::ifstream f(dir / "manifest.json");
  if (!f) return false;
  const nlohmann::json found = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (found.is_discarded() || found != manifest_json(spec)) return false;
  std::error_code ec;
  for (std::string_view split : {"train", "val"})
    for (const std::string& name : demo_shard_names(spec, split))
      if (!fs::is_regular_file(dir / name, ec)) return false;
  return fs::is_regular_file(dir / "empty_prompt.t5.npy", ec) && fs::is_regular_file(dir / "empty_prompt.clip.npy", ec);
}

}  // namespace flux8
