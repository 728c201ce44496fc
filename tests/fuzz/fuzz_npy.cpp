// libFuzzer target: a NumPy .npy image (magic, version, header dict, data) as a WebDataset
// member holds it, decoded as a .npy field and as a .bytes field whose '<u2' means bf16.
#include <cstdint>
#include <string>

#include "data/webdataset.h"
#include "fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string where = "shard fuzz.tar, member 0.x.npy";
  for (bool u2_is_bf16 : {false, true})
    flux8::fuzz::expect_only_input_errors([&] { (void)flux8::decode_npy(data, size, where, u2_is_bf16); });
  return 0;
}
