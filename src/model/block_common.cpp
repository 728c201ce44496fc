#include "model/block_common.h"

namespace flux8 {

ScaleParam ScaleParam::bind(const ParamStore& store, const std::string& name) {
  return {store.param(name), store.grad(name)};
}

}  // namespace flux8
