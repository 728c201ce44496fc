// libFuzzer target: a tar shard read as WebDataset samples, twice: skipping every sample (the
// header-only path) and decoding every sample. A decode error moves on to the next sample as
// data_skip_corrupt does; a structural error of the tar ends the shard. The shard is read as
// given and, when that differs, once more with every header's checksum made valid: a mutation
// of a header almost never keeps its checksum right, and without the repair the fuzzer would
// seldom get past the checksum test to the size, name and pax fields behind it.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "data/webdataset.h"
#include "fuzz_input.h"

namespace {

constexpr size_t kBlock = 512;

// The member's size as the header's size field [124, 136) gives it: GNU base-256 (top bit set,
// low 8 bytes taken) or octal text.
uint64_t header_size(const uint8_t* h) {
  uint64_t size = 0;
  if (h[124] & 0x80) {
    for (size_t i = 128; i < 136; ++i) size = size << 8 | h[i];
    return size;
  }
  size_t i = 124;
  while (i < 136 && h[i] == ' ') ++i;
  for (; i < 136 && h[i] >= '0' && h[i] <= '7'; ++i) size = size * 8 + static_cast<uint64_t>(h[i] - '0');
  return size;
}

// The shard with the checksum of each header block, found by walking member sizes, rewritten
// (six octal digits, NUL, space, over the chksum field [148, 156) counted as spaces).
std::vector<uint8_t> with_valid_checksums(const uint8_t* data, size_t size) {
  std::vector<uint8_t> out(data, data + size);
  for (uint64_t pos = 0; pos + kBlock <= out.size();) {
    uint8_t* h = out.data() + pos;
    if (std::all_of(h, h + kBlock, [](uint8_t b) { return b == 0; })) break;
    std::memset(h + 148, ' ', 8);
    unsigned sum = 0;
    for (size_t i = 0; i < kBlock; ++i) sum += h[i];
    char field[8];
    std::snprintf(field, sizeof field, "%06o", sum & 0777777u);
    std::memcpy(h + 148, field, 7);
    const uint64_t member = header_size(h);
    if (member > out.size()) break;
    pos += kBlock + (member + kBlock - 1) / kBlock * kBlock;
  }
  return out;
}

void skip_all(const std::string& path) {
  flux8::WebDatasetReader reader(path);
  while (reader.skip()) {
  }
}

void decode_all(const std::string& path) {
  flux8::WebDatasetReader reader(path);
  flux8::RawSample raw;
  while (reader.next_raw(raw, /*with_data=*/true))
    flux8::fuzz::expect_only_input_errors([&] { (void)flux8::decode_sample(raw); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static flux8::fuzz::MemFile shard("fuzz.tar");
  auto read_shard = [&](const uint8_t* bytes, size_t n) {
    shard.assign(bytes, n);
    flux8::fuzz::expect_only_input_errors([&] { skip_all(shard.path()); });
    flux8::fuzz::expect_only_input_errors([&] { decode_all(shard.path()); });
  };
  read_shard(data, size);
  const std::vector<uint8_t> repaired = with_valid_checksums(data, size);
  if (!std::equal(repaired.begin(), repaired.end(), data)) read_shard(repaired.data(), repaired.size());
  return 0;
}
