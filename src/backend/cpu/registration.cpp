// The CPU backend in the registry (backend/registry.h): always usable, the one `backend: auto`
// falls back to.
#include "backend/cpu/cpu_backend.h"
#include "backend/registry.h"

namespace flux8 {

namespace {

const BackendRegistration cpu_registration{BackendEntry{
    .name = "cpu",
    .create = [](const BackendOptions& o) -> std::unique_ptr<Backend> { return std::make_unique<CpuBackend>(o); },
    .unavailable_reason = [] { return std::string(); },
    .auto_preference = 0,
}};

}  // namespace

}  // namespace flux8
