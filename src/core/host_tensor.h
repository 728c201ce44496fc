#pragma once
// A tensor in host memory as f32 values with its shape: what the data pipeline decodes, the
// sampler returns and the image writers read.
#include <cstdint>
#include <vector>

namespace flux8 {

struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

}  // namespace flux8
