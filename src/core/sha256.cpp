#include "core/sha256.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/error.h"

namespace flux8 {

namespace {

// First 32 bits of the fractional parts of the cube roots of the first 64 primes.
constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// First 32 bits of the fractional parts of the square roots of the first 8 primes.
constexpr std::array<uint32_t, 8> kInitial = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                              0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

inline uint32_t load_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

}  // namespace

Sha256::Sha256() { reset(); }

void Sha256::reset() {
  h_ = kInitial;
  buffered_ = 0;
  total_bytes_ = 0;
}

namespace sha256_blocks {

void portable(uint32_t state[8], const uint8_t* data, size_t blocks) {
  for (; blocks > 0; --blocks, data += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) w[i] = load_be32(data + 4 * i);
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
  }
}

#if defined(__x86_64__)
bool hardware_available() {
  static const bool available =
      __builtin_cpu_supports("sha") && __builtin_cpu_supports("sse4.1") && __builtin_cpu_supports("ssse3");
  return available;
}

// The SHA extensions keep the state as two vectors, {a, b, e, f} and {c, d, g, h} (highest lane
// first), and run two rounds an instruction from the message words plus round constants in the
// low half of a third. The message schedule's σ0 and σ1 parts are sha256msg1 and sha256msg2.
__attribute__((target("sha,sse4.1,ssse3"))) void hardware_blocks(uint32_t state[8], const uint8_t* data,
                                                                 size_t blocks) {
  // Lanes hold dwords little-endian: dword 0 is the lowest.
  const __m128i abcd = _mm_loadu_si128(reinterpret_cast<const __m128i*>(state));
  const __m128i efgh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(state + 4));
  const __m128i badc = _mm_shuffle_epi32(abcd, 0xB1);  // lanes b a d c
  const __m128i hgfe = _mm_shuffle_epi32(efgh, 0x1B);  // lanes h g f e
  __m128i abef = _mm_alignr_epi8(badc, hgfe, 8);       // lanes f e b a
  __m128i cdgh = _mm_blend_epi16(hgfe, badc, 0xF0);    // lanes h g d c
  // Big-endian message words: reverse the bytes of each dword.
  const __m128i swap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
  for (; blocks > 0; --blocks, data += 64) {
    const __m128i abef_in = abef, cdgh_in = cdgh;
    __m128i w[4];
    for (int j = 0; j < 16; ++j) {
      __m128i& x = w[j % 4];
      if (j < 4) {
        x = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 16 * j)), swap);
      } else {
        // W[t] = σ1(W[t−2]) + W[t−7] + σ0(W[t−15]) + W[t−16] for the group's four words t.
        const __m128i& prev1 = w[(j + 3) % 4];  // words of group j − 1
        const __m128i& prev2 = w[(j + 2) % 4];  // group j − 2
        const __m128i& prev3 = w[(j + 1) % 4];  // group j − 3
        const __m128i partial = _mm_add_epi32(_mm_sha256msg1_epu32(x, prev3), _mm_alignr_epi8(prev1, prev2, 4));
        x = _mm_sha256msg2_epu32(partial, prev1);
      }
      const __m128i wk = _mm_add_epi32(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(kRound + 4 * j)));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, wk);                           // rounds 4j, 4j + 1
      abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(wk, 0x0E));  // rounds 4j + 2, 4j + 3
    }
    abef = _mm_add_epi32(abef, abef_in);
    cdgh = _mm_add_epi32(cdgh, cdgh_in);
  }
  const __m128i feba = _mm_shuffle_epi32(abef, 0x1B);  // lanes a b e f
  const __m128i dchg = _mm_shuffle_epi32(cdgh, 0xB1);  // lanes g h c d
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state), _mm_blend_epi16(feba, dchg, 0xF0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), _mm_alignr_epi8(dchg, feba, 8));
}

void hardware(uint32_t state[8], const uint8_t* data, size_t blocks) {
  FLUX8_CHECK(hardware_available(), "sha256: this CPU has no SHA extensions");
  hardware_blocks(state, data, blocks);
}
#else
bool hardware_available() { return false; }
void hardware(uint32_t*, const uint8_t*, size_t) { fail("sha256: SHA extensions are x86-only"); }
#endif

}  // namespace sha256_blocks

namespace {
void compress(std::array<uint32_t, 8>& h, const uint8_t* data, size_t blocks) {
  if (sha256_blocks::hardware_available())
    sha256_blocks::hardware(h.data(), data, blocks);
  else
    sha256_blocks::portable(h.data(), data, blocks);
}
}  // namespace

void Sha256::update(const void* data, size_t bytes) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_bytes_ += bytes;
  if (buffered_ > 0) {
    const size_t take = std::min(bytes, 64 - buffered_);
    std::memcpy(buffer_ + buffered_, p, take);
    buffered_ += take;
    p += take;
    bytes -= take;
    if (buffered_ < 64) return;
    compress(h_, buffer_, 1);
    buffered_ = 0;
  }
  const size_t blocks = bytes / 64;
  if (blocks) compress(h_, p, blocks);
  p += 64 * blocks;
  bytes -= 64 * blocks;
  std::memcpy(buffer_, p, bytes);
  buffered_ = bytes;
}

std::array<uint8_t, 32> Sha256::finish() {
  // Message, a 1 bit, zeros up to 56 mod 64 bytes, then the length in bits (big-endian).
  const uint64_t bits = total_bytes_ * 8;
  uint8_t pad[72] = {0x80};
  const size_t zeros = (buffered_ < 56 ? 56 : 120) - buffered_;
  for (int i = 0; i < 8; ++i) pad[zeros + i] = static_cast<uint8_t>(bits >> (56 - 8 * i));
  update(pad, zeros + 8);
  FLUX8_CHECK(buffered_ == 0, "sha256 padding left {} bytes", buffered_);
  std::array<uint8_t, 32> out;
  for (int i = 0; i < 8; ++i)
    for (int j = 0; j < 4; ++j) out[4 * i + j] = static_cast<uint8_t>(h_[i] >> (24 - 8 * j));
  return out;
}

std::string Sha256::hex_digest() {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s;
  for (uint8_t b : finish()) {
    s.push_back(kHex[b >> 4]);
    s.push_back(kHex[b & 15]);
  }
  return s;
}

std::string sha256_hex(std::string_view data) {
  Sha256 h;
  h.update(data);
  return h.hex_digest();
}

namespace {
// The digest of the file's bytes from `offset`: `bytes` of them, or all to its end when
// `bytes` is unset. pread, so that pieces of one file can be hashed side by side.
std::string hash_file(const std::string& path, uint64_t offset, std::optional<uint64_t> bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open '{}' to checksum it: {}", path, std::strerror(errno));
  Sha256 h;
  std::vector<uint8_t> chunk(std::min<uint64_t>(bytes.value_or(UINT64_MAX), 4 << 20));
  for (uint64_t done = 0; !bytes || done < *bytes;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(chunk.size(), bytes.value_or(UINT64_MAX) - done));
    const ssize_t n = ::pread(fd, chunk.data(), want, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && !bytes) break;  // the end of the file
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      if (!bytes) fail("cannot read '{}' to checksum it: {}", path, std::strerror(err));
      fail("cannot read bytes [{}, {}) of '{}' to checksum them: {}", offset + done, offset + *bytes, path,
           n == 0 ? "the file ends before them" : std::strerror(err));
    }
    h.update(chunk.data(), static_cast<size_t>(n));
    done += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return h.hex_digest();
}
}  // namespace

std::string sha256_file(const std::string& path) { return hash_file(path, 0, std::nullopt); }

std::string sha256_file_range(const std::string& path, uint64_t offset, uint64_t bytes) {
  return hash_file(path, offset, bytes);
}

}  // namespace flux8
