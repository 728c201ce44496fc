// Data pipeline: tar reading/writing (incl. GNU long names, pax headers, checksum and truncation
// faults), WebDataset grouping and decoders, and the loader's order, sharding, resume and fault
// handling.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <thread>

#include "core/dtype.h"
#include "core/error.h"
#include "data/loader.h"
#include "data/tar.h"
#include "data/webdataset.h"
#include "data_test_util.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace flux8;

namespace {

using flux8::testing::error_of;
using flux8::testing::read_bytes;
using flux8::testing::TempDir;
using flux8::testing::write_bytes;
using namespace flux8::testing::data;

// All members of a tar as (name, data).
std::vector<std::pair<std::string, std::string>> read_all(const std::string& path) {
  TarReader r(path);
  std::vector<std::pair<std::string, std::string>> out;
  TarMember m;
  while (r.next(m)) {
    const std::vector<uint8_t> d = r.read_data();
    out.emplace_back(m.name, std::string(d.begin(), d.end()));
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tar

TEST(TarTest, RoundTripIncludingLongNamesAndBlockEdges) {
  TempDir tmp;
  const std::string long_name = "deep/" + std::string(140, 'n') + "/000001.t5.npy";
  std::vector<std::pair<std::string, std::string>> members = {{"000000.txt", "a red circle"},
                                                              {"000000.empty.bytes", ""},
                                                              {"000000.block.bytes", std::string(512, 'x')},
                                                              {"000000.more.bytes", std::string(513, 'y')},
                                                              {long_name, "long"},
                                                              {std::string(100, 'e'), "exactly one hundred"}};
  {
    TarWriter w(tmp.path("a.tar"));
    for (const auto& [n, d] : members) w.add(n, d);
    w.finish();
  }
  EXPECT_FALSE(fs::exists(tmp.path("a.tar.tmp." + std::to_string(::getpid()))));
  EXPECT_EQ(read_all(tmp.path("a.tar")), members);
  EXPECT_EQ(fs::file_size(tmp.path("a.tar")) % 512, 0u);

  // Data offsets allow random access later.
  TarReader r(tmp.path("a.tar"));
  TarMember m;
  ASSERT_TRUE(r.next(m));
  ASSERT_TRUE(r.next(m));  // skipping the first member's data
  ASSERT_TRUE(r.next(m));
  EXPECT_EQ(m.name, "000000.block.bytes");
  EXPECT_EQ(read_file_range(tmp.path("a.tar"), m.data_offset, m.size, m.name), std::vector<uint8_t>(512, 'x'));
}

TEST(TarTest, WriterWithoutFinishLeavesNoFile) {
  TempDir tmp;
  {
    TarWriter w(tmp.path("a.tar"));
    w.add("x.txt", "hello");
  }
  EXPECT_FALSE(fs::exists(tmp.path("a.tar")));
  EXPECT_TRUE(fs::is_empty(fs::path(tmp.path("a.tar")).parent_path()));
}

TEST(TarTest, PaxPathPrefixAndDirectoriesHandCrafted) {
  TempDir tmp;
  // What Python's tarfile (pax format, its default) writes for a long or non-ASCII name: an 'x'
  // header whose data holds "path=" records, then the member with a truncated name.
  const std::string pax_path = "shards/" + std::string(120, 'p') + "/k.caption.txt";
  const std::string pax_data = pax_record("mtime", "1700000000.5") + pax_record("path", pax_path);
  std::string bytes = raw_header("PaxHeaders/k", pax_data.size(), 'x') + padded(pax_data);
  bytes += raw_header("truncated-name", 5, '0') + padded("hello");
  bytes += raw_header("somedir/", 0, '5');                             // directory: skipped
  bytes += raw_header("name.txt", 3, '0', "pre/fix") + padded("abc");  // ustar prefix
  bytes += raw_header("pax_global_header", pax_data.size(), 'g') + padded(pax_data);
  bytes += raw_header("plain.txt", 2, '0') + padded("ok");
  bytes += std::string(1024, '\0');
  write_bytes(tmp.path("pax.tar"), bytes);
  const std::vector<std::pair<std::string, std::string>> expected = {
      {pax_path, "hello"}, {"pre/fix/name.txt", "abc"}, {"plain.txt", "ok"}};
  EXPECT_EQ(read_all(tmp.path("pax.tar")), expected);
}

TEST(TarTest, MissingEndMarkerToleratedButPartialBlockIsNot) {
  TempDir tmp;
  {
    TarWriter w(tmp.path("a.tar"));
    w.add("000000.txt", "one");
    w.add("000001.txt", "two");
    w.finish();
  }
  const std::string full = read_bytes(tmp.path("a.tar"));
  write_bytes(tmp.path("noend.tar"), full.substr(0, full.size() - 1024));
  EXPECT_EQ(read_all(tmp.path("noend.tar")).size(), 2u);
  write_bytes(tmp.path("partial.tar"), full.substr(0, full.size() - 1024 + 100));
  const std::string err = error_of([&] { read_all(tmp.path("partial.tar")); });
  EXPECT_NE(err.find(tmp.path("partial.tar")), std::string::npos) << err;
  EXPECT_NE(err.find("000001.txt"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
}

TEST(TarTest, ChecksumCorruptionDetected) {
  TempDir tmp;
  {
    TarWriter w(tmp.path("a.tar"));
    w.add("000000.txt", "one");
    w.add("000001.txt", "two");
    w.finish();
  }
  std::string bytes = read_bytes(tmp.path("a.tar"));
  bytes[1024 + 3] ^= 0x01;  // a bit of the second header's name
  write_bytes(tmp.path("bad.tar"), bytes);
  TarReader r(tmp.path("bad.tar"));
  TarMember m;
  ASSERT_TRUE(r.next(m));
  const std::string err = error_of([&] { r.next(m); });
  EXPECT_NE(err.find("checksum"), std::string::npos) << err;
  EXPECT_NE(err.find(tmp.path("bad.tar")), std::string::npos) << err;
  EXPECT_NE(err.find("000000.txt"), std::string::npos) << err;  // where: after this member
}

TEST(TarTest, TruncatedMemberDetectedWithShardAndMember) {
  TempDir tmp;
  {
    TarWriter w(tmp.path("train-000003.tar"));
    w.add("000122.t5.bytes", std::string(2000, 'a'));
    w.add("000123.t5.bytes", std::string(5000, 'b'));
    w.finish();
  }
  const std::string bytes = read_bytes(tmp.path("train-000003.tar"));
  // Cut inside the second member's data, on a block boundary (so only the size field tells).
  write_bytes(tmp.path("train-000003.tar"), bytes.substr(0, 2048 + 512 + 2048));
  TarReader r(tmp.path("train-000003.tar"));
  TarMember m;
  ASSERT_TRUE(r.next(m));
  const std::string err = error_of([&] { r.next(m); });
  EXPECT_NE(err.find("shard " + tmp.path("train-000003.tar") + ", member 000123.t5.bytes"), std::string::npos) << err;
  EXPECT_NE(err.find("truncated"), std::string::npos) << err;
}

// ---------------------------------------------------------------------------------------------
// WebDataset

TEST(WebDatasetTest, SplitsMemberNames) {
  std::string key, ext;
  ASSERT_TRUE(split_member_name("dir.v1/000123.t5.bytes", key, ext));
  EXPECT_EQ(key, "dir.v1/000123");
  EXPECT_EQ(ext, "t5.bytes");
  EXPECT_FALSE(split_member_name("dir/._000123.txt", key, ext));
  EXPECT_FALSE(split_member_name("README", key, ext));
  EXPECT_EQ(canonical_field_name("latents"), "latent");
  EXPECT_EQ(canonical_field_name("prompt_embeds"), "t5");
  EXPECT_EQ(canonical_field_name("pooled_prompt_embeds"), "clip");
  EXPECT_EQ(canonical_field_name("mean"), "mean");
}

TEST(WebDatasetTest, GroupsConsecutiveMembersByKey) {
  TempDir tmp;
  {
    TarWriter w(tmp.path("s.tar"));
    w.add("a/000.t5.npy", npy_f32({2}, {1, 2}));
    w.add("a/000.clip.npy", npy_f32({1}, {3}));
    w.add("a/000.txt", "first\n");
    w.add("a/000.jpg", "not decoded");
    w.add("a/001.t5.npy", npy_f32({1}, {4}));
    w.add("b/000.t5.npy", npy_f32({1}, {5}));  // same basename, other directory: other sample
    w.finish();
  }
  WebDatasetReader r(tmp.path("s.tar"));
  Sample s;
  ASSERT_TRUE(r.next(s));
  EXPECT_EQ(s.key, "a/000");
  EXPECT_EQ(s.shard, tmp.path("s.tar"));
  EXPECT_EQ(s.at("t5").data, (std::vector<float>{1, 2}));
  EXPECT_EQ(s.at("clip").shape, (std::vector<int64_t>{1}));
  EXPECT_EQ(s.caption, "first");
  EXPECT_EQ(s.fields.size(), 2u);
  ASSERT_TRUE(r.next(s));
  EXPECT_EQ(s.key, "a/001");
  ASSERT_TRUE(r.skip());  // b/000 without reading its data
  EXPECT_FALSE(r.next(s));
  EXPECT_FALSE(r.skip());

  const std::string err = error_of([&] { (void)s.at("mean"); });
  EXPECT_NE(err.find("no field 'mean'"), std::string::npos) << err;
}

TEST(WebDatasetTest, NpyDecoder) {
  const std::string where = "shard s.tar, member k.x.npy";
  const auto dec = [&](const std::string& bytes) {
    return decode_npy(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), where);
  };
  HostTensor t = dec(npy_f32({2, 3}, {0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t.data[5], 5.0f);
  t = dec(npy("<f8", {2}, bytes_of(std::vector<double>{0.25, -3.5}), 2));  // version 2.0 header
  EXPECT_EQ(t.data, (std::vector<float>{0.25f, -3.5f}));
  t = dec(npy("<f2", {2}, bytes_of(std::vector<uint16_t>{0x3C00, 0xC000})));  // 1.0, -2.0
  EXPECT_EQ(t.data, (std::vector<float>{1.0f, -2.0f}));
  t = dec(npy("<i8", {3}, bytes_of(std::vector<int64_t>{-7, 0, 9})));
  EXPECT_EQ(t.data, (std::vector<float>{-7, 0, 9}));
  t = dec(npy("|u1", {}, std::string(1, '\x2a')));  // a scalar
  EXPECT_TRUE(t.shape.empty());
  EXPECT_EQ(t.data, (std::vector<float>{42}));

  std::string err = error_of([&] { dec(npy("<f4", {2, 2}, std::string(16, '\0'), 1, true)); });
  EXPECT_NE(err.find("Fortran"), std::string::npos) << err;
  EXPECT_NE(err.find(where), std::string::npos) << err;
  err = error_of([&] { dec(npy(">f4", {1}, std::string(4, '\0'))); });
  EXPECT_NE(err.find("big-endian"), std::string::npos) << err;
  err = error_of([&] { dec(npy("<f4", {3}, std::string(8, '\0'))); });
  EXPECT_NE(err.find("[3] '<f4' = 12 data bytes, but the member holds 8"), std::string::npos) << err;
  err = error_of([&] { dec("not numpy"); });
  EXPECT_NE(err.find("not a .npy"), std::string::npos) << err;
}

TEST(WebDatasetTest, MlperfBytesMembersAreNpyOfBf16Bits) {
  // The MLPerf shards store np.save(tensor.view(torch.uint16).numpy()) in KEY.FIELD.bytes and
  // {"key": ..., "timestep": k} in KEY.json.
  TempDir tmp;
  const std::vector<float> clip = {1.5f, -0.25f, 3.0f};
  {
    TarWriter w(tmp.path("mlperf.tar"));
    w.add("00000007.json", R"({"key": "cc12m_7", "timestep": 3})");
    w.add("00000007.clip.bytes", npy("<u2", {3}, bytes_of(bf16_bits(clip))));
    w.add("00000007.mean.npy", npy("<u2", {1}, bytes_of(std::vector<uint16_t>{7})));
    w.finish();
  }
  WebDatasetReader r(tmp.path("mlperf.tar"));
  Sample s;
  ASSERT_TRUE(r.next(s));
  EXPECT_EQ(s.at("clip").data, clip);
  EXPECT_EQ(s.at("mean").data, (std::vector<float>{7}));  // a .npy member keeps uint16 as integers
  EXPECT_TRUE(s.at("timestep").shape.empty());
  EXPECT_EQ(s.at("timestep").data, (std::vector<float>{3}));
}

TEST(WebDatasetTest, RawBytesUseJsonLayoutOrMlperfDefaults) {
  TempDir tmp;
  std::vector<float> mean(16 * 32 * 32);
  for (size_t i = 0; i < mean.size(); ++i) mean[i] = static_cast<float>(i % 97) - 48.0f;
  {
    TarWriter w(tmp.path("raw.tar"));
    w.add("k.json", R"({"shapes": {"x": [2, 2], "latents": [1, 3]},
                        "dtypes": {"x": "float16", "latents": "f32"},
                        "y": {"shape": [2], "dtype": "torch.bfloat16"}, "prompt": "a cat"})");
    w.add("k.x.bytes", bytes_of(std::vector<uint16_t>{0x3C00, 0x4000, 0x4200, 0x4400}));
    w.add("k.latents.bytes", bytes_of(std::vector<float>{1, 2, 3}));
    w.add("k.y.bytes", bytes_of(bf16_bits({0.5f, 8.0f})));
    w.add("k.mean.bytes", bytes_of(bf16_bits(mean)));  // no shape in json: MLPerf default
    w.finish();
  }
  WebDatasetReader r(tmp.path("raw.tar"));
  Sample s;
  ASSERT_TRUE(r.next(s));
  EXPECT_EQ(s.at("x").data, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(s.at("x").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(s.at("latent").data, (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(s.at("y").data, (std::vector<float>{0.5f, 8.0f}));
  EXPECT_EQ(s.at("mean").shape, (std::vector<int64_t>{16, 32, 32}));
  EXPECT_EQ(s.at("mean").data, mean);  // small integers are exact in bf16
  EXPECT_EQ(s.caption, "a cat");
}

TEST(WebDatasetTest, JsonShapeMismatchNamesShardMemberAndSizes) {
  TempDir tmp;
  const std::string shard = tmp.path("train-000003.tar");
  {
    TarWriter w(shard);
    w.add("000123.json", R"({"shapes": {"t5": [256, 4096]}, "dtypes": {"t5": "bf16"}})");
    w.add("000123.t5.bytes", std::string(8388608, '\0'));
    w.finish();
  }
  WebDatasetReader r(shard);
  Sample s;
  const std::string err = error_of([&] { r.next(s); });
  EXPECT_NE(err.find("shard " + shard +
                     ", member 000123.t5.bytes: 8388608 bytes, but json says "
                     "[256, 4096] bf16 = 2097152 bytes"),
            std::string::npos)
      << err;

  // Without a json shape an unknown field cannot be decoded, and the message says what to add.
  {
    TarWriter w(shard);
    w.add("000124.foo.bytes", std::string(8, '\0'));
    w.finish();
  }
  WebDatasetReader r2(shard);
  const std::string err2 = error_of([&] { r2.next(s); });
  EXPECT_NE(err2.find("member 000124.foo.bytes"), std::string::npos) << err2;
  EXPECT_NE(err2.find("\"shapes\""), std::string::npos) << err2;
}

TEST(WebDatasetTest, SafetensorsMembersAndAliases) {
  TempDir tmp;
  const std::vector<float> lat = {1, 2, 3, 4}, pe = {5, 6}, ppe = {7};
  {
    SafetensorsWriter one;
    one.add("whatever", DType::f32, {2, 2}, lat.data());
    one.write(tmp.path("one.safetensors"));
    SafetensorsWriter both;
    both.add_f32_as("prompt_embeds", {1, 2}, pe.data(), DType::bf16);
    both.add("pooled_prompt_embeds", DType::f32, {1}, ppe.data());
    both.write(tmp.path("both.safetensors"));
    TarWriter w(tmp.path("st.tar"));
    w.add("p.latents.safetensors", read_bytes(tmp.path("one.safetensors")));
    w.add("p.safetensors", read_bytes(tmp.path("both.safetensors")));  // every tensor a field
    w.add("q.latents.safetensors", read_bytes(tmp.path("both.safetensors")));
    w.finish();
  }
  WebDatasetReader r(tmp.path("st.tar"));
  Sample s;
  ASSERT_TRUE(r.next(s));
  EXPECT_EQ(s.at("latent").data, lat);
  EXPECT_EQ(s.at("latent").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(s.at("t5").data, pe);
  EXPECT_EQ(s.at("clip").data, ppe);
  EXPECT_FALSE(s.has("latents"));
  const std::string err = error_of([&] { r.next(s); });
  EXPECT_NE(err.find("member q.latents.safetensors"), std::string::npos) << err;
  EXPECT_NE(err.find("none is named 'latents'"), std::string::npos) << err;
}

TEST(WebDatasetTest, DuplicateFieldViaAliasIsAnError) {
  TempDir tmp;
  {
    TarWriter w(tmp.path("d.tar"));
    w.add("k.t5.npy", npy_f32({1}, {1}));
    w.add("k.prompt_embeds.npy", npy_f32({1}, {2}));
    w.finish();
  }
  WebDatasetReader r(tmp.path("d.tar"));
  Sample s;
  const std::string err = error_of([&] { r.next(s); });
  EXPECT_NE(err.find("field 't5' is already given by member k.t5.npy"), std::string::npos) << err;
}

// ---------------------------------------------------------------------------------------------
// Loader

namespace {

// `shards` shards of `per_shard` samples; sample g (global id) has key "%06d" and t5 = [g].
std::vector<std::string> write_dataset(const TempDir& tmp, int shards, int per_shard) {
  std::vector<std::string> paths;
  for (int s = 0; s < shards; ++s) {
    paths.push_back(tmp.path(fmt::format("train-{:06d}.tar", s)));
    TarWriter w(paths.back());
    for (int i = 0; i < per_shard; ++i) {
      const int g = s * per_shard + i;
      w.add(fmt::format("{:06d}.t5.npy", g), npy_f32({1}, {static_cast<float>(g)}));
      w.add(fmt::format("{:06d}.txt", g), fmt::format("sample {}", g));
    }
    w.finish();
  }
  return paths;
}

std::vector<int> take(DataLoader& loader, size_t n, int sleep_every = 0) {
  std::vector<int> out;
  Sample s;
  for (size_t i = 0; i < n; ++i) {
    if (!loader.next(s)) break;
    out.push_back(static_cast<int>(s.at("t5").data[0]));
    EXPECT_EQ(s.key, fmt::format("{:06d}", out.back()));
    if (sleep_every > 0 && i % sleep_every == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return out;
}

LoaderOptions options_for(const TempDir& tmp) {
  LoaderOptions o;
  o.source = tmp.path("train-*.tar");
  o.seed = 1234;
  o.shuffle_buffer = 7;
  o.prefetch = 4;
  return o;
}

}  // namespace

TEST(DataLoaderTest, ResolvesGlobListFileAndDirectory) {
  TempDir tmp;
  const std::vector<std::string> paths = write_dataset(tmp, 3, 1);
  EXPECT_EQ(resolve_shards(tmp.path("train-*.tar")), paths);
  EXPECT_EQ(resolve_shards(tmp.path("")), paths);  // the directory
  write_bytes(tmp.path("list.txt"), "# shards\ntrain-000002.tar\n\ntrain-000000.tar\n");
  EXPECT_EQ(resolve_shards(tmp.path("list.txt")), (std::vector<std::string>{paths[0], paths[2]}));
  write_bytes(tmp.path("bad.txt"), "train-000009.tar\n");
  std::string err = error_of([&] { resolve_shards(tmp.path("bad.txt")); });
  EXPECT_NE(err.find("line 1"), std::string::npos) << err;
  err = error_of([&] { resolve_shards(tmp.path("val-*.tar")); });
  EXPECT_NE(err.find("names no .tar shards"), std::string::npos) << err;
}

TEST(DataLoaderTest, SameSeedSameSequenceWhateverTheTiming) {
  TempDir tmp;
  write_dataset(tmp, 5, 9);
  LoaderOptions a = options_for(tmp), b = options_for(tmp);
  b.prefetch = 1;
  a.prefetch = 64;
  DataLoader la(a), lb(b);
  const std::vector<int> sa = take(la, 120);  // more than two epochs of 45
  const std::vector<int> sb = take(lb, 120, 7);
  EXPECT_EQ(sa, sb);
  EXPECT_EQ(la.state(), (LoaderState{2, 30}));
  LoaderOptions c = options_for(tmp);
  c.seed = 99;
  DataLoader lc(c);
  EXPECT_NE(take(lc, 45), std::vector<int>(sa.begin(), sa.begin() + 45));
}

TEST(DataLoaderTest, EpochIsAPermutationAndEpochsDiffer) {
  TempDir tmp;
  write_dataset(tmp, 6, 10);
  DataLoader l(options_for(tmp));
  const std::vector<int> e0 = take(l, 60), e1 = take(l, 60);
  std::vector<int> all(60);
  std::iota(all.begin(), all.end(), 0);
  std::vector<int> s0 = e0, s1 = e1;
  std::sort(s0.begin(), s0.end());
  std::sort(s1.begin(), s1.end());
  EXPECT_EQ(s0, all);
  EXPECT_EQ(s1, all);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, all);  // shuffled at all
}

TEST(DataLoaderTest, RankShardingIsDisjointAndCovering) {
  TempDir tmp;
  write_dataset(tmp, 7, 4);
  for (uint64_t epoch = 0; epoch < 2; ++epoch) {
    std::multiset<int> seen;
    for (int rank = 0; rank < 3; ++rank) {
      LoaderOptions o = options_for(tmp);
      o.rank = rank;
      o.world = 3;
      DataLoader l(o, LoaderState{epoch, 0});
      const size_t n = epoch_shards(l.shards(), o.seed, epoch, rank, 3, true).size() * 4;
      for (int g : take(l, n)) seen.insert(g);
      EXPECT_EQ(l.state(), (LoaderState{epoch, n}));
    }
    EXPECT_EQ(seen.size(), 28u);
    EXPECT_EQ(std::set<int>(seen.begin(), seen.end()).size(), 28u);
  }
  LoaderOptions o = options_for(tmp);
  o.world = 8;
  const std::string err = error_of([&] { DataLoader l(o); });
  EXPECT_NE(err.find("7 shards for 8 data-parallel ranks"), std::string::npos) << err;
}

TEST(DataLoaderTest, ResumeFromStateReproducesTheSequence) {
  TempDir tmp;
  write_dataset(tmp, 4, 8);  // 32 samples per epoch
  LoaderOptions o = options_for(tmp);
  DataLoader ref(o);
  const std::vector<int> expected = take(ref, 100);
  for (size_t cut : {0u, 1u, 5u, 20u, 31u, 32u, 33u, 70u}) {
    DataLoader first(o);
    const std::vector<int> head = take(first, cut);
    const LoaderState st = first.state();
    DataLoader resumed(o, st);
    std::vector<int> joined = head;
    for (int g : take(resumed, 100 - cut)) joined.push_back(g);
    EXPECT_EQ(joined, expected) << "cut at " << cut << " (epoch " << st.epoch << ", consumed " << st.consumed << ")";
    // reset() on a running loader does the same.
    first.reset(LoaderState{0, 3});
    EXPECT_EQ(take(first, 10), std::vector<int>(expected.begin() + 3, expected.begin() + 13));
  }
  const std::string err = error_of([&] {
    DataLoader bad(o, LoaderState{0, 40});
    Sample s;
    bad.next(s);
  });
  EXPECT_NE(err.find("only 32"), std::string::npos) << err;
}

TEST(DataLoaderTest, SinglePassReadsSortedShardsOnceInOrder) {
  TempDir tmp;
  write_dataset(tmp, 4, 3);
  LoaderOptions o = options_for(tmp);
  o.single_pass = true;
  o.rank = 1;
  o.world = 2;
  DataLoader l(o);
  EXPECT_EQ(take(l, 100), (std::vector<int>{3, 4, 5, 9, 10, 11}));
  Sample s;
  EXPECT_FALSE(l.next(s));
  EXPECT_NE(error_of([&] { l.next(); }).find("single pass"), std::string::npos);
  l.reset(LoaderState{0, 4});
  EXPECT_EQ(take(l, 100), (std::vector<int>{10, 11}));
}

TEST(DataLoaderTest, SkipCorruptCountsAndContinues) {
  TempDir tmp;
  const std::vector<std::string> paths = write_dataset(tmp, 3, 5);
  // Shard 1: cut inside the data of its fourth sample's first member.
  {
    TarReader r(paths[1]);
    TarMember m;
    for (int i = 0; i < 7; ++i) ASSERT_TRUE(r.next(m));
    ASSERT_EQ(m.name, "000008.t5.npy");
    const std::string bytes = read_bytes(paths[1]);
    write_bytes(paths[1], bytes.substr(0, m.data_offset));
  }
  LoaderOptions o = options_for(tmp);
  o.skip_corrupt = true;
  DataLoader l(o);
  ::testing::internal::CaptureStderr();
  // 5 + 2 + 5 samples: the truncated header is found while looking for the end of sample
  // 000007, which is dropped with it (the reader cannot tell whether it was complete).
  const std::vector<int> e0 = take(l, 12);
  std::vector<int> sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 10, 11, 12, 13, 14}));
  EXPECT_GE(l.corrupt_skipped(), 1u);
  const std::vector<int> e1 = take(l, 12);
  const std::string warnings = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(l.state(), (LoaderState{1, 12}));
  // Once per epoch; the reader may already have met it again in epoch 2 while reading ahead.
  EXPECT_GE(l.corrupt_skipped(), 2u);
  EXPECT_LE(l.corrupt_skipped(), 3u);
  EXPECT_NE(warnings.find(paths[1]), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("000008.t5.npy"), std::string::npos) << warnings;

  // Resuming inside an epoch with a corrupt shard still reproduces the sequence.
  ::testing::internal::CaptureStderr();
  {
    DataLoader resumed(o, LoaderState{0, 6});
    EXPECT_EQ(take(resumed, 6), std::vector<int>(e0.begin() + 6, e0.end()));
  }
  // A single pass meets it exactly once.
  o.single_pass = true;
  {
    DataLoader once(o);
    EXPECT_EQ(take(once, 100).size(), 12u);
    EXPECT_EQ(once.corrupt_skipped(), 1u);
  }
  ::testing::internal::GetCapturedStderr();
}

TEST(DataLoaderTest, ErrorsPropagateFromTheReaderThread) {
  TempDir tmp;
  const std::vector<std::string> paths = write_dataset(tmp, 2, 4);
  std::string bytes = read_bytes(paths[0]);
  bytes[3 * 1024 + 10] ^= 0x20;  // the header of 000001.txt, sample 1's second member
  write_bytes(paths[0], bytes);
  LoaderOptions o = options_for(tmp);
  o.single_pass = true;
  DataLoader l(o);
  Sample s;
  ASSERT_TRUE(l.next(s));  // sample 000000 was read before the fault
  EXPECT_EQ(s.key, "000000");
  const std::string err = error_of([&] { l.next(s); });
  EXPECT_NE(err.find("shard " + paths[0]), std::string::npos) << err;
  EXPECT_NE(err.find("checksum"), std::string::npos) << err;
  // The error stays: the stream cannot continue past it.
  EXPECT_FALSE(error_of([&] { l.next(s); }).empty());
}

TEST(DataLoaderTest, DestructorJoinsAReaderBlockedOnAFullQueue) {
  TempDir tmp;
  write_dataset(tmp, 2, 50);
  LoaderOptions o = options_for(tmp);
  o.prefetch = 1;
  for (int i = 0; i < 5; ++i) {
    DataLoader l(o);
    if (i % 2) take(l, 3);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // let it fill the queue
  }  // each destructor must return (a hang fails the test by timeout)
}

// Decoding over several threads (runs of 8 samples read in order, decoded side by side) gives
// the sequence of one thread: across epochs, from a resume point, with a sample that fails to
// decode (skip_corrupt: that sample alone goes; without: the same samples, then the error)
// and with a truncated shard.
TEST(DataLoaderTest, DecodeThreadsChangeNothing) {
  TempDir tmp;
  const std::vector<std::string> paths = write_dataset(tmp, 4, 11);  // runs of 8 end mid-shard
  // Shard 2's sample 27 (its sixth) holds a .npy member that is not one: a decode error.
  {
    TarWriter w(paths[2]);
    for (int g = 22; g < 33; ++g) {
      w.add(fmt::format("{:06d}.t5.npy", g), g == 27 ? std::string("not an array") : npy_f32({1}, {float(g)}));
      w.add(fmt::format("{:06d}.txt", g), fmt::format("sample {}", g));
    }
    w.finish();
  }
  // Shard 3 cut inside its fifth sample's data: a read error in the first run, after three
  // samples (the fourth goes with the cut: the reader cannot tell whether it was complete).
  {
    TarReader r(paths[3]);
    TarMember m;
    for (int i = 0; i < 9; ++i) ASSERT_TRUE(r.next(m));
    ASSERT_EQ(m.name, "000037.t5.npy");
    write_bytes(paths[3], read_bytes(paths[3]).substr(0, m.data_offset));
  }
  auto sequence = [&](int threads, bool skip_corrupt, LoaderState start, size_t n, std::string* error) {
    LoaderOptions o = options_for(tmp);
    o.decode_threads = threads;
    o.skip_corrupt = skip_corrupt;
    std::vector<int> got;
    ::testing::internal::CaptureStderr();
    try {
      DataLoader l(o, start);
      Sample s;
      for (size_t i = 0; i < n && l.next(s); ++i) got.push_back(static_cast<int>(s.at("t5").data[0]));
    } catch (const Error& e) {
      *error = e.what();
    }
    ::testing::internal::GetCapturedStderr();
    return got;
  };
  std::string err1;
  const std::vector<int> one = sequence(1, true, {}, 100, &err1);
  EXPECT_TRUE(err1.empty()) << err1;
  ASSERT_EQ(one.size(), 100u);
  EXPECT_EQ(std::count(one.begin(), one.end(), 27), 0);  // it never decodes
  EXPECT_GE(std::count(one.begin(), one.end(), 32), 2);  // the rest of its shard does, every epoch
  // The positions after 13 and 50 samples (the second in epoch 1): a resumed loader, which
  // replays what came before without decoding it, continues exactly where the run was.
  std::vector<LoaderState> states;
  {
    LoaderOptions o = options_for(tmp);
    o.decode_threads = 1;
    o.skip_corrupt = true;
    ::testing::internal::CaptureStderr();
    DataLoader l(o);
    take(l, 13);
    states.push_back(l.state());
    take(l, 37);
    states.push_back(l.state());
    ::testing::internal::GetCapturedStderr();
  }
  EXPECT_EQ(states[1].epoch, 1u);
  for (const int threads : {1, 2, 3}) {
    SCOPED_TRACE(threads);
    std::string err;
    if (threads > 1) EXPECT_EQ(sequence(threads, true, {}, 100, &err), one);
    EXPECT_TRUE(err.empty()) << err;
    EXPECT_EQ(sequence(threads, true, states[0], 60, &err), std::vector<int>(one.begin() + 13, one.begin() + 73));
    EXPECT_EQ(sequence(threads, true, states[1], 50, &err), std::vector<int>(one.begin() + 50, one.end()));
    std::string err_one, err_many;
    const std::vector<int> strict_one = sequence(1, false, {}, 100, &err_one);
    EXPECT_EQ(sequence(threads, false, {}, 100, &err_many), strict_one);
    EXPECT_FALSE(err_one.empty());
    EXPECT_EQ(err_many, err_one);
  }
}
