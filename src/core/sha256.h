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
  std::array<uint32_t, 8> h_;
  uint8_t buffer_[64];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

std::string sha256_hex(std::string_view data);

// The compression function over whole 64-byte blocks, two ways: portable C++, and with x86's
// SHA extensions (SHA-NI, several times faster — a 16 GB checkpoint is hashed when written and
// again when a run resumes). Sha256 uses the hardware one where the CPU has it.
namespace sha256_blocks {
void portable(uint32_t state[8], const uint8_t* data, size_t blocks);
bool hardware_available();
// Only where hardware_available(); else it fails.
void hardware(uint32_t state[8], const uint8_t* data, size_t blocks);
}  // namespace sha256_blocks
// Streams the file; fails naming the path if it cannot be read.
std::string sha256_file(const std::string& path);
// The digest of `bytes` bytes of the file from `offset` (one piece of a checkpoint file, read
// with pread so that pieces hash side by side); fails naming the path if the range cannot be
// read in full.
std::string sha256_file_range(const std::string& path, uint64_t offset, uint64_t bytes);

}  // namespace flux8
