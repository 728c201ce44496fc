#pragma once
// Parameters live in one flat buffer (and gradients in a second one of the same layout);
// each tensor is a view with its Black Forest Labs Flux.1 state-dict name and shape, so
// checkpoints are the reference format. The layout is a pure function of the config, which
// lets `flux8 info` count a 12B model without allocating it.
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "model/flux_config.h"

namespace flux8 {

class Backend;

enum class ParamInit : uint8_t { xavier_uniform, normal_002, zeros, ones };

struct ParamInfo {
  std::string name;       // reference name, e.g. "double_blocks.0.img_attn.qkv.weight"
  Shape shape;
  int64_t offset = 0;     // elements from the start of the flat buffer
  ParamInit init = ParamInit::zeros;
  std::string component;  // "img_in", "double_blocks", ... (for per-component counts)
  bool block_linear = false;  // a weight of a double/single block Linear (the FP8 candidates)
};

class ParamLayout {
 public:
  static ParamLayout build(const FluxConfig& cfg);

  const std::vector<ParamInfo>& params() const { return params_; }
  int64_t total() const { return total_; }
  const ParamInfo* find(std::string_view name) const;
  const ParamInfo& at(std::string_view name) const;  // fails naming the tensor

 private:
  void add(std::string name, Shape shape, ParamInit init, std::string component,
           bool block_linear = false);
  void add_linear(const std::string& prefix, int64_t out, int64_t in, ParamInit init,
                  const std::string& component, bool bias, bool block_linear = false);
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, size_t> index_;
  int64_t total_ = 0;
};

// Owns the flat parameter and gradient buffers on a backend.
class ParamStore {
 public:
  ParamStore(const FluxConfig& cfg, Backend& backend, DType dtype);
  ~ParamStore();
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  const ParamLayout& layout() const { return layout_; }
  DType dtype() const { return dtype_; }
  Backend& backend() const { return backend_; }
  Tensor param(std::string_view name) const;
  Tensor grad(std::string_view name) const;
  Tensor flat_params() const;  // [total]
  Tensor flat_grads() const;

  // MLPerf-reference initialisation (DESIGN.md §2), from the counter-based RNG: the same
  // seed gives the same weights on every backend and thread count.
  void init(uint64_t seed);
  void zero_grads();

 private:
  ParamLayout layout_;
  Backend& backend_;
  DType dtype_;
  void* params_ = nullptr;
  void* grads_ = nullptr;
};

}  // namespace flux8
