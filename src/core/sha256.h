#pragma once
// SHA-256 (FIPS 180-4). Checkpoint manifests record one digest per file so that a truncated,
// altered or bit-rotted file is refused before it is trained on.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace flux8 {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t bytes);
  void update(std::string_view s) { update(s.data(), s.size()); }
  // Pads, returns the digest and leaves the object unusable until reset().
  std::array<uint8_t, 32> finish();
  std::string hex_digest();  // finish() as 64 lowercase hex digits
  void reset();

 private:
  void compress(const uint8_t block[64]);
  std::array<uint32_t, 8> h_;
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

std::string sha256_hex(std::string_view data);
// Streams the file; fails naming the path if it cannot be read.
std::string sha256_file(const std::string& path);

}  // namespace flux8
