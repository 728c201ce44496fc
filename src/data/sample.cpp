#include "data/sample.h"

#include "core/error.h"

namespace flux8 {

const HostTensor& Sample::at(const std::string& field) const {
  auto it = fields.find(field);
  if (it == fields.end()) {
    std::string have;
    for (const auto& [name, t] : fields) have += (have.empty() ? "" : ", ") + name;
    fail(
        "sample '{}' from shard {} has no field '{}' (it has: {}); check the shard's member "
        "names (KEY.{}.npy / .bytes / .safetensors)",
        key, shard, field, have.empty() ? std::string("none") : have, field);
  }
  return it->second;
}

}  // namespace flux8
