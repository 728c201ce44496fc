// safetensors I/O: round trips of every dtype, RNE conversion on write, header layout, atomic
// writes, and a clear error for each way a file can be damaged.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"
#include "core/sha256.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace flux8;

namespace {

using flux8::testing::error_of;
using flux8::testing::read_bytes;
using flux8::testing::TempDir;

// A file assembled byte by byte, to produce damage the writer never would.
std::string write_raw(const std::string& path, const std::string& header, const std::string& data,
                      uint64_t header_len) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&header_len), 8);
  out << header << data;
  return path;
}
std::string write_raw(const std::string& path, const std::string& header, const std::string& data) {
  return write_raw(path, header, data, header.size());
}

void expect_mentions(const std::string& msg, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts)
    EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "':\n" << msg;
}

std::string bytes_of(const void* p, size_t n) { return std::string(static_cast<const char*>(p), n); }

// The file's digests per SafetensorsWriter piece, read back.
std::vector<std::string> piece_digests(const std::string& path) {
  const uint64_t size = fs::file_size(path), piece = SafetensorsWriter::kPieceBytes;
  std::vector<std::string> d;
  for (uint64_t begin = 0; begin < size; begin += piece)
    d.push_back(sha256_file_range(path, begin, std::min(piece, size - begin)));
  return d;
}

}  // namespace

TEST(Safetensors, RoundTripEachDtype) {
  TempDir dir;
  const std::vector<float> f32{1.5f, -2.25f, 3e-20f, 65504.f, -0.0f, 7.f};
  const std::vector<double> f64{1.0 / 3.0, -1e300};
  const std::vector<uint16_t> bf16{f32_to_bf16_bits(1.5f), f32_to_bf16_bits(-3.0f), 0x7f80};
  const std::vector<uint16_t> f16{f32_to_f16_bits(0.5f), f32_to_f16_bits(-1024.f)};
  SafetensorsWriter w;
  w.add("a.f32", DType::f32, {2, 3}, f32.data());
  w.add("b.f64", DType::f64, {2}, f64.data());
  w.add("c.bf16", DType::bf16, {3, 1}, bf16.data());
  w.add("d.f16", DType::f16, {2}, f16.data());
  w.add_f32_as("e.as_bf16", {6}, f32.data(), DType::bf16);
  w.add_f32_as("f.as_f16", {6}, f32.data(), DType::f16);
  w.add_f32_as("g.as_f64", {6}, f32.data(), DType::f64);
  w.add_f32_as("h.as_f32", {6}, f32.data(), DType::f32);
  w.write(dir.path("x.safetensors"));

  SafetensorsReader r(dir.path("x.safetensors"));
  EXPECT_EQ(r.names(), (std::vector<std::string>{"a.f32", "b.f64", "c.bf16", "d.f16", "e.as_bf16", "f.as_f16",
                                                 "g.as_f64", "h.as_f32"}));
  const SafetensorsTensor& a = r.tensor("a.f32");
  EXPECT_EQ(a.dtype, "F32");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(bytes_of(a.data, a.nbytes), bytes_of(f32.data(), 24));
  EXPECT_EQ(bytes_of(r.tensor("b.f64").data, 16), bytes_of(f64.data(), 16));
  EXPECT_EQ(r.tensor("c.bf16").dtype, "BF16");
  EXPECT_EQ(bytes_of(r.tensor("c.bf16").data, 6), bytes_of(bf16.data(), 6));
  EXPECT_EQ(r.tensor("d.f16").dtype, "F16");
  EXPECT_EQ(bytes_of(r.tensor("d.f16").data, 4), bytes_of(f16.data(), 4));

  std::vector<float> got(6);
  r.read_f32("c.bf16", got.data(), {3, 1});
  EXPECT_EQ(got[0], 1.5f);
  EXPECT_EQ(got[1], -3.0f);
  EXPECT_TRUE(std::isinf(got[2]));
  r.read_f32("d.f16", got.data());
  EXPECT_EQ(got[0], 0.5f);
  EXPECT_EQ(got[1], -1024.f);
  std::vector<double> d(6);
  r.read_f64("b.f64", d.data());
  EXPECT_EQ(d[0], 1.0 / 3.0);
  EXPECT_EQ(d[1], -1e300);
  // Each stored copy of f32 reads back as that value rounded to the stored type.
  for (const char* name : {"e.as_bf16", "f.as_f16", "g.as_f64", "h.as_f32"}) {
    r.read_f32(name, got.data(), {6});
    for (size_t i = 0; i < f32.size(); ++i) {
      float want = f32[i];
      if (std::string(name) == "e.as_bf16") want = round_to_bf16(want);
      if (std::string(name) == "f.as_f16") want = f16_bits_to_f32(f32_to_f16_bits(want));
      EXPECT_EQ(got[i], want) << name << "[" << i << "]";
    }
  }
  EXPECT_EQ(r.tensor("g.as_f64").dtype, "F64");
}

TEST(Safetensors, ConversionOnWriteRoundsToNearestEven) {
  TempDir dir;
  // Exact ties: 1 + 2^-8 lies halfway between bf16 neighbours 1 and 1 + 2^-7 (rounds down to the
  // even mantissa); 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6 (rounds up to even).
  const std::vector<float> bf{1.f + 0x1p-8f, 1.f + 3 * 0x1p-8f};
  // Same for f16 with its 10-bit mantissa.
  const std::vector<float> hf{1.f + 0x1p-11f, 1.f + 3 * 0x1p-11f};
  SafetensorsWriter w;
  w.add_f32_as("bf", {2}, bf.data(), DType::bf16);
  w.add_f32_as("hf", {2}, hf.data(), DType::f16);
  w.write(dir.path("x.safetensors"));
  SafetensorsReader r(dir.path("x.safetensors"));
  uint16_t b[2], h[2];
  std::memcpy(b, r.tensor("bf").data, 4);
  std::memcpy(h, r.tensor("hf").data, 4);
  EXPECT_EQ(b[0], 0x3f80);  // 1.0
  EXPECT_EQ(b[1], 0x3f82);  // 1 + 2^-6
  EXPECT_EQ(h[0], 0x3c00);  // 1.0
  EXPECT_EQ(h[1], 0x3c02);  // 1 + 2^-9
}

TEST(Safetensors, ReadsIntegerTensorsAsFloat) {
  TempDir dir;
  const int32_t i32[3] = {-7, 0, 1 << 20};
  const int64_t i64[2] = {int64_t(1) << 40, -3};
  const std::string p = write_raw(
      dir.path("ints.safetensors"),
      R"({"i":{"dtype":"I32","shape":[3],"data_offsets":[0,12]},"l":{"dtype":"I64","shape":[2],"data_offsets":[12,28]}})",
      bytes_of(i32, 12) + bytes_of(i64, 16));
  SafetensorsReader r(p);
  float f[3];
  r.read_f32("i", f);
  EXPECT_EQ(f[0], -7.f);
  EXPECT_EQ(f[2], 1048576.f);
  double d[2];
  r.read_f64("l", d, {2});
  EXPECT_EQ(d[0], 1099511627776.0);
  EXPECT_EQ(d[1], -3.0);
}

TEST(Safetensors, MetadataRoundTrip) {
  TempDir dir;
  const float x = 1.f;
  SafetensorsWriter w;
  w.set_metadata("format", "pt");
  w.set_metadata("flux8_config", "hidden_size: 96\nmodel_name: \"tiny\"\n");
  w.add("x", DType::f32, {}, &x);
  w.write(dir.path("m.safetensors"));
  SafetensorsReader r(dir.path("m.safetensors"));
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("flux8_config"), "hidden_size: 96\nmodel_name: \"tiny\"\n");
  EXPECT_EQ(r.names(), std::vector<std::string>{"x"});  // __metadata__ is not a tensor
  EXPECT_EQ(r.tensor("x").numel(), 1);                  // shape [] is a scalar
}

TEST(Safetensors, HeaderIsPaddedSoDataIs8ByteAligned) {
  TempDir dir;
  const std::vector<float> x(5, 2.f);
  for (const std::string name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    SafetensorsWriter w;
    w.add(name, DType::f32, {5}, x.data());
    w.add("empty", DType::bf16, {0, 3}, nullptr);
    w.write(dir.path("p.safetensors"));
    std::ifstream in(dir.path("p.safetensors"), std::ios::binary);
    const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    uint64_t n;
    std::memcpy(&n, file.data(), 8);
    EXPECT_EQ(n % 8, 0u) << name;
    EXPECT_EQ(file.size(), 8 + n + 20) << name;
    EXPECT_EQ(file[8], '{');
    EXPECT_EQ(file.substr(8 + n), bytes_of(x.data(), 20));
    SafetensorsReader r(dir.path("p.safetensors"));
    EXPECT_EQ(r.tensor("empty").nbytes, 0u);
    EXPECT_EQ(r.tensor("empty").shape, (std::vector<int64_t>{0, 3}));
  }
}

TEST(Safetensors, ShapeCheckAndMissingTensorNameTheTensor) {
  TempDir dir;
  const std::vector<float> x(6, 1.f);
  SafetensorsWriter w;
  w.add("img_in.weight", DType::f32, {2, 3}, x.data());
  w.write(dir.path("s.safetensors"));
  SafetensorsReader r(dir.path("s.safetensors"));
  std::vector<float> dst(6);
  expect_mentions(error_of([&] {
                    r.read_f32("img_in.weight", dst.data(), {3, 2});
                  }),
                  {"s.safetensors", "'img_in.weight'", "[2, 3]", "[3, 2]"});
  expect_mentions(error_of([&] { r.read_f32("img_in.bias", dst.data()); }),
                  {"s.safetensors", "no tensor 'img_in.bias'"});
  EXPECT_FALSE(r.contains("img_in.bias"));
  EXPECT_TRUE(r.contains("img_in.weight"));
}

TEST(Safetensors, UnconvertibleDtypeNamesIt) {
  TempDir dir;
  const std::string p =
      write_raw(dir.path("u8.safetensors"), R"({"mask":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "abcd");
  SafetensorsReader r(p);  // opens and lists fine
  float f[4];
  expect_mentions(error_of([&] { r.read_f32("mask", f); }), {"'mask'", "U8", "F32, F64, BF16"});
}

TEST(Safetensors, AtomicWriteReplacesAndLeavesNoTempFile) {
  TempDir dir;
  const float one = 1.f, two = 2.f;
  SafetensorsWriter w1, w2;
  w1.add("v", DType::f32, {1}, &one);
  w2.add("v", DType::f32, {1}, &two);
  w1.write(dir.path("ckpt.safetensors"));
  w2.write(dir.path("ckpt.safetensors"));
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"ckpt.safetensors"});
  float got;
  SafetensorsReader(dir.path("ckpt.safetensors")).read_f32("v", &got);
  EXPECT_EQ(got, 2.f);

  const std::string bad = dir.path("no/such/dir/ckpt.safetensors");
  expect_mentions(error_of([&] { w1.write(bad); }), {bad + ".tmp.", "No such file or directory"});
  EXPECT_EQ(dir.listing(), std::vector<std::string>{"ckpt.safetensors"});
}

// Tensors larger than the writer's buffers, and sizes that leave a buffer's tail shorter than
// the next tensor's element (a bf16 tensor of odd length before f64 ones), stream through
// add_filled in pieces: the file reads back exactly and write() returns its pieces' SHA-256s.
TEST(Safetensors, FilledTensorsStreamInPiecesWithTheirDigests) {
  TempDir dir;
  const size_t big = (size_t{40} << 20) / 4 + 3;  // 40 MiB + 12 bytes of f32: past one buffer
  std::vector<float> a(big);
  for (size_t i = 0; i < big; ++i) a[i] = static_cast<float>(i % 9973) * 0.25f - 7.f;
  std::vector<uint16_t> b(1001);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint16_t>(0x3f80 + i);
  const size_t nd = (size_t{33} << 20) / 8 + 5;  // 33 MiB of f64: its elements straddle buffers
  std::vector<double> d(nd);
  for (size_t i = 0; i < nd; ++i) d[i] = 1.0 / static_cast<double>(i + 1);

  std::vector<std::pair<size_t, size_t>> calls;  // the pieces a's fill was asked for
  SafetensorsWriter w;
  w.add_filled("a", DType::f32, {static_cast<int64_t>(big)}, [&](size_t first, size_t count, void* dst) {
    calls.emplace_back(first, count);
    std::memcpy(dst, a.data() + first, count * 4);
  });
  w.add("b", DType::bf16, {static_cast<int64_t>(b.size())}, b.data());
  w.add("d", DType::f64, {static_cast<int64_t>(nd)}, d.data());
  w.add_f32_as("a_as_bf16", {static_cast<int64_t>(big)}, a.data(), DType::bf16);
  const std::string path = dir.path("big.safetensors");
  const SafetensorsWriter::Written written = w.write(path);

  EXPECT_EQ(written.bytes, fs::file_size(path));
  EXPECT_GE(written.piece_sha256.size(), 3u);
  EXPECT_EQ(written.piece_sha256, piece_digests(path));
  ASSERT_GE(calls.size(), 2u);  // in pieces, in order, covering every element once
  size_t next = 0;
  for (const auto& [first, count] : calls) {
    EXPECT_EQ(first, next);
    EXPECT_GT(count, 0u);
    next = first + count;
  }
  EXPECT_EQ(next, big);

  SafetensorsReader r(path);
  std::vector<float> got_a(big), got_ab(big), got_b(b.size());
  std::vector<double> got_d(nd);
  r.read_f32("a", got_a.data());
  r.read_f64("d", got_d.data());
  r.read_f32("b", got_b.data());
  r.read_f32("a_as_bf16", got_ab.data());
  EXPECT_EQ(std::memcmp(got_a.data(), a.data(), big * 4), 0);
  EXPECT_EQ(std::memcmp(got_d.data(), d.data(), nd * 8), 0);
  for (size_t i = 0; i < b.size(); ++i) ASSERT_EQ(got_b[i], bf16_bits_to_f32(b[i])) << i;
  for (size_t i = 0; i < big; i += 4099) ASSERT_EQ(got_ab[i], round_to_bf16(a[i])) << i;
}

// Files written side by side are each what write() makes alone; a failing fill in one leaves
// none of them.
TEST(Safetensors, WriteTogetherEqualsWritingEachAlone) {
  TempDir dir;
  const size_t n1 = (size_t{70} << 20) / 4 + 1, n2 = (size_t{20} << 20) / 2 + 7;
  std::vector<float> x(n1);
  for (size_t i = 0; i < n1; ++i) x[i] = static_cast<float>(i) * 0.5f;
  std::vector<uint16_t> y(n2);
  for (size_t i = 0; i < n2; ++i) y[i] = static_cast<uint16_t>(i * 7);
  SafetensorsWriter a, b;
  a.add("x", DType::f32, {static_cast<int64_t>(n1)}, x.data());
  a.set_metadata("k", "v");
  b.add("y", DType::bf16, {static_cast<int64_t>(n2)}, y.data());
  b.add_f32_as("x16", {static_cast<int64_t>(n1)}, x.data(), DType::f16);
  const auto together = SafetensorsWriter::write_together({{&a, dir.path("a2")}, {&b, dir.path("b2")}});
  ASSERT_EQ(together.size(), 2u);
  EXPECT_EQ(together[0].piece_sha256, a.write(dir.path("a1")).piece_sha256);
  EXPECT_EQ(together[1].piece_sha256, b.write(dir.path("b1")).piece_sha256);
  EXPECT_EQ(together[0].piece_sha256, piece_digests(dir.path("a2")));
  EXPECT_EQ(together[1].piece_sha256, piece_digests(dir.path("b2")));
  EXPECT_EQ(sha256_file(dir.path("a1")), sha256_file(dir.path("a2")));
  EXPECT_EQ(sha256_file(dir.path("b1")), sha256_file(dir.path("b2")));

  SafetensorsWriter bad;
  bad.add_filled("z", DType::f32, {static_cast<int64_t>(n1)}, [](size_t first, size_t count, void* dst) {
    if (first > 0) fail("no more z");
    std::memset(dst, 0, count * 4);
  });
  expect_mentions(error_of([&] {
                    SafetensorsWriter::write_together({{&a, dir.path("a3")}, {&bad, dir.path("z")}});
                  }),
                  {"no more z"});
  std::vector<std::string> left = dir.listing();
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"a1", "a2", "b1", "b2"}));
}

// A fill that fails (a device error, say) fails write(): no file, no temp file left.
TEST(Safetensors, AFailingFillLeavesNoFile) {
  TempDir dir;
  const size_t n = (size_t{48} << 20) / 4;
  SafetensorsWriter w;
  w.add_filled("x", DType::f32, {static_cast<int64_t>(n)}, [](size_t first, size_t count, void* dst) {
    if (first > 0) fail("download failed at element {}", first);
    std::memset(dst, 0, count * 4);
  });
  expect_mentions(error_of([&] { w.write(dir.path("x.safetensors")); }), {"download failed at element"});
  EXPECT_TRUE(dir.listing().empty());
}

TEST(Safetensors, WriterRejectsBadNames) {
  const float x = 0;
  SafetensorsWriter w;
  w.add("a", DType::f32, {1}, &x);
  expect_mentions(error_of([&] { w.add("a", DType::f32, {1}, &x); }), {"'a'", "twice"});
  expect_mentions(error_of([&] { w.add("__metadata__", DType::f32, {1}, &x); }), {"invalid"});
  expect_mentions(error_of([&] { w.add("n", DType::f32, {-1}, &x); }), {"'n'", "negative"});
}

// ---- damaged files: each fails on open, naming the file and the problem ----

TEST(SafetensorsCorrupt, Truncated) {
  TempDir dir;
  const std::vector<float> x(16, 1.f);
  SafetensorsWriter w;
  w.add("w", DType::f32, {16}, x.data());
  const std::string p = dir.path("t.safetensors");
  w.write(p);
  fs::resize_file(p, fs::file_size(p) - 4);
  expect_mentions(error_of([&] { SafetensorsReader r(p); }), {"t.safetensors", "'w'", "run past", "truncated"});
  fs::resize_file(p, 20);  // inside the header
  expect_mentions(error_of([&] { SafetensorsReader r(p); }), {"header length", "truncated"});
  fs::resize_file(p, 5);
  expect_mentions(error_of([&] { SafetensorsReader r(p); }), {"5 bytes", "too short"});
  expect_mentions(error_of([&] { SafetensorsReader r(dir.path("absent")); }), {"absent", "No such file"});
}

TEST(SafetensorsCorrupt, BadJson) {
  TempDir dir;
  const std::string p = write_raw(dir.path("j.safetensors"), R"({"w":{"dtype":"F32",)", "");
  expect_mentions(error_of([&] { SafetensorsReader r(p); }), {"j.safetensors", "not valid JSON"});
  const std::string q = write_raw(dir.path("k.safetensors"), "[1, 2]", "");
  expect_mentions(error_of([&] { SafetensorsReader r(q); }), {"not a JSON object"});
  const std::string s = write_raw(dir.path("l.safetensors"), R"({"w":{"dtype":"F32"}})", "");
  expect_mentions(error_of([&] { SafetensorsReader r(s); }), {"'w'", "data_offsets"});
}

TEST(SafetensorsCorrupt, OffsetsOutOfRange) {
  TempDir dir;
  const std::string p = write_raw(dir.path("o.safetensors"),
                                  R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}})", std::string(16, '\0'));
  expect_mentions(error_of([&] { SafetensorsReader r(p); }),
                  {"o.safetensors", "'w'", "[8, 24]", "16-byte data buffer"});
  const std::string q =
      write_raw(dir.path("r.safetensors"), R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[4,0]}})", "");
  expect_mentions(error_of([&] { SafetensorsReader r(q); }), {"'w'", "begin <= end"});
}

TEST(SafetensorsCorrupt, Overlapping) {
  TempDir dir;
  const std::string p = write_raw(
      dir.path("ov.safetensors"),
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      std::string(12, '\0'));
  expect_mentions(error_of([&] { SafetensorsReader r(p); }), {"ov.safetensors", "'b'", "overlaps", "'a'"});
}

TEST(SafetensorsCorrupt, WrongByteCount) {
  TempDir dir;
  const std::string p =
      write_raw(dir.path("b.safetensors"), R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,10]}})",
                std::string(10, '\0'));
  expect_mentions(error_of([&] { SafetensorsReader r(p); }),
                  {"b.safetensors", "'w'", "[2, 3] of BF16 needs 12 bytes", "span 10"});
}

TEST(SafetensorsCorrupt, GapsTrailingBytesAndUnknownDtype) {
  TempDir dir;
  const std::string gap = write_raw(
      dir.path("gap.safetensors"),
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
      std::string(12, '\0'));
  expect_mentions(error_of([&] { SafetensorsReader r(gap); }), {"bytes 4..8", "'b'", "no tensor"});
  const std::string tail = write_raw(dir.path("tail.safetensors"),
                                     R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", std::string(6, '\0'));
  expect_mentions(error_of([&] { SafetensorsReader r(tail); }), {"6 bytes", "cover 4"});
  const std::string dt = write_raw(dir.path("dt.safetensors"),
                                   R"({"a":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'));
  expect_mentions(error_of([&] { SafetensorsReader r(dt); }), {"'a'", "unknown dtype 'F33'"});
  const std::string meta = write_raw(dir.path("meta.safetensors"), R"({"__metadata__":{"k":1}})", "");
  expect_mentions(error_of([&] { SafetensorsReader r(meta); }), {"__metadata__", "'k'", "not a string"});
}

// ---- crafted headers: each is an error naming the file and the tensor, never a crash ----

namespace {

// A file holding one tensor 'w' whose entry has the given JSON texts, and `data` after it.
std::string write_entry(const std::string& path, const std::string& dtype, const std::string& shape,
                        const std::string& offsets, const std::string& data = "") {
  return write_raw(path, R"({"w":{"dtype":)" + dtype + R"(,"shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}",
                   data);
}

std::string open_error(const std::string& path) {
  return error_of([&] { SafetensorsReader r(path); });
}

}  // namespace

TEST(SafetensorsCorrupt, DeepNestingIsRefusedWithoutWalkingIt) {
  TempDir dir;
  const std::string deep = std::string(200000, '[') + "1" + std::string(200000, ']');
  const std::string p = dir.path("deep.safetensors");
  write_entry(p, R"("F32")", deep, "[0,4]", std::string(4, '\0'));
  std::string msg = open_error(p);
  expect_mentions(msg, {"deep.safetensors", "tensor 'w'", "nested more than"});
  EXPECT_LT(msg.size(), 400u) << msg;
  write_entry(p, R"("F32")", "[1]", deep, std::string(4, '\0'));
  expect_mentions(open_error(p), {"deep.safetensors", "tensor 'w'", "nested more than"});
  // Nested within the JSON limit: the value is described, not printed.
  const std::string nested = std::string(40, '[') + std::string(40, ']');
  write_entry(p, R"("F32")", "[" + nested + "]", "[0,4]", std::string(4, '\0'));
  msg = open_error(p);
  expect_mentions(msg, {"tensor 'w'", "shape entry 0", "a list of 1", "not a number"});
  EXPECT_EQ(msg.find("[[["), std::string::npos) << msg;
  write_entry(p, R"("F32")", "[1]", "[" + nested + ",4]", std::string(4, '\0'));
  expect_mentions(open_error(p), {"tensor 'w'", "data_offsets begin", "a list of 1"});
}

TEST(SafetensorsCorrupt, NumbersOutOfRangeNameTheTensor) {
  TempDir dir;
  const std::string p = dir.path("n.safetensors");
  const std::string data(8, '\0');
  struct Case {
    std::string shape, offsets;
    std::vector<std::string> mentions;
  };
  const std::vector<Case> cases = {
      {"[1e400]", "[0,8]", {"not valid JSON", "number overflow"}},
      {"[2]", "[0,-1e400]", {"not valid JSON", "number overflow"}},
      {"[18446744073709551616]", "[0,8]", {"shape entry 0", "larger than 2^63-1"}},
      {"[9223372036854775808]", "[0,8]", {"shape entry 0", "larger than 2^63-1"}},
      {"[2,-2]", "[0,8]", {"shape entry 1", "-2 is negative"}},
      {"[2.5]", "[0,8]", {"shape entry 0", "2.5 is not an integer"}},
      {"[\"2\"]", "[0,8]", {"shape entry 0", "the string '2' is not a number"}},
      {"[2]", "[-8,0]", {"data_offsets begin", "negative"}},
      {"[2]", "[0,18446744073709551615]", {"data_offsets end", "larger than 2^63-1"}},
      {"[2]", "[0,8.5]", {"data_offsets end", "8.5 is not an integer"}},
      {"[2]", "[0]", {"data_offsets is a list of 1"}},
      {"[2]", "{\"a\":1}", {"data_offsets is an object"}},
  };
  for (const Case& c : cases) {
    write_entry(p, R"("F32")", c.shape, c.offsets, data);
    const std::string msg = open_error(p);
    expect_mentions(msg, {"n.safetensors", "tensor 'w'"});
    for (const std::string& m : c.mentions)
      EXPECT_NE(msg.find(m), std::string::npos) << c.shape << " " << c.offsets << ": " << msg;
  }
}

// Element count × element size must not wrap modulo 2^64 into the span of the offsets.
TEST(SafetensorsCorrupt, SizesThatWouldWrapAreRefused) {
  TempDir dir;
  const std::string p = dir.path("w.safetensors");
  write_entry(p, R"("F64")", "[2305843009213693952]", "[0,0]");  // 2^61 · 8 bytes = 2^64
  expect_mentions(open_error(p), {"w.safetensors", "tensor 'w'", "more than 2^64 bytes"});
  write_entry(p, R"("U8")", "[4294967296,4294967296]", "[0,0]");  // 2^64 elements
  expect_mentions(open_error(p), {"tensor 'w'", "more than 2^63-1 elements"});
  write_entry(p, R"("U8")", "[0,4294967296,4294967296]", "[0,0]");  // empty, but the rest would wrap
  expect_mentions(open_error(p), {"tensor 'w'", "more than 2^63-1 elements"});
  write_entry(p, R"("U8")", "[0,4294967296]", "[0,0]");  // empty and representable: fine
  EXPECT_EQ(SafetensorsReader(p).tensor("w").numel(), 0);
}

TEST(SafetensorsCorrupt, HeaderLengthIsCheckedAgainstTheFileAndTheLimit) {
  TempDir dir;
  const std::string p = write_raw(dir.path("h.safetensors"), "{}", "", ~uint64_t{0});
  expect_mentions(open_error(p), {"h.safetensors", "header length 18446744073709551615", "exceeds the 2 bytes"});
  // A header over 100 MB is refused before it is read (the file is sparse: nothing is written).
  const uint64_t n = 100'000'001;
  write_raw(p, "", "", n);
  fs::resize_file(p, 8 + n);
  expect_mentions(open_error(p), {"h.safetensors", "header length 100000001", "limit of 100000000"});
}

TEST(SafetensorsCorrupt, DuplicateNamesAndKeys) {
  TempDir dir;
  const std::string e = R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  const std::string p =
      write_raw(dir.path("d.safetensors"), R"({"a":)" + e + R"(,"a":)" + e + "}", std::string(4, '\0'));
  expect_mentions(open_error(p), {"d.safetensors", "tensor 'a'", "appears twice"});
  write_raw(p, R"({"a":{"dtype":"F32","dtype":"U8","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'));
  expect_mentions(open_error(p), {"tensor 'a'", "key 'dtype' appears twice"});
  write_raw(p, R"({"__metadata__":{"k":"1","k":"2"}})", "");
  expect_mentions(open_error(p), {"__metadata__", "key 'k' appears twice"});
}

TEST(SafetensorsCorrupt, MetadataAndDtypeOfTheWrongKind) {
  TempDir dir;
  const std::string p = write_raw(dir.path("m.safetensors"), R"({"__metadata__":["a"]})", "");
  expect_mentions(open_error(p), {"m.safetensors", "__metadata__ is a list of 1, not an object"});
  write_raw(p, R"({"__metadata__":{"k":{"x":1}}})", "");
  expect_mentions(open_error(p), {"__metadata__ value of 'k' is an object, not a string"});
  write_entry(p, "7", "[1]", "[0,4]", std::string(4, '\0'));
  expect_mentions(open_error(p), {"tensor 'w'", "dtype is 7, not a string"});
}

// Untrusted text in a message is a short excerpt: a megabyte name, dtype or number is cut.
TEST(SafetensorsCorrupt, LongValuesAreQuotedShort) {
  TempDir dir;
  const std::string big(1 << 20, 'x');
  const std::string p = dir.path("l.safetensors");
  write_entry(p, "\"" + big + "\"", "[1]", "[0,4]", std::string(4, '\0'));
  std::string msg = open_error(p);
  expect_mentions(msg, {"tensor 'w'", "unknown dtype 'xxx", "..."});
  EXPECT_LT(msg.size(), 500u);
  write_raw(p, "{\"" + big + R"(":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", std::string(4, '\0'));
  msg = open_error(p);
  expect_mentions(msg, {"l.safetensors", "tensor 'xxx"});
  EXPECT_LT(msg.size(), 500u);
  write_entry(p, R"("F32")", "[1" + std::string(1 << 20, '0') + "]", "[0,4]", std::string(4, '\0'));
  msg = open_error(p);
  expect_mentions(msg, {"l.safetensors", "tensor 'w'"});
  EXPECT_LT(msg.size(), 500u);
}

// What the fuzz targets do: any bytes, through a path or in memory, are an Error or a reader.
TEST(SafetensorsCorrupt, OpensThroughAnyPathAndRefusesWhatIsNotAFile) {
  TempDir dir;
  const std::string good = write_entry(dir.path("g.safetensors"), R"("U8")", "[3]", "[0,3]", "abc");
  const std::string bytes = read_bytes(good);
  const int fd = ::memfd_create("safetensors", 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  const SafetensorsReader via_fd(fmt::format("/proc/self/fd/{}", fd));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(via_fd.tensor("w").data), 3), "abc");
  ::close(fd);
  const SafetensorsReader in_memory(std::vector<uint8_t>(bytes.begin(), bytes.end()), "member.safetensors");
  EXPECT_EQ(in_memory.tensor("w").nbytes, 3u);
  expect_mentions(error_of([] {
                    SafetensorsReader r(std::vector<uint8_t>{1, 0, 0, 0, 0, 0, 0, 0, '{'}, "m");
                  }),
                  {"'m'", "not valid JSON"});

  expect_mentions(open_error(dir.path()), {"not a regular file"});
  const std::string fifo = dir.path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_mentions(open_error(fifo), {"fifo", "not a regular file"});  // without waiting for a writer
}
