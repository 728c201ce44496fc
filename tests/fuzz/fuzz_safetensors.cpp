// libFuzzer target: a safetensors file (8-byte header length, JSON header, data), opened from a
// file (the mmap path) and from memory (a WebDataset member), every tensor then converted.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "fuzz_input.h"
#include "io/safetensors.h"

namespace {

// Converts every tensor the reader accepted. The reader validated each tensor's bytes against
// its shape, so numel elements fit in the file: a tensor whose count exceeds its bytes passed
// validation wrongly (a wrapped product), and converting it would read past the data.
void convert_all(const flux8::SafetensorsReader& reader) {
  for (const std::string& name : reader.names()) {
    const flux8::SafetensorsTensor& t = reader.tensor(name);
    const int64_t n = t.numel();
    if (n < 0 || static_cast<uint64_t>(n) > t.nbytes) {
      std::fprintf(stderr, "finding: tensor '%s' accepted with %lld elements in %zu bytes\n", name.c_str(),
                   static_cast<long long>(n), t.nbytes);
      std::abort();
    }
    flux8::fuzz::expect_only_input_errors([&] {
      std::vector<float> f32(static_cast<size_t>(n));
      reader.read_f32(name, f32.data(), t.shape);
    });
    flux8::fuzz::expect_only_input_errors([&] {
      std::vector<double> f64(static_cast<size_t>(n));
      reader.read_f64(name, f64.data());
    });
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static flux8::fuzz::MemFile file("fuzz.safetensors");
  file.assign(data, size);
  flux8::fuzz::expect_only_input_errors([&] { convert_all(flux8::SafetensorsReader(file.path())); });
  flux8::fuzz::expect_only_input_errors(
      [&] { convert_all(flux8::SafetensorsReader(std::vector<uint8_t>(data, data + size), "fuzz member")); });
  return 0;
}
