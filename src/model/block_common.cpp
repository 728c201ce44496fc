#include "model/block_common.h"

namespace flux8 {

LinearParams LinearParams::bind(const ParamStore& store, const std::string& prefix) {
  LinearParams p;
  p.w = store.param(prefix + ".weight");
  p.dw = store.grad(prefix + ".weight");
  if (store.layout().find(prefix + ".bias")) {
    p.b = store.param(prefix + ".bias");
    p.db = store.grad(prefix + ".bias");
  }
  return p;
}

ScaleParam ScaleParam::bind(const ParamStore& store, const std::string& name) {
  return {store.param(name), store.grad(name)};
}

}  // namespace flux8
