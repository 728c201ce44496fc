#include "core/parallel_copy.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace flux8 {

void parallel_copy(void* dst, const void* src, size_t n, int threads) {
  constexpr size_t kPiece = size_t(1) << 20;
  const int team = std::min(threads, omp_get_max_threads());
  if (n < 4 * kPiece || team < 2) {
    if (n) std::memcpy(dst, src, n);
    return;
  }
  const int64_t pieces = static_cast<int64_t>((n + kPiece - 1) / kPiece);
  char* out = static_cast<char*>(dst);
  const char* in = static_cast<const char*>(src);
#pragma omp parallel for num_threads(team) schedule(static)
  for (int64_t p = 0; p < pieces; ++p) {
    const size_t begin = static_cast<size_t>(p) * kPiece;
    std::memcpy(out + begin, in + begin, std::min(kPiece, n - begin));
  }
}

}  // namespace flux8
