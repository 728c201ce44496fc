#include "backend/registry.h"

#include <string_view>
#include <utility>

#include "core/error.h"

namespace flux8 {

namespace {

// A function-local static: registrations run during static initialisation, in any order.
std::vector<BackendEntry>& entries() {
  static std::vector<BackendEntry> all;
  return all;
}

const BackendEntry* find_backend(std::string_view name) {
  for (const BackendEntry& e : entries())
    if (e.name == name) return &e;
  return nullptr;
}

std::string registered_names() {
  std::string names;
  for (const BackendEntry& e : entries()) names += (names.empty() ? "'" : ", '") + e.name + "'";
  return names;
}

}  // namespace

void register_backend(BackendEntry entry) {
  if (!entry.create || !entry.unavailable_reason)
    fail("backend '{}' registered without a create or an unavailable_reason function", entry.name);
  if (find_backend(entry.name)) fail("backend '{}' registered twice", entry.name);
  entries().push_back(std::move(entry));
}

const std::vector<BackendEntry>& registered_backends() { return entries(); }

std::unique_ptr<Backend> make_backend(std::string_view name, const BackendOptions& options) {
  if (name == "auto") {
    const BackendEntry* best = nullptr;
    for (const BackendEntry& e : entries())
      if ((!best || e.auto_preference > best->auto_preference) && e.unavailable_reason().empty()) best = &e;
    if (!best) fail("backend 'auto': no backend of this build can run here (registered: {})", registered_names());
    return best->create(options);
  }
  if (const BackendEntry* e = find_backend(name)) return e->create(options);
  if (name == "cuda")
    fail(
        "backend 'cuda': this build of flux8 has no CUDA backend (configured without nvcc); use backend: cpu, or "
        "rebuild with CUDA (README: GPU builds)");
  fail("unknown backend '{}': choose 'cpu', 'cuda' or 'auto'", name);
}

}  // namespace flux8
