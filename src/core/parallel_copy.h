#pragma once
// memcpy over several threads for large host copies: one thread is too slow to stage the trainer's
// 134 MB of W1 text features a step into pinned memory beside the GPU's step; split into pieces
// over a few threads the copy runs at the memory's pace (docs/PERFORMANCE.md).
#include <cstddef>

namespace flux8 {

// Copies n bytes from src to dst (not overlapping); at least 4 MiB go over up to `threads`
// OpenMP threads in 1 MiB pieces, smaller copies are one memcpy.
void parallel_copy(void* dst, const void* src, size_t n, int threads = 8);

}  // namespace flux8
