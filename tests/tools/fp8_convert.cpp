// flux8_fp8_convert: runs src/fp8/format.h's conversions over raw little-endian arrays, so that
// tests/python/test_fp8_ml_dtypes.py can compare them bit for bit with ml_dtypes.
//
//   flux8_fp8_convert encode-f32  <e4m3|e5m2|e8m0> <in: f32[n]>  <out: u8[n]>
//   flux8_fp8_convert encode-bf16 <e4m3|e5m2|e8m0> <in: u16[n]>  <out: u8[n]>
//   flux8_fp8_convert decode      <e4m3|e5m2|e8m0> <in: u8[n]>   <out: f32[n]>
//
// encode-bf16 uses fp8_encode_bf16 (the bf16 path) for e4m3/e5m2 and e8m0_encode of the
// widened value for e8m0.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fp8/format.h"

namespace {

std::vector<char> read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "flux8_fp8_convert: cannot open input '%s'\n", path);
    std::exit(2);
  }
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_file(const char* path, const void* data, size_t bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!out) {
    std::fprintf(stderr, "flux8_fp8_convert: cannot write output '%s'\n", path);
    std::exit(2);
  }
}

int usage() {
  std::fprintf(stderr, "usage: flux8_fp8_convert <encode-f32|encode-bf16|decode> <e4m3|e5m2|e8m0> <in> <out>\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace flux8;
  if (argc != 5) return usage();
  const std::string op = argv[1], fmt = argv[2];
  const bool e8m0 = fmt == "e8m0";
  const std::optional<Fp8Format> f = parse_fp8_format(fmt);
  if (!e8m0 && !f) {
    std::fprintf(stderr, "flux8_fp8_convert: unknown format '%s' (expected e4m3, e5m2 or e8m0)\n", argv[2]);
    return 2;
  }
  const std::vector<char> in = read_file(argv[3]);
  if (op == "encode-f32" || op == "encode-bf16") {
    const size_t width = op == "encode-f32" ? 4 : 2;
    if (in.size() % width != 0) {
      std::fprintf(stderr, "flux8_fp8_convert: '%s' is %zu bytes, not a multiple of %zu\n", argv[3], in.size(), width);
      return 2;
    }
    std::vector<uint8_t> out(in.size() / width);
    for (size_t i = 0; i < out.size(); ++i) {
      if (width == 4) {
        float x;
        std::memcpy(&x, in.data() + 4 * i, 4);
        out[i] = e8m0 ? e8m0_encode(x) : fp8_encode(x, *f);
      } else {
        uint16_t b;
        std::memcpy(&b, in.data() + 2 * i, 2);
        out[i] = e8m0 ? e8m0_encode(bf16_bits_to_f32(b)) : fp8_encode_bf16(b, *f);
      }
    }
    write_file(argv[4], out.data(), out.size());
  } else if (op == "decode") {
    std::vector<float> out(in.size());
    for (size_t i = 0; i < out.size(); ++i) {
      const auto v = static_cast<uint8_t>(in[i]);
      out[i] = e8m0 ? e8m0_decode(v) : fp8_decode(v, *f);
    }
    write_file(argv[4], out.data(), out.size() * 4);
  } else {
    return usage();
  }
  return 0;
}
