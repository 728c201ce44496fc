// Training checkpoints: SHA-256 against the FIPS 180 examples, bit-exact save/load, refusal of
// altered and truncated files, recovery from a run killed mid-write, pruning, checkpoints
// written from a host snapshot behind training, and the stop signals.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <tuple>

#include "backend/backend.h"
#include "core/error.h"
#include "core/sha256.h"
#include "io/safetensors.h"
#include "model/weights_io.h"
#include "model_test_util.h"
#include "test_util.h"
#include "train/async_checkpoint.h"
#include "train/checkpoint.h"
#include "train/signals.h"

namespace flux8 {
namespace {

namespace fs = std::filesystem;

// ---- SHA-256: FIPS 180-2 appendix B / NIST example vectors ----------------------------------

TEST(Sha256, FipsVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, MillionAInUnevenChunks) {
  // Chunks of 1..97 bytes cross the 64-byte block boundary at every offset.
  Sha256 h;
  const std::string a(97, 'a');
  size_t left = 1000000, n = 1;
  while (left > 0) {
    const size_t take = std::min(left, n);
    h.update(a.data(), take);
    left -= take;
    n = n % 97 + 1;
  }
  EXPECT_EQ(h.hex_digest(), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// The SHA-extension compression against the portable one: from random states over random
// blocks, one at a time and many at once (the streaming Sha256 and the vectors above use the
// hardware one wherever the CPU has it).
TEST(Sha256, HardwareBlocksEqualPortableOnes) {
  if (!sha256_blocks::hardware_available()) GTEST_SKIP() << "this CPU has no SHA extensions";
  uint32_t seed = 12345;
  auto next = [&] { return seed = seed * 1664525u + 1013904223u; };
  std::vector<uint8_t> data(64 * 37);
  for (uint8_t& b : data) b = static_cast<uint8_t>(next() >> 24);
  for (const size_t blocks : {size_t(1), size_t(2), size_t(3), size_t(37)}) {
    for (int trial = 0; trial < 20; ++trial) {
      uint32_t a[8], b[8];
      for (int i = 0; i < 8; ++i) a[i] = b[i] = next();
      const size_t first = next() % (data.size() / 64 - blocks + 1);
      sha256_blocks::portable(a, data.data() + 64 * first, blocks);
      sha256_blocks::hardware(b, data.data() + 64 * first, blocks);
      EXPECT_TRUE(std::equal(a, a + 8, b)) << blocks << " blocks from block " << first;
    }
  }
}

TEST(Sha256, FileMatchesMemory) {
  const fs::path p = fs::temp_directory_path() / ("flux8_sha_" + std::to_string(::getpid()));
  std::string data;
  for (uint32_t i = 0; i < 300000; ++i) data.push_back(static_cast<char>(i * 7919u % 251u));
  std::ofstream(p, std::ios::binary) << data;
  EXPECT_EQ(sha256_file(p.string()), sha256_hex(data));
  fs::remove(p);
  EXPECT_THROW(sha256_file(p.string()), Error);
}

TEST(Sha256, FileRangeMatchesMemory) {
  const fs::path p = fs::temp_directory_path() / ("flux8_sha_range_" + std::to_string(::getpid()));
  std::string data;
  for (uint32_t i = 0; i < (9u << 20); ++i) data.push_back(static_cast<char>(i * 2654435761u >> 24));
  std::ofstream(p, std::ios::binary) << data;
  for (const auto& [offset, bytes] : {std::pair<uint64_t, uint64_t>{0, 0},
                                      {0, 1},
                                      {77, 100003},
                                      {5000000, 4194311},
                                      {0, data.size()},
                                      {data.size() - 9, 9}})
    EXPECT_EQ(sha256_file_range(p.string(), offset, bytes), sha256_hex(std::string_view(data).substr(offset, bytes)))
        << offset << " " << bytes;
  const std::string e = testing::error_of([&] { sha256_file_range(p.string(), data.size() - 4, 8); });
  EXPECT_NE(e.find("the file ends before them"), std::string::npos) << e;
  fs::remove(p);
}

// ---- checkpoints ---------------------------------------------------------------------------

struct TempRoot {
  fs::path path;
  TempRoot() {
    path = fs::temp_directory_path() / ("flux8_ckpt_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempRoot() { fs::remove_all(path); }
  std::string str() const { return path.string(); }
};

using testing::error_of;
using testing::expect_mentions;

// The names in `dir`, sorted.
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A model with its moments: parameters random, moments distinct random values (v > 0).
struct ModelRun {
  FluxConfig cfg = testing::odd_config(1, 1, false);
  std::unique_ptr<Backend> be = make_backend("cpu");
  DType dtype;
  ParamStore store;
  void* m_mem;
  void* v_mem;
  Tensor m, v;
  TrainerState state;

  // Moments in the parameters' type, or in `moments` (bf16: adam_moment_precision).
  explicit ModelRun(DType t = DType::f32, std::optional<DType> moments = std::nullopt) : dtype(t), store(cfg, *be, t) {
    const int64_t n = store.layout().total();
    const DType mt = moments.value_or(t);
    m_mem = be->allocate(static_cast<size_t>(n) * dtype_size(mt));
    v_mem = be->allocate(static_cast<size_t>(n) * dtype_size(mt));
    m = Tensor(m_mem, mt, Shape{n});
    v = Tensor(v_mem, mt, Shape{n});
  }
  ~ModelRun() {
    be->release(m_mem);
    be->release(v_mem);
  }
  // Values are f32-representable, as they would be after training in f32, so that saving in
  // F32 is exact for the f64 model too.
  void randomize(uint64_t seed) {
    testing::randomize_params(store, seed);
    std::vector<double> p = to_host(*be, store.flat_params());
    for (double& x : p) x = static_cast<float>(x);
    from_host(*be, store.flat_params(), p);
    std::vector<double> mv(static_cast<size_t>(m.numel())), vv(mv.size());
    for (size_t i = 0; i < mv.size(); ++i) {
      mv[i] = static_cast<float>(1e-3 * rng_normal(seed, 100, i));
      vv[i] = static_cast<float>(1e-6 * std::exp(rng_normal(seed, 101, i)));
    }
    from_host(*be, m, mv);
    from_host(*be, v, vv);
    state.step = 100;
    state.consumed_samples = 1600;
    state.data_epoch = 2;
    state.data_position = 37;
    state.seed = 0xfedcba9876543210ull;  // above INT64_MAX: must survive JSON as unsigned
    state.skipped_steps = 3;
    state.last_loss = 0.1 + 1.0 / 3.0;  // needs all 17 digits
    state.config_yaml = "model:\n  hidden_size: 20\n  name: \"odd \\u00e9\"\n";
    state.flux8_version = "0.1.0-test";
  }
  std::string save(const std::string& root, int64_t step, int keep_last = 0) {
    state.step = step;
    return save_checkpoint(root, state, cfg, store, m, v, keep_last);
  }
};

void expect_same_state(const TrainerState& a, const TrainerState& b) {
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.consumed_samples, b.consumed_samples);
  EXPECT_EQ(a.data_epoch, b.data_epoch);
  EXPECT_EQ(a.data_position, b.data_position);
  EXPECT_EQ(a.seed, b.seed);
  EXPECT_EQ(a.skipped_steps, b.skipped_steps);
  EXPECT_EQ(std::memcmp(&a.last_loss, &b.last_loss, sizeof(double)), 0) << a.last_loss << " vs " << b.last_loss;
  EXPECT_EQ(a.config_yaml, b.config_yaml);
  EXPECT_EQ(a.flux8_version, b.flux8_version);
}

void flip_byte(const fs::path& file, uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x10));
}

TEST(Checkpoint, LayoutAndManifest) {
  TempRoot root;
  ModelRun run;
  run.randomize(1);
  const std::string dir = run.save(root.str(), 100);
  EXPECT_EQ(fs::path(dir).filename(), "step-0000100");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer_state.json", "manifest.json"})
    EXPECT_TRUE(fs::is_regular_file(fs::path(dir) / f)) << f;
  // Only the checkpoint is left in ROOT: no temporary directory or file.
  EXPECT_EQ(std::distance(fs::directory_iterator(root.path), fs::directory_iterator()), 1);
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 4);

  const nlohmann::json m = nlohmann::json::parse(std::ifstream(fs::path(dir) / "manifest.json"));
  EXPECT_EQ(m["format_version"], kCheckpointFormatVersion);
  EXPECT_EQ(m["step"], 100);
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"})
    EXPECT_EQ(m["files"][f]["bytes"].get<uint64_t>(), fs::file_size(fs::path(dir) / f)) << f;
  // The small file has one digest; the large ones one per 32 MiB piece (one piece here).
  EXPECT_EQ(m["files"]["trainer_state.json"]["sha256"], sha256_file((fs::path(dir) / "trainer_state.json").string()));
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_EQ(m["files"][f]["piece_bytes"].get<uint64_t>(), SafetensorsWriter::kPieceBytes) << f;
    EXPECT_EQ(m["files"][f]["piece_sha256"], std::vector<std::string>{sha256_file((fs::path(dir) / f).string())}) << f;
  }
  // model.safetensors is a plain F32 weights file with the config in its metadata.
  const SafetensorsReader model((fs::path(dir) / "model.safetensors").string());
  EXPECT_EQ(model.tensor("img_in.weight").dtype, "F32");
  EXPECT_EQ(model.metadata().at("flux8_config"), run.state.config_yaml);
  const SafetensorsReader opt((fs::path(dir) / "optimizer.safetensors").string());
  EXPECT_EQ(opt.names().size(), 2 * run.store.layout().params().size());
  EXPECT_EQ(opt.tensor("exp_avg_sq.final_layer.linear.weight").dtype, "F32");
  EXPECT_EQ(opt.tensor("exp_avg.img_in.weight").shape,
            (std::vector<int64_t>{run.cfg.hidden_size, run.cfg.in_channels}));
}

void round_trip(DType dtype) {
  TempRoot root;
  ModelRun a(dtype), b(dtype);
  a.randomize(2);
  const std::string dir = a.save(root.str(), 250);
  load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v);
  EXPECT_EQ(to_host(*a.be, a.store.flat_params()), to_host(*b.be, b.store.flat_params()));
  EXPECT_EQ(to_host(*a.be, a.m), to_host(*b.be, b.m));
  EXPECT_EQ(to_host(*a.be, a.v), to_host(*b.be, b.v));
  expect_same_state(a.state, b.state);
  // A moment value that would land in the wrong parameter would show here: m differs from v.
  EXPECT_NE(to_host(*b.be, b.m), to_host(*b.be, b.v));
}

TEST(Checkpoint, RoundTripBitExactF32) { round_trip(DType::f32); }
TEST(Checkpoint, RoundTripBitExactF64) { round_trip(DType::f64); }

// bf16 moments (adam_moment_precision: bf16) are saved as F32, widened exactly: they load back
// bit for bit into bf16 moments and as the same values into f32 ones (a run may switch the key
// on resume); f32 moments loaded into bf16 ones are rounded to nearest even.
TEST(Checkpoint, Bf16MomentsRoundTrip) {
  TempRoot root;
  ModelRun a(DType::f32, DType::bf16), b(DType::f32, DType::bf16), c(DType::f32);
  a.randomize(3);
  const std::string dir = a.save(root.str(), 300);
  const SafetensorsReader opt((fs::path(dir) / "optimizer.safetensors").string());
  EXPECT_EQ(opt.tensor("exp_avg.img_in.weight").dtype, "F32");
  load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v);
  load_checkpoint(dir, c.state, c.cfg, c.store, c.m, c.v);
  for (const auto& [saved, bf16, f32] : {std::tuple{a.m, b.m, c.m}, std::tuple{a.v, b.v, c.v}}) {
    const std::vector<double> want = to_host(*a.be, saved);
    EXPECT_EQ(to_host(*b.be, bf16), want);
    EXPECT_EQ(to_host(*c.be, f32), want);
  }
  EXPECT_NE(to_host(*b.be, b.m), to_host(*b.be, b.v));

  ModelRun d(DType::f32), e(DType::f32, DType::bf16);
  d.randomize(4);  // f32 moments with bits below bf16's precision
  const std::string dir2 = d.save(root.str(), 400);
  load_checkpoint(dir2, e.state, e.cfg, e.store, e.m, e.v);
  std::vector<double> rounded = to_host(*d.be, d.v);
  const std::vector<double> exact = rounded;
  for (double& x : rounded) x = round_to_bf16(static_cast<float>(x));
  EXPECT_EQ(to_host(*e.be, e.v), rounded);
  EXPECT_NE(rounded, exact);
}

TEST(Checkpoint, NonFiniteLossRoundTrips) {
  TrainerState s;
  s.last_loss = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(std::isnan(trainer_state_from_json(trainer_state_to_json(s), "x").last_loss));
  s.last_loss = -std::numeric_limits<double>::infinity();
  EXPECT_EQ(trainer_state_from_json(trainer_state_to_json(s), "x").last_loss, s.last_loss);
}

TEST(Checkpoint, TrainerStateReadStrictly) {
  TrainerState s;
  s.step = 10;
  nlohmann::json j = nlohmann::json::parse(trainer_state_to_json(s));
  j.erase("data_position");
  std::string e = error_of([&] { trainer_state_from_json(j.dump(), "ckpt/trainer_state.json"); });
  EXPECT_NE(e.find("ckpt/trainer_state.json"), std::string::npos) << e;
  EXPECT_NE(e.find("missing field 'data_position'"), std::string::npos) << e;
  j = nlohmann::json::parse(trainer_state_to_json(s));
  j["step"] = "100";
  e = error_of([&] { trainer_state_from_json(j.dump(), "f.json"); });
  EXPECT_NE(e.find("'step' must be an integer"), std::string::npos) << e;
  j = nlohmann::json::parse(trainer_state_to_json(s));
  j["learning_rate"] = 1;
  e = error_of([&] { trainer_state_from_json(j.dump(), "f.json"); });
  EXPECT_NE(e.find("unknown field 'learning_rate'"), std::string::npos) << e;
}

// Counts and positions out of range are refused with the file and the key named, before the
// loader takes the position as an unsigned number; so is JSON no writer of it produces.
TEST(Checkpoint, TrainerStateValuesOutOfRangeAreRefused) {
  TrainerState s;
  s.step = 10;
  const std::string where = "ckpt/step-0000010/trainer_state.json";
  const std::vector<std::tuple<const char*, nlohmann::json, const char*>> cases = {
      {"data_position", -1, "field 'data_position' must be an integer >= 0, got -1"},
      {"data_epoch", -7, "field 'data_epoch' must be an integer >= 0, got -7"},
      {"consumed_samples", -16, "field 'consumed_samples' must be an integer >= 0"},
      {"step", -3, "field 'step' must be an integer >= 0"},
      {"step", 1.5, "field 'step' must be an integer >= 0, got 1.5"},
      {"data_position", uint64_t{1} << 63, "field 'data_position' must be an integer >= 0, got 9223372036854775808"},
      {"skipped_steps", 11, "field 'skipped_steps' must be an integer from 0 to 10, got 11"},
      {"skipped_steps", -1, "field 'skipped_steps' must be an integer from 0 to 10"},
      {"seed", -5, "field 'seed' must be an integer >= 0"},
      {"last_loss", "big", "field 'last_loss' must be a number"},
      {"config_yaml", 3, "field 'config_yaml' must be a string"},
  };
  for (const auto& [key, value, want] : cases) {
    nlohmann::json j = nlohmann::json::parse(trainer_state_to_json(s));
    j[key] = value;
    const std::string e = error_of([&] { trainer_state_from_json(j.dump(), where); });
    EXPECT_NE(e.find(where + ": " + want), std::string::npos) << key << ": " << e;
  }
  for (const std::string& text : {std::string(100000, '[') + std::string(100000, ']'),
                                  std::string(R"({"step": 1e999})"), std::string("[1, 2]"), std::string("{\"step\"")}) {
    const std::string e = error_of([&] { trainer_state_from_json(text, where); });
    EXPECT_EQ(e.rfind(where + ": ", 0), 0u) << e;
  }
}

TEST(Checkpoint, AlteredByteIsRefused) {
  TempRoot root;
  ModelRun a, b;
  a.randomize(3);
  const std::string dir = a.save(root.str(), 100);
  // A byte in the middle of the tensor data: the file still parses, only the checksum tells.
  const fs::path model = fs::path(dir) / "model.safetensors";
  flip_byte(model, fs::file_size(model) - 100);
  const std::string e = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(e.find(dir), std::string::npos) << e;
  EXPECT_NE(e.find("model.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("altered or damaged on disk"), std::string::npos) << e;
  const std::vector<double> before = to_host(*b.be, b.store.flat_params());
  EXPECT_EQ(error_of([&] { load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v); }), e);
  EXPECT_EQ(to_host(*b.be, b.store.flat_params()), before);  // nothing was loaded
  EXPECT_EQ(b.state.step, 0);
  EXPECT_THROW(resolve_weights_path(dir), Error);
}

// A manifest's piece digests over pieces of any size (the writer's are 32 MiB: here 4 KiB, so
// a small model's files have many) verify side by side; a damaged piece is named by its bytes.
// Version 1 manifests (one SHA-256 per file) still verify.
void rewrite_manifest(const std::string& dir,
                      const std::function<void(nlohmann::json&, const std::string& file)>& edit) {
  const fs::path path = fs::path(dir) / "manifest.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(path));
  for (auto& [name, rec] : m["files"].items()) edit(rec, (fs::path(dir) / name).string());
  std::ofstream(path) << m.dump(2);
}

TEST(Checkpoint, PieceDigestsOfAnySizeAndVersion1ManifestsVerify) {
  TempRoot root;
  ModelRun a, b;
  a.randomize(6);
  const std::string dir = a.save(root.str(), 100);
  const uint64_t piece = 4096;
  rewrite_manifest(dir, [&](nlohmann::json& rec, const std::string& file) {
    if (!rec.contains("piece_sha256")) return;
    const uint64_t size = rec["bytes"];
    std::vector<std::string> d;
    for (uint64_t begin = 0; begin < size; begin += piece)
      d.push_back(sha256_file_range(file, begin, std::min(piece, size - begin)));
    rec["piece_bytes"] = piece;
    rec["piece_sha256"] = d;
  });
  verify_checkpoint(dir);
  load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v);
  EXPECT_EQ(to_host(*a.be, a.store.flat_params()), to_host(*b.be, b.store.flat_params()));

  const fs::path opt = fs::path(dir) / "optimizer.safetensors";
  ASSERT_GT(fs::file_size(opt), 5 * piece);
  flip_byte(opt, 3 * piece + 17);
  const std::string e = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(e.find(fmt::format("optimizer.safetensors bytes [{}, {}) have sha256", 3 * piece, 4 * piece)),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("altered or damaged on disk"), std::string::npos) << e;
  flip_byte(opt, 3 * piece + 17);  // undone

  // A piece list that does not cover the file is refused as a bad manifest.
  rewrite_manifest(dir, [&](nlohmann::json& rec, const std::string&) {
    if (rec.contains("piece_sha256")) rec["piece_sha256"].erase(0);
  });
  const std::string short_list = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(short_list.find("piece digests of 4096 bytes for"), std::string::npos) << short_list;

  // Version 1: one digest per file.
  rewrite_manifest(dir, [&](nlohmann::json& rec, const std::string& file) {
    rec.erase("piece_bytes");
    rec.erase("piece_sha256");
    rec["sha256"] = sha256_file(file);
  });
  {
    const fs::path path = fs::path(dir) / "manifest.json";
    nlohmann::json m = nlohmann::json::parse(std::ifstream(path));
    m["format_version"] = 1;
    std::ofstream(path) << m.dump(2);
  }
  verify_checkpoint(dir);
  flip_byte(opt, 3 * piece + 17);
  const std::string v1 = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(v1.find("optimizer.safetensors has sha256"), std::string::npos) << v1;
}

// A manifest that is not what flux8 writes is refused naming the checkpoint, manifest.json and
// the key, whatever the value: no library exception, no truncated number, no deep recursion.
TEST(Checkpoint, ManifestReadStrictly) {
  TempRoot root;
  ModelRun a;
  a.randomize(2);
  const std::string dir = a.save(root.str(), 100);
  const fs::path path = fs::path(dir) / "manifest.json";
  const std::string good = testing::read_bytes(path.string());
  auto refused = [&](const std::string& text, const std::string& want) {
    testing::write_bytes(path.string(), text);
    const std::string e = error_of([&] { verify_checkpoint(dir); });
    EXPECT_NE(e.find("checkpoint " + dir + ": manifest.json"), std::string::npos) << e;
    EXPECT_NE(e.find(want), std::string::npos) << "want '" << want << "' in: " << e;
    EXPECT_EQ(find_latest_checkpoint(root.str()), std::nullopt);
  };
  auto edited = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json m = nlohmann::json::parse(good);
    edit(m);
    return m.dump();
  };
  refused(edited([](auto& m) { m["step"] = -100; }), "field 'step' must be an integer >= 0, got -100");
  refused(edited([](auto& m) { m["format_version"] = uint64_t{1} << 40; }),
          "field 'format_version' must be an integer from 1 to 2147483647, got 1099511627776");
  refused(edited([](auto& m) { m["format_version"] = "2"; }), "field 'format_version' must be an integer");
  refused(edited([](auto& m) { m["files"] = nlohmann::json::array(); }), "field 'files' must be an object");
  refused(edited([](auto& m) { m["files"]["trainer_state.json"]["bytes"] = -1; }),
          "files.trainer_state.json: field 'bytes' must be an integer >= 0, got -1");
  refused(edited([](auto& m) { m["files"]["trainer_state.json"]["sha256"] = "abc"; }),
          "files.trainer_state.json: field 'sha256' must be a SHA-256 digest");
  refused(edited([](auto& m) { m["files"]["model.safetensors"]["piece_bytes"] = 0; }),
          "files.model.safetensors: field 'piece_bytes' must be an integer >= 1, got 0");
  refused(edited([](auto& m) { m["files"]["model.safetensors"]["piece_sha256"][0] = 7; }),
          "field 'piece_sha256' must list SHA-256 digests");
  refused(edited([](auto& m) { m["files"]["model.safetensors"]["bytes"] = UINT64_MAX; }), "piece digests");
  refused(edited([](auto& m) { m["files"]["../model.safetensors"] = m["files"]["model.safetensors"]; }),
          "invalid file name '../model.safetensors'");
  refused(std::string(50000, '[') + std::string(50000, ']'), "not valid JSON");
  refused(R"({"format_version": 2, "step": 1e400, "files": {}})", "not valid JSON");
  refused("", "not valid JSON");
  testing::write_bytes(path.string(), good);
  EXPECT_NO_THROW(verify_checkpoint(dir));
}

// CheckpointVerify::sizes (a resume, whose find_latest_checkpoint just hashed everything) reads
// no digest: an altered byte goes through, a missing or truncated file still does not.
TEST(Checkpoint, SizesOnlyLoadSkipsTheDigests) {
  TempRoot root;
  ModelRun a, b;
  a.randomize(7);
  const std::string dir = a.save(root.str(), 100);
  const fs::path model = fs::path(dir) / "model.safetensors";
  flip_byte(model, fs::file_size(model) - 100);
  EXPECT_THROW(load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v), Error);
  load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v, nullptr, nullptr, CheckpointVerify::sizes);
  EXPECT_EQ(b.state.step, 100);
  fs::resize_file(model, fs::file_size(model) - 1);
  const std::string e = error_of(
      [&] { load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v, nullptr, nullptr, CheckpointVerify::sizes); });
  EXPECT_NE(e.find("model.safetensors has"), std::string::npos) << e;
}

TEST(Checkpoint, TruncatedFileIsRefused) {
  TempRoot root;
  ModelRun a, b;
  a.randomize(4);
  const std::string dir = a.save(root.str(), 100);
  const fs::path opt = fs::path(dir) / "optimizer.safetensors";
  const uint64_t full = fs::file_size(opt);
  fs::resize_file(opt, full - 1000);
  const std::string e = error_of([&] { load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v); });
  EXPECT_NE(e.find(fmt::format("optimizer.safetensors has {} bytes, manifest says {}", full - 1000, full)),
            std::string::npos)
      << e;
  a.save(root.str(), 100);  // a fresh, complete checkpoint, then lose one file
  fs::remove(fs::path(dir) / "trainer_state.json");
  const std::string missing = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(missing.find("trainer_state.json is missing"), std::string::npos) << missing;
}

TEST(Checkpoint, FindLatestSkipsCorruptAndUnfinished) {
  TempRoot root;
  ModelRun run;
  run.randomize(5);
  EXPECT_FALSE(find_latest_checkpoint(root.str()).has_value());
  EXPECT_FALSE(find_latest_checkpoint((root.path / "absent").string()).has_value());
  const std::string s100 = run.save(root.str(), 100);
  const std::string s200 = run.save(root.str(), 200);
  const std::string s1000 = run.save(root.str(), 1000);  // numeric order, not by name length
  EXPECT_EQ(find_latest_checkpoint(root.str()), s1000);

  // The newest is damaged, the one before lost its manifest (never finished), and a killed
  // run left its half-written temporary directory, which would sort newest of all.
  fs::resize_file(fs::path(s1000) / "optimizer.safetensors", 1234);
  fs::remove(fs::path(s200) / "manifest.json");
  fs::create_directory(root.path / ".tmp-step-0002000-999999");
  std::ofstream(root.path / ".tmp-step-0002000-999999" / "model.safetensors") << "partial";
  std::string report;
  EXPECT_EQ(find_latest_checkpoint(root.str(), &report), s100);
  EXPECT_NE(report.find("step-0001000: optimizer.safetensors has 1234 bytes, manifest says"), std::string::npos)
      << report;
  EXPECT_NE(report.find("step-0000200: manifest.json is missing"), std::string::npos) << report;
  EXPECT_NE(report.find("using step-0000100"), std::string::npos) << report;
  EXPECT_EQ(report.find(".tmp"), std::string::npos) << report;

  // The next save removes the leftover temporary directory of the dead run.
  run.save(root.str(), 300);
  EXPECT_FALSE(fs::exists(root.path / ".tmp-step-0002000-999999"));
}

// --resume's choice: the newest checkpoint that verifies; none when ROOT has no checkpoint; and
// an error naming every checkpoint and its problem when there are some but none verifies.
TEST(Checkpoint, ResumeRefusesWhenNoCheckpointVerifies) {
  TempRoot root;
  ModelRun run;
  run.randomize(5);
  EXPECT_EQ(checkpoint_to_resume(root.str()), std::nullopt);
  EXPECT_EQ(checkpoint_to_resume((root.path / "absent").string()), std::nullopt);
  fs::create_directory(root.path / ".tmp-step-0000300-999999");  // not a checkpoint
  EXPECT_EQ(checkpoint_to_resume(root.str()), std::nullopt);
  const std::string s100 = run.save(root.str(), 100);
  const std::string s200 = run.save(root.str(), 200);
  flip_byte(fs::path(s200) / "model.safetensors", fs::file_size(fs::path(s200) / "model.safetensors") - 10);
  EXPECT_EQ(checkpoint_to_resume(root.str()), s100);
  fs::resize_file(fs::path(s100) / "optimizer.safetensors", 1000);
  const std::string e = error_of([&] { checkpoint_to_resume(root.str()); });
  expect_mentions(
      e, {"--resume: " + root.str() + " holds 2 checkpoints, and none verifies", s200 + ": model.safetensors bytes [",
          "altered or damaged on disk", s100 + ": optimizer.safetensors has 1000 bytes", "Nothing was changed"});
  EXPECT_TRUE(fs::exists(s100) && fs::exists(s200));
}

// --resume PATH: a chosen checkpoint is taken whatever its step, once every digest verifies; a
// checkpoint root gives its newest that verifies; anything else is refused by name.
TEST(Checkpoint, ResumeFromAChosenCheckpoint) {
  TempRoot root;
  ModelRun run;
  run.randomize(5);
  const std::string s100 = run.save(root.str(), 100);
  const std::string s200 = run.save(root.str(), 200);
  EXPECT_EQ(chosen_checkpoint(s100), s100);
  EXPECT_EQ(chosen_checkpoint(root.str()), s200);
  flip_byte(fs::path(s100) / "model.safetensors", 100);
  expect_mentions(error_of([&] { chosen_checkpoint(s100); }), {s100, "model.safetensors", "cannot be used"});
  expect_mentions(error_of([&] { chosen_checkpoint((root.path / "absent").string()); }),
                  {"--resume " + (root.path / "absent").string() + ": no such checkpoint directory"});
  fs::create_directory(root.path / "empty");
  expect_mentions(error_of([&] { chosen_checkpoint((root.path / "empty").string()); }),
                  {"holds neither a checkpoint (manifest.json) nor checkpoints (step-N)"});
}

// Pruning keeps the newest keep_last checkpoints that verify: a damaged one does not take a
// place, whether a resume found it (remembered) or pruning reads it for the first time (a copy
// this process never saw); it is left in place and named in a warning. Older ones go.
TEST(Checkpoint, PruningDoesNotCountDamagedCheckpoints) {
  TempRoot root;
  ModelRun run;
  run.randomize(6);
  const std::string a = (root.path / "a").string();
  const std::string s100 = run.save(a, 100), s200 = run.save(a, 200), s300 = run.save(a, 300);
  flip_byte(fs::path(s300) / "model.safetensors", 200);
  flip_byte(fs::path(s200) / "optimizer.safetensors", 300);
  ASSERT_EQ(find_latest_checkpoint(a), s100);  // as --resume finds them
  ::testing::internal::CaptureStderr();
  run.save(a, 150, 2);  // the resumed run's first save
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  auto names = [](const std::string& dir) { return listing(dir); };
  EXPECT_EQ(names(a), (std::vector<std::string>{"step-0000100", "step-0000150", "step-0000200", "step-0000300"}));
  expect_mentions(
      warnings, {"checkpoint " + s300 + " is damaged (model.safetensors bytes [",
                 "checkpoint " + s200 + " is damaged (optimizer.safetensors bytes [", "left in place for inspection"});
  run.save(a, 160, 2);  // warned once per checkpoint; step 100 is now older than the two kept
  EXPECT_EQ(names(a), (std::vector<std::string>{"step-0000150", "step-0000160", "step-0000200", "step-0000300"}));

  // Copies this process never verified: read (digests) when pruning first meets them.
  const std::string b = (root.path / "b").string();
  fs::create_directories(b);
  for (const char* step : {"step-0000150", "step-0000160"})
    fs::copy(fs::path(a) / step, fs::path(b) / step, fs::copy_options::recursive);
  const fs::path model = fs::path(b) / "step-0000160" / "model.safetensors";
  flip_byte(model, fs::file_size(model) / 2);
  ::testing::internal::CaptureStderr();
  run.save(b, 170, 2);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("step-0000160 is damaged"), std::string::npos);
  EXPECT_EQ(names(b), (std::vector<std::string>{"step-0000150", "step-0000160", "step-0000170"}));
}

TEST(Checkpoint, ResaveSameStepReplacesIt) {
  TempRoot root;
  ModelRun a, b;
  a.randomize(6);
  const std::string dir = a.save(root.str(), 100);
  a.randomize(7);
  a.state.consumed_samples = 4242;
  EXPECT_EQ(a.save(root.str(), 100), dir);
  EXPECT_EQ(std::distance(fs::directory_iterator(root.path), fs::directory_iterator()), 1);
  load_checkpoint(dir, b.state, b.cfg, b.store, b.m, b.v);
  EXPECT_EQ(b.state.consumed_samples, 4242);
  EXPECT_EQ(to_host(*a.be, a.store.flat_params()), to_host(*b.be, b.store.flat_params()));
}

TEST(Checkpoint, KeepLastPrunesOldest) {
  TempRoot root;
  ModelRun run;
  run.randomize(8);
  for (int64_t step : {100, 200, 300}) run.save(root.str(), step, 2);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step-0000200", "step-0000300"}));
  // The checkpoint just written is kept even when newer ones exist (a run resumed from an
  // older checkpoint); the newest other one fills the second slot.
  run.save(root.str(), 150, 2);
  names.clear();
  for (const auto& e : fs::directory_iterator(root.path)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step-0000150", "step-0000300"}));
  // keep_last <= 0 keeps everything.
  run.save(root.str(), 400, 0);
  run.save(root.str(), 500, -1);
  EXPECT_EQ(std::distance(fs::directory_iterator(root.path), fs::directory_iterator()), 4);
}

TEST(Checkpoint, ResolveWeightsPath) {
  TempRoot root;
  ModelRun a, b;
  a.randomize(9);
  const std::string dir = a.save(root.str(), 100);
  const std::string model = resolve_weights_path(dir);
  EXPECT_EQ(model, (fs::path(dir) / "model.safetensors").string());
  EXPECT_EQ(resolve_weights_path(model), model);
  load_weights(b.store, b.cfg, model);  // usable as a plain weights file
  EXPECT_EQ(to_host(*a.be, a.store.flat_params()), to_host(*b.be, b.store.flat_params()));
  std::string e = error_of([&] { resolve_weights_path(root.str()); });
  EXPECT_NE(e.find("checkpoint root"), std::string::npos) << e;
  EXPECT_NE(e.find("step-0000100"), std::string::npos) << e;
  e = error_of([&] { resolve_weights_path((root.path / "nope").string()); });
  EXPECT_NE(e.find("no such file or directory"), std::string::npos) << e;
}

// --init-from step-N/model.safetensors (or a link to it) is checked against the checkpoint's
// manifest as --init-from step-N is; a copy of the file outside any checkpoint loads as it is.
TEST(Checkpoint, WeightsFileInsideACheckpointIsVerified) {
  TempRoot root;
  ModelRun a;
  a.randomize(10);
  const std::string dir = a.save((root.path / "run").string(), 100);
  const std::string model = (fs::path(dir) / "model.safetensors").string();
  const std::string copy = (root.path / "weights.safetensors").string();
  fs::copy_file(model, copy);
  const std::string link = (root.path / "link.safetensors").string();
  fs::create_symlink(model, link);
  flip_byte(model, fs::file_size(model) - 50);
  for (const std::string& given : {dir, model, link}) {
    const std::string e = error_of([&] { resolve_weights_path(given); });
    expect_mentions(e, {"checkpoint " + dir, "model.safetensors bytes [", "altered or damaged on disk"});
  }
  EXPECT_EQ(resolve_weights_path(copy), copy);
  fs::resize_file(model, 100);
  expect_mentions(error_of([&] { resolve_weights_path(model); }), {"model.safetensors has 100 bytes"});
  testing::write_bytes((fs::path(dir) / "manifest.json").string(), "{");
  expect_mentions(error_of([&] { resolve_weights_path(model); }), {"checkpoint " + dir + ": manifest.json"});
}

// A save that fails part way (here: a file size limit, as a full disk would) removes its
// temporary directory, the files it finished included, before it reports the error; the
// checkpoint before it stays the newest. The same in line and behind training.
TEST(Checkpoint, FailedSaveLeavesNothingBehind) {
  TempRoot root;
  ModelRun run;
  run.randomize(11);
  const std::string first = run.save(root.str(), 100);
  const uint64_t optimizer_bytes = fs::file_size(fs::path(first) / "optimizer.safetensors");
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto limited = [&](const std::function<void()>& save) {
    const auto previous = ::signal(SIGXFSZ, SIG_IGN);  // writes past the limit fail with EFBIG
    struct rlimit lim = saved;
    lim.rlim_cur = optimizer_bytes / 2;  // the model file fits, the optimizer's does not
    EXPECT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
    const std::string e = error_of(save);
    ::setrlimit(RLIMIT_FSIZE, &saved);
    ::signal(SIGXFSZ, previous);
    return e;
  };
  const std::string in_line = limited([&] { run.save(root.str(), 200); });
  expect_mentions(in_line, {"saving checkpoint " + (root.path / "step-0000200").string() + " failed",
                            "optimizer.safetensors", std::strerror(EFBIG), "the checkpoints before it are intact"});
  const std::string behind = limited([&] {
    AsyncCheckpointer saver(root.str(), 0);
    run.state.step = 300;
    saver.start(run.state, run.store, run.m, run.v, nullptr);
    saver.wait();
  });
  expect_mentions(behind, {"checkpoint of step 300", std::strerror(EFBIG)});
  EXPECT_EQ(listing(root.path), std::vector<std::string>{"step-0000100"});
  EXPECT_EQ(find_latest_checkpoint(root.str()), first);
}

TEST(Checkpoint, WrongMomentBufferIsRefused) {
  TempRoot root;
  ModelRun run;
  const Tensor short_m(run.m.data, run.m.dtype, Shape{run.m.numel() - 1});
  const std::string e =
      error_of([&] { save_checkpoint(root.str(), run.state, run.cfg, run.store, short_m, run.v, 0); });
  EXPECT_NE(e.find("adam_m"), std::string::npos) << e;
}

// ---- checkpoints written from a host snapshot, behind training (async_save) -----------------

// Every file of two checkpoint directories, byte for byte (the manifests included: the same
// piece digests).
void expect_same_files(const std::string& a, const std::string& b) {
  size_t files = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(a)) {
    const fs::path other = fs::path(b) / e.path().filename();
    ASSERT_TRUE(fs::is_regular_file(other)) << other;
    EXPECT_TRUE(testing::read_bytes(e.path().string()) == testing::read_bytes(other.string())) << e.path().filename();
    ++files;
  }
  EXPECT_EQ(files, static_cast<size_t>(std::distance(fs::directory_iterator(b), fs::directory_iterator())));
}

Fp8MetaRegistry test_fp8_registry() {
  Fp8MetaRegistry reg(3);
  for (const char* name : {"img_in", "double_blocks.0.img_attn.qkv"}) reg.add(name, Fp8Role::input);
  for (int s = 0; s < reg.size(); ++s) {
    reg.scale_data()[s] = 0.5f + static_cast<float>(s);
    reg.amax_history_data()[reg.size() + s] = 3.25f + static_cast<float>(s);  // row 1 of [history, slots]
  }
  return reg;
}

TEST(CheckpointSnapshot, WritesTheSameFilesAsASaveInLine) {
  for (const auto& [dtype, moments] :
       {std::pair{DType::f32, DType::f32}, std::pair{DType::f32, DType::bf16}, std::pair{DType::f64, DType::f64}}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)) + " parameters, " + std::string(dtype_name(moments)) + " moments");
    TempRoot root;
    ModelRun run(dtype, moments);
    run.randomize(5);
    const Fp8MetaRegistry reg = test_fp8_registry();
    const std::string in_line =
        save_checkpoint((root.path / "in_line").string(), run.state, run.cfg, run.store, run.m, run.v, 0, &reg);
    CheckpointSnapshot snapshot;
    EXPECT_EQ(CheckpointSnapshot::bytes_for(run.store, run.m, run.v),
              static_cast<uint64_t>(run.store.layout().total()) * (dtype_size(dtype) + 2 * dtype_size(moments)));
    snapshot.take(run.state, run.store, run.m, run.v, &reg);
    EXPECT_EQ(snapshot.bytes(), CheckpointSnapshot::bytes_for(run.store, run.m, run.v));
    const std::string behind = snapshot.write((root.path / "behind").string(), 0);
    EXPECT_EQ(fs::path(behind).filename(), "step-0000100");
    EXPECT_TRUE(fs::is_regular_file(fs::path(behind) / "fp8_state.safetensors"));
    expect_same_files(in_line, behind);
  }
}

TEST(AsyncCheckpoint, WritesTheStateAsOfItsStart) {
  TempRoot root;
  ModelRun a, loaded;
  a.randomize(6);
  const std::vector<double> params = to_host(*a.be, a.store.flat_params()), m = to_host(*a.be, a.m);
  AsyncCheckpointer saver(root.str(), 2);
  EXPECT_FALSE(saver.busy());
  saver.prepare(a.store, a.m, a.v);  // the snapshot's memory mapped on a thread of its own
  a.state.step = 10;
  const AsyncCheckpointer::Started s = saver.start(a.state, a.store, a.m, a.v, nullptr);
  EXPECT_EQ(s.dir, (root.path / "step-0000010").string());
  EXPECT_EQ(s.snapshot_bytes, CheckpointSnapshot::bytes_for(a.store, a.m, a.v));
  EXPECT_FALSE(s.previous);
  // Training goes on: the next step changes everything while the file may still be written.
  a.randomize(7);
  a.state.step = 20;
  const AsyncCheckpointer::Started s2 = saver.start(a.state, a.store, a.m, a.v, nullptr);
  ASSERT_TRUE(s2.previous);  // waited for step 10's save
  EXPECT_EQ(s2.previous->step, 10);
  EXPECT_EQ(s2.previous->dir, s.dir);
  EXPECT_GT(s2.previous->bytes, 0u);
  const std::optional<AsyncCheckpointer::Finished> f = saver.wait();
  ASSERT_TRUE(f);
  EXPECT_EQ(f->step, 20);
  EXPECT_FALSE(saver.wait());  // nothing in flight
  EXPECT_FALSE(saver.poll());

  load_checkpoint(s.dir, loaded.state, loaded.cfg, loaded.store, loaded.m, loaded.v);
  EXPECT_EQ(loaded.state.step, 10);
  EXPECT_EQ(to_host(*loaded.be, loaded.store.flat_params()), params);
  EXPECT_EQ(to_host(*loaded.be, loaded.m), m);
  load_checkpoint(f->dir, loaded.state, loaded.cfg, loaded.store, loaded.m, loaded.v);
  EXPECT_EQ(to_host(*loaded.be, loaded.store.flat_params()), to_host(*a.be, a.store.flat_params()));
  // Both kept (keep_last 2), and nothing else: no temporary directory.
  EXPECT_EQ(std::distance(fs::directory_iterator(root.path), fs::directory_iterator()), 2);
}

TEST(AsyncCheckpoint, PollReportsTheSaveOnceItIsDone) {
  TempRoot root;
  ModelRun a;
  a.randomize(8);
  AsyncCheckpointer saver(root.str(), 0);
  a.state.step = 3;
  saver.start(a.state, a.store, a.m, a.v, nullptr);
  std::optional<AsyncCheckpointer::Finished> f;
  for (int i = 0; i < 6000 && !f; ++i) {  // up to a minute
    f = saver.poll();
    if (!f) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(f);
  EXPECT_EQ(f->step, 3);
  EXPECT_FALSE(saver.busy());
  EXPECT_NO_THROW(verify_checkpoint(f->dir));
}

TEST(AsyncCheckpoint, AFailedSaveIsReportedWithItsStep) {
  TempRoot root;
  ModelRun a;
  a.randomize(9);
  const fs::path file = root.path / "not_a_directory";
  std::ofstream(file) << "x";
  a.state.step = 42;
  {
    AsyncCheckpointer saver((file / "ckpt").string(), 0);
    saver.start(a.state, a.store, a.m, a.v, nullptr);
    const std::string e = error_of([&] { saver.wait(); });
    EXPECT_NE(e.find("checkpoint of step 42"), std::string::npos) << e;
    EXPECT_NE(e.find("not_a_directory"), std::string::npos) << e;
    EXPECT_FALSE(saver.busy());
  }
  {  // never collected: the destructor waits for it and only warns
    AsyncCheckpointer saver((file / "ckpt").string(), 0);
    saver.start(a.state, a.store, a.m, a.v, nullptr);
  }
}

TEST(AsyncCheckpoint, TheSnapshotMustFitInHalfTheAvailableMemory) {
  EXPECT_TRUE(AsyncCheckpointer::fits(10, uint64_t{20}));
  EXPECT_FALSE(AsyncCheckpointer::fits(11, uint64_t{20}));
  EXPECT_TRUE(AsyncCheckpointer::fits(uint64_t{1} << 40, std::nullopt));  // unknown: assumed to fit
  const std::optional<uint64_t> available = host_memory_available();
  ASSERT_TRUE(available);  // Linux: /proc/meminfo
  EXPECT_GT(*available, uint64_t{1} << 20);
}

// ---- signals -------------------------------------------------------------------------------

TEST(Signals, FirstSignalSetsFlag) {
  install_stop_signals();
  EXPECT_FALSE(stop_requested());
  EXPECT_STREQ(stop_signal_name(), "");
  ASSERT_EQ(::raise(SIGTERM), 0);  // delivered to this thread before raise returns
  EXPECT_TRUE(stop_requested());
  EXPECT_STREQ(stop_signal_name(), "SIGTERM");
  clear_stop_request();
  ASSERT_EQ(::raise(SIGINT), 0);
  EXPECT_STREQ(stop_signal_name(), "SIGINT");
  restore_stop_signals();
  clear_stop_request();
  struct sigaction now;
  ::sigaction(SIGTERM, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
}

TEST(Signals, SecondSignalKills) {
  // The second signal takes the default action: the process dies by that signal. "threadsafe"
  // re-executes the binary for the child, as the OpenMP pool makes this process multi-threaded.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        install_stop_signals();
        ::raise(SIGTERM);
        if (!stop_requested()) std::_Exit(3);
        ::raise(SIGTERM);
        std::_Exit(0);  // not reached
      },
      ::testing::KilledBySignal(SIGTERM), "second stop signal");
}

}  // namespace
}  // namespace flux8
