// Corrupt shards, one class of fault at a time, from crafted bytes: tar sizes and pax records
// near 2^64, sample json with out-of-range numbers, deep nesting and wrong types, and .npy
// headers that are empty, huge or inconsistent. Each ends at once with a flux8::Error naming
// shard and member (or, for a member the archive can step over, with that member alone
// refused), and data_skip_corrupt skips what it names.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/loader.h"
#include "data/tar.h"
#include "data/webdataset.h"
#include "data_test_util.h"
#include "io/safetensors.h"
#include "test_util.h"

using namespace flux8;
using namespace flux8::testing::data;
using flux8::testing::error_of;
using flux8::testing::expect_mentions;
using flux8::testing::TempDir;
using flux8::testing::write_bytes;

namespace {

// A fault must be found in well under this, whatever the sizes in the bytes say (a size that
// wraps the block rounding once made the reader spin forever).
constexpr std::chrono::seconds kPromptly{5};

template <typename F>
void promptly(F body) {
  const auto t0 = std::chrono::steady_clock::now();
  body();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kPromptly);
}

// A regular member's header whose size field is GNU base-256 (0x80, then big-endian bytes).
std::string base256_header(const std::string& name, uint64_t size) {
  std::string h = raw_header(name, 0, '0');
  std::memset(h.data() + 124, 0, 12);
  h[124] = static_cast<char>(0x80);
  for (int i = 0; i < 8; ++i) h[135 - i] = static_cast<char>(size >> (8 * i));
  return rechecksummed(h);
}

std::string member(const std::string& name, const std::string& data) {
  return raw_header(name, data.size(), '0') + padded(data);
}

std::string end_marker() { return std::string(1024, '\0'); }

// The samples of an in-memory shard, decoded: their keys, then the first error's text if any.
struct ShardRead {
  std::vector<std::string> keys;
  std::string error;
};
ShardRead read_shard(const std::string& name, const std::string& bytes) {
  ShardRead out;
  WebDatasetReader r(name, bytes);
  try {
    Sample s;
    while (r.next(s)) out.keys.push_back(s.key);
  } catch (const Error& e) {
    out.error = e.what();
  }
  return out;
}

// The error of decoding a sample of one json member (plus a t5 member) in shard "s.tar".
std::string json_error(const std::string& json) {
  std::string bytes = member("k.json", json) + member("k.t5.bytes", std::string(8, '\0')) + end_marker();
  return read_shard("s.tar", bytes).error;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tar framing

TEST(TarCorruptTest, Base256SizesNearTwoTo64EndTheShardAtOnce) {
  for (const uint64_t size : {~uint64_t(0), ~uint64_t(0) - 511, uint64_t(1) << 63}) {
    SCOPED_TRACE(size);
    const std::string bytes =
        member("000000.txt", "first") + base256_header("000001.t5.npy", size) + padded("x") + end_marker();
    promptly([&] {
      TarReader r("mem.tar", bytes);
      TarMember m;
      ASSERT_TRUE(r.next(m));
      const std::string err = error_of([&] { r.next(m); });
      expect_mentions(err, {"shard mem.tar, member 000001.t5.npy", "data bytes", "corrupt shard"});
    });
  }
}

TEST(TarCorruptTest, PaxRecordLengthsNearTwoTo64RefuseOnlyTheirMember) {
  for (const std::string& record :
       {std::string("18446744073709551615 path=x\n"), std::string("99999999999999999999999999 path=x\n"),
        std::string("3 path=x\n"), std::string("40 path=x\n")}) {
    SCOPED_TRACE(record);
    const std::string bytes = raw_header("PaxHeaders/k", record.size(), 'x') + padded(record) +
                              member("k.t5.npy", npy_f32({1}, {1})) + member("k2.t5.npy", npy_f32({1}, {2})) +
                              end_marker();
    promptly([&] {
      TarReader r("pax.tar", bytes);
      TarMember m;
      ASSERT_TRUE(r.next(m));
      EXPECT_EQ(m.name, "k.t5.npy");
      EXPECT_NE(m.fault.find("malformed pax record"), std::string::npos) << m.fault;
      const std::string err = error_of([&] { r.read_data(); });
      expect_mentions(err, {"shard pax.tar, member k.t5.npy", "malformed pax record"});
      ASSERT_TRUE(r.next(m));  // the framing is intact: the next member reads
      EXPECT_EQ(m.name, "k2.t5.npy");
      EXPECT_EQ(r.read_data().size(), npy_f32({1}, {2}).size());
      EXPECT_FALSE(r.next(m));

      const ShardRead read = read_shard("pax.tar", bytes);
      EXPECT_TRUE(read.keys.empty());
      expect_mentions(read.error, {"shard pax.tar, member k.t5.npy", "malformed pax record"});
    });
  }
}

TEST(TarCorruptTest, PaxSizesNearTwoTo64) {
  // A size that fits 64 bits but not the shard: the framing is lost.
  const std::string huge = pax_record("size", "18446744073709551615") + pax_record("path", "k.t5.npy");
  std::string bytes = raw_header("PaxHeaders/k", huge.size(), 'x') + padded(huge) + member("short", "x") + end_marker();
  promptly([&] {
    TarReader r("size.tar", bytes);
    TarMember m;
    expect_mentions(error_of([&] { r.next(m); }), {"shard size.tar, member k.t5.npy", "18446744073709551615"});
  });
  // More digits than 64 bits hold: a malformed record, the member refused alone.
  const std::string digits = pax_record("size", "184467440737095516150");
  bytes = raw_header("PaxHeaders/k", digits.size(), 'x') + padded(digits) + member("k.t5.npy", "x") + end_marker();
  promptly([&] {
    TarReader r("size.tar", bytes);
    TarMember m;
    ASSERT_TRUE(r.next(m));
    expect_mentions(error_of([&] { r.read_data(); }), {"shard size.tar, member k.t5.npy", "not a number"});
    EXPECT_FALSE(r.next(m));
  });
}

TEST(TarCorruptTest, OversizedExtendedHeaderIsNotRead) {
  const std::string big(size_t(1) << 21, 'a');  // 2 MiB of "long name"
  const std::string bytes =
      raw_header("././@LongLink", big.size(), 'L') + padded(big) + member("k.txt", "x") + end_marker();
  TarReader r("long.tar", bytes);
  TarMember m;
  ASSERT_TRUE(r.next(m));
  expect_mentions(error_of([&] { r.read_data(); }), {"shard long.tar, member k.txt", "long-name header"});
  EXPECT_FALSE(r.next(m));
}

TEST(TarCorruptTest, ShardThatIsNotARegularFileIsRefused) {
  TempDir tmp;
  std::filesystem::create_directories(tmp.path("dir.tar"));
  expect_mentions(error_of([&] { TarReader r(tmp.path("dir.tar")); }),
                  {"shard " + tmp.path("dir.tar"), "not a regular file"});
  ASSERT_EQ(::mkfifo(tmp.path("fifo.tar").c_str(), 0600), 0);
  expect_mentions(error_of([&] { TarReader r(tmp.path("fifo.tar")); }), {"not a regular file"});
}

TEST(TarCorruptTest, InMemoryReaderReadsWhatTheFileReaderReads) {
  TempDir tmp;
  {
    TarWriter w(tmp.path("a.tar"));
    w.add("000000.t5.npy", npy_f32({2}, {1, 2}));
    w.add(std::string(150, 'n') + ".txt", "long");
    w.add("000001.t5.npy", npy_f32({1}, {3}));
    w.finish();
  }
  const std::string bytes = flux8::testing::read_bytes(tmp.path("a.tar"));
  TarReader file(tmp.path("a.tar")), mem("a.tar", bytes);
  TarMember a, b;
  int n = 0;
  while (file.next(a)) {
    ASSERT_TRUE(mem.next(b));
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.data_offset, b.data_offset);
    if (++n % 2) EXPECT_EQ(file.read_data(), mem.read_data());
  }
  EXPECT_FALSE(mem.next(b));
  EXPECT_EQ(n, 3);
}

// ---------------------------------------------------------------------------------------------
// Sample json

TEST(WebDatasetCorruptTest, JsonNumbersOutOfRange) {
  promptly([] {
    expect_mentions(json_error(R"({"timestep": 1e400})"), {"shard s.tar, member k.json", "invalid JSON"});
    expect_mentions(json_error(R"({"timestep": 1e300})"), {"shard s.tar, member k.json", "timestep", "float"});
    expect_mentions(json_error(R"({"shapes": {"t5": [-1e999]}, "dtypes": {"t5": "f32"}})"),
                    {"shard s.tar, member k.json"});
    expect_mentions(json_error(R"({"shapes": {"t5": [18446744073709551615, 2]}, "dtypes": {"t5": "f32"}})"),
                    {"shard s.tar, member k.t5.bytes", "not a size"});
    expect_mentions(json_error(R"({"shapes": {"t5": [4294967296, 4294967296]}, "dtypes": {"t5": "f32"}})"),
                    {"shard s.tar, member k.t5.bytes", "impossibly large"});
  });
}

TEST(WebDatasetCorruptTest, DeeplyNestedJsonIsRefusedBeforeItIsWalked) {
  promptly([] {
    const std::string deep = R"({"shapes": )" + std::string(200000, '[') + std::string(200000, ']') + "}";
    expect_mentions(json_error(deep), {"shard s.tar, member k.json", "nested"});
  });
}

TEST(WebDatasetCorruptTest, JsonOfTheWrongTypes) {
  const std::string f32 = R"("dtypes": {"t5": "f32"})";
  for (const auto& [json, what] : std::vector<std::pair<std::string, std::string>>{
           {R"({"shapes": 5})", "'shapes'"},
           {R"({"shapes": {"t5": [2]}, "dtypes": ["f32"]})", "'dtypes'"},
           {R"({"shapes": {"t5": [2]}, "dtypes": {"t5": 3}})", "'dtypes.t5'"},
           {R"({"shapes": {"t5": [2]}, "dtype": null})", "'dtype'"},
           {R"({"t5": {"shape": [2], "dtype": {}}})", "'t5.dtype'"},
           {R"({"shapes": {"t5": "2"}, )" + f32 + "}", "not a list of sizes"},
           {R"({"shapes": {"t5": [2.5]}, )" + f32 + "}", "not a size"},
           {R"({"shapes": {"t5": [-2]}, )" + f32 + "}", "not a size"},
           {R"({"shapes": {"t5": [)" + std::string(100, '1') + "]}, " + f32 + "}", "not a size"},
           {R"({"shapes": {"t5": [2]}, )" + f32 + R"(, "timestep": "soon"})", "timestep"},
           {"[1, 2]", "an object"},
           {"\"\\ud800\"", "k.json"}}) {
    SCOPED_TRACE(json);
    const std::string err = json_error(json);
    expect_mentions(err, {"shard s.tar, member k", what});
    EXPECT_LT(err.size(), 600u) << err;
  }
}

// ---------------------------------------------------------------------------------------------
// .npy

namespace {
HostTensor npy_of(const std::string& bytes) {
  return decode_npy(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "shard s.tar, member k.t5.npy");
}
// A .npy image with `header` as it is (no padding, no checks), version 1 or 2.
std::string npy_raw(const std::string& header, int version = 1) {
  std::string out = "\x93NUMPY";
  out += static_cast<char>(version);
  out += '\0';
  const uint32_t n = static_cast<uint32_t>(header.size());
  out.append(reinterpret_cast<const char*>(&n), version == 1 ? 2 : 4);
  return out + header;
}
}  // namespace

TEST(NpyCorruptTest, ZeroSizeArraysDecodeWithoutCopying) {
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{0}, {0, 5}, {3, 0}}) {
    const HostTensor t = npy_of(npy("<f4", shape, ""));
    EXPECT_EQ(t.shape, shape);
    EXPECT_TRUE(t.data.empty());
  }
  EXPECT_TRUE(npy_of(npy("<u2", {0}, "")).data.empty());
  // An empty array still may not carry dimensions whose products overflow later.
  expect_mentions(error_of([] {
                    npy_of(npy("<f4", {0, int64_t(1) << 40, int64_t(1) << 40}, ""));
                  }),
                  {"member k.t5.npy", "impossibly large"});
}

TEST(NpyCorruptTest, HugeHeadersAreRefusedWithoutEchoingThem) {
  // v2: a header length of 3 MB, present in full.
  const std::string big = npy_raw("{'descr': '<f4', 'shape': (1,), " + std::string(3 << 20, 'x'), 2);
  std::string err = error_of([&] { npy_of(big); });
  expect_mentions(err, {"member k.t5.npy", "header"});
  EXPECT_LT(err.size(), 400u);
  // v1: under the limit, but malformed all along.
  const std::string junk = npy_raw("{" + std::string(60000, 'z'));
  err = error_of([&] { npy_of(junk); });
  expect_mentions(err, {"member k.t5.npy", "descr"});
  EXPECT_LT(err.size(), 400u);
  // A header length past the member's end.
  std::string cut = npy_raw("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }");
  cut.resize(cut.size() - 5);
  expect_mentions(error_of([&] { npy_of(cut); }), {"member k.t5.npy", "truncated"});
}

TEST(NpyCorruptTest, ShapeTimesItemsizeCannotWrap) {
  for (const std::string& shape : {std::string("(16777216, 16777216, 16777216)"), std::string("(4611686018427387904,)"),
                                   std::string("(" + std::string(40, '9') + ",)")}) {
    SCOPED_TRACE(shape);
    const std::string bytes = npy_raw("{'descr': '<f8', 'fortran_order': False, 'shape': " + shape + ", }\n") + "abcd";
    expect_mentions(error_of([&] { npy_of(bytes); }), {"member k.t5.npy", "impossibly large"});
  }
}

TEST(NpyCorruptTest, DtypeOrderAndShapeAreValidated) {
  const auto header = [](const std::string& descr, const std::string& order, const std::string& shape) {
    return npy_raw("{'descr': " + descr + ", 'fortran_order': " + order + ", 'shape': " + shape + ", }\n");
  };
  std::string dims = "(";
  for (int i = 0; i < 65; ++i) dims += "1,";
  dims += ")";
  for (const auto& [bytes, what] : std::vector<std::pair<std::string, std::string>>{
           {header("'<f4'", "Maybe", "(1,)"), "fortran_order"},
           {header("'<c8'", "False", "(1,)"), "not supported"},
           {npy_raw("{'descr': '<f4"), "malformed"},
           {header("''", "False", "(1,)"), "not supported"},
           {header("'<f4'", "False", "(1, -2)"), "not a size"},
           {header("'<f4'", "False", "(1, 2"), "not closed"},
           {header("'<f4'", "False", dims), "dimensions"},
           {npy_raw("'descr': '<f4', 'fortran_order': False, 'shape': (1,)"), "not a dict"},
           {std::string("\x93NUMPY\x09\x00", 8) + std::string(8, ' '), "version"}}) {
    SCOPED_TRACE(what);
    const std::string err = error_of([&] { npy_of(bytes); });
    expect_mentions(err, {"shard s.tar, member k.t5.npy", what});
  }
}

// ---------------------------------------------------------------------------------------------
// Anything at all

// Random damage to a shard that holds every kind of member: reading and decoding it either
// succeeds or fails with a flux8::Error naming the shard, never with another exception, a
// crash or a hang (the fuzz targets do this at scale; this keeps it in every test run).
TEST(WebDatasetCorruptTest, RandomDamageEndsInDataOrANamedError) {
  std::string st;
  {
    TempDir tmp;
    const std::vector<float> latent = {1, 2};
    SafetensorsWriter w;
    w.add("latent", DType::f32, {1, 2}, latent.data());
    w.write(tmp.path("t.safetensors"));
    st = flux8::testing::read_bytes(tmp.path("t.safetensors"));
  }
  const std::string pax = pax_record("path", "000001.t5.npy");
  const std::string shard =
      member("000000.json", R"({"shapes": {"clip": [2]}, "dtypes": {"clip": "f32"}, "timestep": 3})") +
      member("000000.clip.bytes", std::string(8, '\0')) + member("000000.t5.npy", npy_f32({2, 1}, {1, 2})) +
      member("000000.txt", "a caption") + raw_header("PaxHeaders/1", pax.size(), 'x') + padded(pax) +
      member("x", npy("<u2", {2}, std::string(4, '\1'))) + member("000001.latents.safetensors", st) +
      base256_header("000002.mean.npy", npy("<f2", {1}, "ab").size()) + padded(npy("<f2", {1}, "ab")) + end_marker();
  ASSERT_TRUE(read_shard("mutated.tar", shard).error.empty()) << read_shard("mutated.tar", shard).error;
  std::mt19937_64 rng(40);
  int errors = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 3000; ++i) {
    std::string bytes = shard;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % bytes.size();
      switch (rng() % 4) {
        case 0: bytes[at] = static_cast<char>(rng()); break;
        case 1: bytes[at] = static_cast<char>(0xff); break;
        case 2: bytes[at] = '9'; break;
        default: bytes.resize(at); break;
      }
      if (bytes.empty()) break;
    }
    try {
      const ShardRead read = read_shard("mutated.tar", bytes);
      if (!read.error.empty()) {
        ++errors;
        EXPECT_NE(read.error.find("shard mutated.tar"), std::string::npos) << read.error;
        EXPECT_LT(read.error.size(), 2000u) << read.error.substr(0, 2000);
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << "mutation " << i << ": not a flux8::Error: " << e.what();
    }
  }
  EXPECT_GT(errors, 100);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
}

// ---------------------------------------------------------------------------------------------
// data_skip_corrupt

namespace {
// Shard "train-000000.tar" of samples 0..5 (t5 = [g]) where sample 2's json holds an
// out-of-range number and sample 4's member has a malformed pax header.
std::string write_damaged_shard(const TempDir& tmp) {
  std::string bytes;
  for (int g = 0; g < 6; ++g) {
    const std::string key = fmt::format("{:06d}", g);
    if (g == 2) bytes += member(key + ".json", R"({"timestep": 1e999})");
    if (g == 4) bytes += raw_header("PaxHeaders/4", 9, 'x') + padded("8 path=x\n");  // its length is 9
    bytes += member(key + ".t5.npy", npy_f32({1}, {float(g)}));
  }
  const std::string path = tmp.path("train-000000.tar");
  write_bytes(path, bytes + end_marker());
  return path;
}
std::vector<int> drain(DataLoader& l) {
  std::vector<int> got;
  Sample s;
  while (l.next(s)) got.push_back(static_cast<int>(s.at("t5").data[0]));
  return got;
}
}  // namespace

TEST(DataLoaderCorruptTest, SkipCorruptSkipsEachBadSampleAloneAndNamesIt) {
  TempDir tmp;
  const std::string path = write_damaged_shard(tmp);
  LoaderOptions o;
  o.source = tmp.path("train-*.tar");
  o.single_pass = true;
  o.shuffle_buffer = 0;
  o.skip_corrupt = true;
  ::testing::internal::CaptureStderr();
  DataLoader l(o);
  EXPECT_EQ(drain(l), (std::vector<int>{0, 1, 3, 5}));
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(l.corrupt_skipped(), 2u);
  expect_mentions(warnings, {"shard " + path + ", member 000002.json", "sample '000002'",
                             "shard " + path + ", member 000004.t5.npy", "sample '000004'", "data_skip_corrupt"});

  // Without it the stream stops at the first, naming it, after the samples before it.
  o.skip_corrupt = false;
  DataLoader strict(o);
  Sample s;
  ASSERT_TRUE(strict.next(s));
  ASSERT_TRUE(strict.next(s));
  expect_mentions(error_of([&] { strict.next(s); }), {"shard " + path + ", member 000002.json"});
}

TEST(DataLoaderCorruptTest, BrokenFramingSkipsTheRestOfTheShardWithoutSpinning) {
  TempDir tmp;
  std::string bytes;
  for (int g = 0; g < 3; ++g) bytes += member(fmt::format("{:06d}.t5.npy", g), npy_f32({1}, {float(g)}));
  bytes += base256_header("000003.t5.npy", ~uint64_t(0)) + padded("x");
  write_bytes(tmp.path("train-000000.tar"), bytes + end_marker());
  {
    TarWriter w(tmp.path("train-000001.tar"));
    for (int g = 10; g < 12; ++g) w.add(fmt::format("{:06d}.t5.npy", g), npy_f32({1}, {float(g)}));
    w.finish();
  }
  LoaderOptions o;
  o.source = tmp.path("train-*.tar");
  o.single_pass = true;
  o.skip_corrupt = true;
  promptly([&] {
    ::testing::internal::CaptureStderr();
    DataLoader l(o);
    // Sample 2 goes with the fault: the header after its member might have been one of its own.
    EXPECT_EQ(drain(l), (std::vector<int>{0, 1, 10, 11}));
    const std::string warnings = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(l.corrupt_skipped(), 1u);
    expect_mentions(warnings, {"member 000003.t5.npy", "the rest of shard " + tmp.path("train-000000.tar")});
  });
  // A training loader (epochs forever) goes on past it too.
  o.single_pass = false;
  promptly([&] {
    ::testing::internal::CaptureStderr();
    DataLoader l(o);
    for (int i = 0; i < 20; ++i) l.next();
    ::testing::internal::GetCapturedStderr();
    EXPECT_GE(l.corrupt_skipped(), 4u);
  });
}

TEST(DataLoaderCorruptTest, ASampleTheCheckRefusesIsSkippedOrStopsTheStream) {
  TempDir tmp;
  {
    TarWriter w(tmp.path("train-000000.tar"));
    for (int g = 0; g < 4; ++g) {
      w.add(fmt::format("{:06d}.t5.npy", g), g == 2 ? npy_f32({1, 2}, {2, 2}) : npy_f32({1}, {float(g)}));
      w.add(fmt::format("{:06d}.txt", g), "caption");
    }
    w.finish();
  }
  LoaderOptions o;
  o.source = tmp.path("train-*.tar");
  o.single_pass = true;
  o.check = [](const Sample& s) {
    if (s.at("t5").shape.size() != 1) fail("sample {}: t5 must be [1]", s.key);
  };
  const std::string where = "shard " + tmp.path("train-000000.tar") + ", member 000002.t5.npy / 000002.txt";
  o.skip_corrupt = true;
  ::testing::internal::CaptureStderr();
  DataLoader l(o);
  EXPECT_EQ(drain(l), (std::vector<int>{0, 1, 3}));
  expect_mentions(::testing::internal::GetCapturedStderr(), {where, "t5 must be [1]", "skipping sample '000002'"});
  EXPECT_EQ(l.corrupt_skipped(), 1u);
  o.skip_corrupt = false;
  DataLoader strict(o);
  Sample s;
  ASSERT_TRUE(strict.next(s));
  ASSERT_TRUE(strict.next(s));
  expect_mentions(error_of([&] { strict.next(s); }), {where, "t5 must be [1]"});
}
