#include "backend/cuda/nvml.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <fmt/format.h>

namespace flux8::cuda {

// NVML's C interface, the few calls used (nvml.h's declarations, which the CUDA toolkit here
// does not ship): every call returns an nvmlReturn_t, 0 for success.
struct NvmlDevice::Api {
  using Device = struct nvmlDevice_st*;
  using Return = int;
  static constexpr int kClockSm = 1;  // NVML_CLOCK_SM

  void* lib = nullptr;
  bool initialised = false;  // nvmlInit succeeded: nvmlShutdown is owed
  Device device = nullptr;
  Return (*init)() = nullptr;
  Return (*shutdown)() = nullptr;
  const char* (*error_string)(Return) = nullptr;
  Return (*handle_by_pci_bus_id)(const char*, Device*) = nullptr;
  Return (*total_energy)(Device, unsigned long long*) = nullptr;    // mJ since the driver loaded
  Return (*enforced_power_limit)(Device, unsigned int*) = nullptr;  // mW
  Return (*clock_info)(Device, int, unsigned int*) = nullptr;       // MHz
  Return (*clock_reasons)(Device, unsigned long long*) = nullptr;

  ~Api() {
    if (initialised) shutdown();
    if (lib) dlclose(lib);
  }
  std::string error(Return r) const { return error_string ? error_string(r) : fmt::format("NVML error {}", r); }
};

namespace {

template <typename F>
bool bind(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  return f != nullptr;
}

}  // namespace

NvmlDevice::NvmlDevice(int cuda_device) : api_(std::make_unique<Api>()) {
  Api& a = *api_;
  a.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!a.lib) {
    why_ = fmt::format("NVML (libnvidia-ml.so.1, part of the NVIDIA driver) could not be loaded: {}", dlerror());
    return;
  }
  // The clocks-event reasons were "throttle reasons" before driver 535: either name will do.
  const bool bound = bind(a.lib, "nvmlInit_v2", a.init) && bind(a.lib, "nvmlShutdown", a.shutdown) &&
                     bind(a.lib, "nvmlErrorString", a.error_string) &&
                     bind(a.lib, "nvmlDeviceGetHandleByPciBusId_v2", a.handle_by_pci_bus_id) &&
                     bind(a.lib, "nvmlDeviceGetTotalEnergyConsumption", a.total_energy) &&
                     bind(a.lib, "nvmlDeviceGetEnforcedPowerLimit", a.enforced_power_limit) &&
                     bind(a.lib, "nvmlDeviceGetClockInfo", a.clock_info) &&
                     (bind(a.lib, "nvmlDeviceGetCurrentClocksEventReasons", a.clock_reasons) ||
                      bind(a.lib, "nvmlDeviceGetCurrentClocksThrottleReasons", a.clock_reasons));
  if (!bound) {
    why_ = "NVML lacks a function flux8 reads (driver too old?)";
    return;
  }
  if (const Api::Return r = a.init(); r != 0) {
    why_ = fmt::format("nvmlInit failed: {}", a.error(r));
    return;
  }
  a.initialised = true;
  char bus_id[32] = {};
  if (const cudaError_t e = cudaDeviceGetPCIBusId(bus_id, sizeof bus_id, cuda_device); e != cudaSuccess) {
    why_ = fmt::format("cudaDeviceGetPCIBusId({}) failed: {}", cuda_device, cudaGetErrorString(e));
    return;
  }
  if (const Api::Return r = a.handle_by_pci_bus_id(bus_id, &a.device); r != 0) {
    a.device = nullptr;
    why_ = fmt::format("NVML has no device at PCI bus id {}: {}", bus_id, a.error(r));
    return;
  }
  unsigned long long mj = 0;
  if (const Api::Return r = a.total_energy(a.device, &mj); r != 0)
    why_ = fmt::format("this GPU reports no energy counter (nvmlDeviceGetTotalEnergyConsumption: {})", a.error(r));
}

NvmlDevice::~NvmlDevice() = default;

PowerReading NvmlDevice::read() const {
  PowerReading p;
  if (!why_.empty()) {
    p.why = why_;
    return p;
  }
  const Api& a = *api_;
  unsigned long long mj = 0, reasons = 0;
  unsigned int limit_mw = 0, sm_mhz = 0;
  Api::Return r = a.total_energy(a.device, &mj);
  if (r == 0) r = a.enforced_power_limit(a.device, &limit_mw);
  if (r == 0) r = a.clock_info(a.device, Api::kClockSm, &sm_mhz);
  if (r == 0) r = a.clock_reasons(a.device, &reasons);
  if (r != 0) {
    p.why = fmt::format("an NVML reading failed: {}", a.error(r));
    return p;
  }
  p.available = true;
  p.energy_j = static_cast<double>(mj) / 1e3;
  p.power_limit_w = limit_mw / 1e3;
  p.sm_clock_mhz = sm_mhz;
  p.clock_reasons = reasons;
  return p;
}

}  // namespace flux8::cuda
