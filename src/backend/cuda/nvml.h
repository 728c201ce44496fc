#pragma once
// The GPU's energy counter, power limit and clocks through NVML, the driver's management library,
// loaded at run time (dlopen of libnvidia-ml.so.1: it comes with the driver, not the toolkit, so
// flux8 links nothing of it and runs where it is absent). The device is the CUDA device of the
// backend, found by its PCI bus id.
#include <memory>
#include <string>

#include "backend/backend.h"  // PowerReading

namespace flux8::cuda {

class NvmlDevice {
 public:
  // The device `cuda_device` (a CUDA ordinal); never throws: a library, symbol or device that is
  // missing leaves every reading unavailable with the reason.
  explicit NvmlDevice(int cuda_device);
  ~NvmlDevice();
  NvmlDevice(const NvmlDevice&) = delete;
  NvmlDevice& operator=(const NvmlDevice&) = delete;

  PowerReading read() const;

 private:
  struct Api;
  std::unique_ptr<Api> api_;
  std::string why_;  // not empty: unavailable
};

}  // namespace flux8::cuda
