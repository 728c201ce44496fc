// libFuzzer target: a tar shard read as WebDataset samples, twice: skipping every sample (the
// header-only path) and decoding every sample. A decode error moves on to the next sample as
// data_skip_corrupt does; a structural error of the tar ends the shard.
#include <cstdint>

#include "data/webdataset.h"
#include "fuzz_input.h"

namespace {

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
  shard.assign(data, size);
  flux8::fuzz::expect_only_input_errors([&] { skip_all(shard.path()); });
  flux8::fuzz::expect_only_input_errors([&] { decode_all(shard.path()); });
  return 0;
}
