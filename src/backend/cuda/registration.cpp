// The CUDA backend in the registry (backend/registry.h): `backend: auto` prefers it wherever a
// GPU this build can use is present.
#include "backend/cuda/factory.h"
#include "backend/registry.h"

namespace flux8 {

namespace {

const BackendRegistration cuda_registration{BackendEntry{
    .name = "cuda",
    .create = make_cuda_backend,
    .unavailable_reason = cuda_unavailable_reason,
    .auto_preference = 1,
}};

}  // namespace

}  // namespace flux8
