#pragma once
// memcpy over several threads for large host copies: one thread moves ~5-10 GB/s, so the
// trainer's 134 MB of W1 text features a step took ~20 ms to stage into pinned memory on the
// H200's host; split into pieces over a few threads the copy runs at the memory's pace.
#include <cstddef>

namespace flux8 {

// Copies n bytes from src to dst (not overlapping); at least 4 MiB go over up to `threads`
// OpenMP threads in 1 MiB pieces, smaller copies are one memcpy.
void parallel_copy(void* dst, const void* src, size_t n, int threads = 8);

}  // namespace flux8
