#pragma once
// The backends a program holds. Each implementation library (backend/cpu, backend/cuda)
// registers itself with a static BackendRegistration; make_backend (backend.h) creates one by
// name. The build links those libraries whole into the executables (CMakeLists.txt), so the
// registrations are never dropped, and the layers above the backend interface create backends
// without depending on any implementation.
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace flux8 {

struct BackendEntry {
  std::string name;  // what `backend:` names: "cpu", "cuda"
  std::unique_ptr<Backend> (*create)(const BackendOptions& options) = nullptr;
  // "" when the backend can run on this machine, else why not.
  std::string (*unavailable_reason)() = nullptr;
  // `backend: auto` takes the backend of highest preference that can run here.
  int auto_preference = 0;
};

// Adds `entry`; a second entry of the same name is an error (two libraries claiming one name).
void register_backend(BackendEntry entry);
// Every registered backend, in registration order.
const std::vector<BackendEntry>& registered_backends();

struct BackendRegistration {
  explicit BackendRegistration(BackendEntry entry) { register_backend(std::move(entry)); }
};

}  // namespace flux8
