#pragma once
// The peer `flux8 bench --peer FILE` compares against: the PyTorch way of training Flux
// (diffusers' FluxTransformer2DModel, fp32 master weights, bf16 autocast, fused AdamW; eager,
// torch.compile, and torchao float8 + compile) timed by tools/peer_bench.py, which writes FILE.
// A ratio is printed only where the peer ran on the device the bench runs on and at the run's
// shape: a step time from another GPU, or another shape, says nothing about this run.
#include <cstdint>
#include <string>
#include <vector>

#include "model/block_common.h"

namespace flux8 {

// One mode of the peer at one workload: its median step and peak allocated memory, or why it
// did not run (a library missing, no GPU for float8).
struct PeerMode {
  std::string mode;  // "eager", "compile", "torchao-fp8"
  bool ran = false;
  std::string why;  // not ran: the reason
  double median_ms = 0;
  double peak_gib = -1;  // < 0: not measured (the peer ran on the CPU)
  int64_t steps = 0;     // timed steps behind the median
};

struct PeerWorkload {
  std::string workload;  // "W1", "W2", or the model name of `flux8 bench -c`
  StepShape shape;
  std::vector<PeerMode> modes;
};

struct PeerFile {
  std::string path;
  std::string device;  // torch.cuda.get_device_name(), or cpu_device_name()'s form
  std::string torch_version, diffusers_version, torchao_version;  // "" where not installed
  std::vector<PeerWorkload> workloads;
};

// Reads tools/peer_bench.py's JSON; a file that cannot be read or lacks a key fails with the
// file's path and the key.
PeerFile load_peer_file(const std::string& path);
// The same from the file's text (`path` names it in errors).
PeerFile parse_peer_file(const std::string& text, const std::string& path);

// The device name of the CPU backend, as tools/peer_bench.py --tiny writes it: "cpu: " and the
// processor's model name from /proc/cpuinfo ("cpu" where there is none).
std::string cpu_device_name();
// The GPU's name in the "GPU 0" line of `flux8 check` ("NVIDIA H100 80GB HBM3, 79.1 GiB, 132 SMs"
// -> "NVIDIA H100 80GB HBM3"): the name torch.cuda.get_device_name() gives.
std::string gpu_name_of_check_line(const std::string& value);

// One flux8 run against each mode the peer ran: the peer's step time over flux8's (above 1:
// flux8 is faster) and flux8's peak allocated memory over the peer's (< 0 where the peer did
// not measure memory).
struct PeerRatio {
  std::string mode;
  double speedup = 0, memory_ratio = -1;
};

struct PeerComparison {
  std::vector<PeerRatio> ratios;
  std::string why;                   // not empty: no ratio, and why
  std::vector<std::string> skipped;  // "torchao-fp8 (torchao is not installed)"
};

// `device` is the bench's device name; `workload` and `shape` the run's.
PeerComparison compare_to_peer(const PeerFile& peer, const std::string& device, const std::string& workload,
                               const StepShape& shape, double median_ms, double peak_allocated_gib);

// "PyTorch's step / flux8's: 1.78x eager, 1.07x compile; flux8's peak memory / PyTorch's: 1.13x eager,
// 1.30x compile", or
// "no ratio: <why>"; the peer's skipped modes follow.
std::string describe(const PeerComparison& c);

}  // namespace flux8
