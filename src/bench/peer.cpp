#include "bench/peer.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/text_file.h"

namespace flux8 {

namespace {

using nlohmann::json;

// A key of the peer file, read with its path ("workloads[1].modes[0].median_ms") so that an
// error says which one is missing or of the wrong type.
struct Reader {
  const std::string& file;

  [[noreturn]] void bad(const std::string& key, const std::string& what) const {
    fail("peer file {}: key '{}' {} (write the file with tools/peer_bench.py)", file, key, what);
  }
  const json& at(const json& j, const std::string& parent, const std::string& key) const {
    const std::string path = parent.empty() ? key : parent + "." + key;
    if (!j.is_object()) bad(parent, "is not an object");
    const auto it = j.find(key);
    if (it == j.end()) bad(path, "is missing");
    return *it;
  }
  std::string text(const json& j, const std::string& parent, const std::string& key) const {
    const json& v = at(j, parent, key);
    if (!v.is_string()) bad(parent.empty() ? key : parent + "." + key, "is not a string");
    return v.get<std::string>();
  }
  double number(const json& j, const std::string& parent, const std::string& key) const {
    const json& v = at(j, parent, key);
    if (!v.is_number()) bad(parent.empty() ? key : parent + "." + key, "is not a number");
    return v.get<double>();
  }
  // A string, or null for "none" (a library that was not installed): "" then.
  std::string text_or_null(const json& j, const std::string& parent, const std::string& key) const {
    const json& v = at(j, parent, key);
    if (v.is_null()) return "";
    if (!v.is_string()) bad(parent.empty() ? key : parent + "." + key, "is neither a string nor null");
    return v.get<std::string>();
  }
  const json& list(const json& j, const std::string& parent, const std::string& key) const {
    const json& v = at(j, parent, key);
    if (!v.is_array()) bad(parent.empty() ? key : parent + "." + key, "is not a list");
    return v;
  }
};

PeerMode read_mode(const Reader& r, const json& j, const std::string& at) {
  PeerMode m;
  m.mode = r.text(j, at, "mode");
  const std::string status = r.text(j, at, "status");
  if (status == "skipped") {
    m.why = r.text(j, at, "why");
    return m;
  }
  if (status != "ran") r.bad(at + ".status", "is '" + status + "', not 'ran' or 'skipped'");
  m.ran = true;
  m.median_ms = r.number(j, at, "median_ms");
  if (!(m.median_ms > 0)) r.bad(at + ".median_ms", "is not positive");
  m.steps = static_cast<int64_t>(r.number(j, at, "steps"));
  const json& peak = r.at(j, at, "peak_gib");
  if (!peak.is_null() && !peak.is_number()) r.bad(at + ".peak_gib", "is neither a number nor null");
  m.peak_gib = peak.is_number() ? peak.get<double>() : -1;
  return m;
}

PeerWorkload read_workload(const Reader& r, const json& j, const std::string& at) {
  PeerWorkload w;
  w.workload = r.text(j, at, "workload");
  w.shape.batch = static_cast<int64_t>(r.number(j, at, "batch"));
  w.shape.txt_tokens = static_cast<int64_t>(r.number(j, at, "txt_tokens"));
  w.shape.img_tokens = static_cast<int64_t>(r.number(j, at, "img_tokens"));
  const json& modes = r.list(j, at, "modes");
  for (size_t i = 0; i < modes.size(); ++i)
    w.modes.push_back(read_mode(r, modes[i], fmt::format("{}.modes[{}]", at, i)));
  return w;
}

std::string shape_text(const StepShape& s) {
  return fmt::format("batch {}, {} text + {} image tokens", s.batch, s.txt_tokens, s.img_tokens);
}

}  // namespace

PeerFile parse_peer_file(const std::string& text, const std::string& path) {
  std::string error;
  const std::optional<json> parsed = parse_json(text, error);
  if (!parsed) fail("peer file {}: not JSON ({}): write it with tools/peer_bench.py", path, error);
  const json& j = *parsed;
  const Reader r{path};
  PeerFile p;
  p.path = path;
  p.device = r.text(j, "", "device");
  const json& versions = r.at(j, "", "versions");
  p.torch_version = r.text(versions, "versions", "torch");
  p.diffusers_version = r.text_or_null(versions, "versions", "diffusers");
  p.torchao_version = r.text_or_null(versions, "versions", "torchao");
  const json& workloads = r.list(j, "", "workloads");
  for (size_t i = 0; i < workloads.size(); ++i)
    p.workloads.push_back(read_workload(r, workloads[i], fmt::format("workloads[{}]", i)));
  return p;
}

PeerFile load_peer_file(const std::string& path) {
  std::string error;
  const std::optional<std::string> text = read_file_text(path, error);
  if (!text) fail("peer file {}: {} (make it with tools/peer_bench.py --out {})", path, error, path);
  return parse_peer_file(*text, path);
}

std::string cpu_device_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) != 0) continue;
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const size_t begin = line.find_first_not_of(" \t", colon + 1);
    const size_t end = line.find_last_not_of(" \t\r");
    if (begin != std::string::npos && end >= begin) return "cpu: " + line.substr(begin, end - begin + 1);
  }
  return "cpu";
}

std::string gpu_name_of_check_line(const std::string& value) {
  std::string name = value;
  for (int field = 0; field < 2; ++field) name.resize(std::min(name.size(), name.rfind(", ")));  // SMs, memory
  return name;
}

PeerComparison compare_to_peer(const PeerFile& peer, const std::string& device, const std::string& workload,
                               const StepShape& shape, double median_ms, double peak_allocated_gib) {
  PeerComparison c;
  if (peer.device != device) {
    c.why =
        fmt::format("the peer ran on {}, this bench on {}", peer.device, device.empty() ? "an unnamed device" : device);
    return c;
  }
  const PeerWorkload* w = nullptr;
  for (const PeerWorkload& candidate : peer.workloads)
    if (candidate.workload == workload) w = &candidate;
  if (!w) {
    c.why = fmt::format("{} has no {} (run tools/peer_bench.py --workload {})", peer.path, workload, workload);
    return c;
  }
  if (w->shape.batch != shape.batch || w->shape.txt_tokens != shape.txt_tokens ||
      w->shape.img_tokens != shape.img_tokens) {
    c.why = fmt::format("the peer's {} is {}, this run's {}", workload, shape_text(w->shape), shape_text(shape));
    return c;
  }
  for (const PeerMode& m : w->modes) {
    if (!m.ran) {
      c.skipped.push_back(m.mode + " (" + m.why + ")");
      continue;
    }
    c.ratios.push_back({m.mode, m.median_ms / median_ms, m.peak_gib > 0 ? peak_allocated_gib / m.peak_gib : -1});
  }
  if (c.ratios.empty()) c.why = fmt::format("no mode of the peer's {} ran", workload);
  return c;
}

std::string describe(const PeerComparison& c) {
  std::string out;
  if (!c.why.empty()) {
    out = "no ratio: " + c.why;
  } else {
    std::string step, memory;
    bool any_memory = false;
    for (const PeerRatio& r : c.ratios) {
      step += fmt::format("{}{:.2f}x {}", step.empty() ? "" : ", ", r.speedup, r.mode);
      memory += fmt::format("{}{} {}", memory.empty() ? "" : ", ",
                            r.memory_ratio >= 0 ? fmt::format("{:.2f}x", r.memory_ratio) : "-", r.mode);
      any_memory |= r.memory_ratio >= 0;
    }
    out = "PyTorch's step / flux8's: " + step +
          "; flux8's peak memory / PyTorch's: " + (any_memory ? memory : "not measured by the peer");
  }
  for (const std::string& s : c.skipped) out += "; skipped by the peer: " + s;
  return out;
}

}  // namespace flux8
