// libFuzzer target: a YAML config with includes and --set overrides, resolved, dumped and read
// back, then turned into the model, training and FP8 settings as `flux8 info` and `flux8 train`
// do (derived sizes, parameter layout, FLOPs).
//
// Input: up to four parts separated by a line "#--": main.yaml, a.yaml, b.yaml (which main.yaml
// and each other may include by those names) and the overrides, one key=value per line. The
// three files live in a directory made once per process in /dev/shm (memory, not disk), so an
// include resolves as it would anywhere. They are real files, not memfds: Config resolves each
// path with weakly_canonical, which cannot follow a /proc/self/fd link to a memfd.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"
#include "fp8/fp8_config.h"
#include "fuzz_input.h"
#include "model/flops.h"
#include "model/flux_config.h"
#include "model/params.h"
#include "train/train_config.h"

namespace {

namespace fs = std::filesystem;
constexpr std::string_view kSeparator = "\n#--\n";
constexpr const char* kFileNames[] = {"main.yaml", "a.yaml", "b.yaml"};

struct ConfigDir {
  std::string dir;

  ConfigDir() {
    std::error_code ec;
    const fs::path base = fs::is_directory("/dev/shm", ec) ? fs::path("/dev/shm") : fs::temp_directory_path();
    std::string buf = (base / "flux8-fuzz-config-XXXXXX").string();
    if (!mkdtemp(buf.data())) {
      std::perror("fuzz harness: mkdtemp");
      std::abort();
    }
    dir = buf;
  }
  ~ConfigDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  void write(const char* name, std::string_view text) const {
    std::ofstream out(fs::path(dir) / name, std::ios::binary | std::ios::trunc);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    if (!out) {
      std::fprintf(stderr, "fuzz harness: cannot write %s/%s\n", dir.c_str(), name);
      std::abort();
    }
  }
};

std::vector<std::string_view> split(std::string_view input, size_t max_parts) {
  std::vector<std::string_view> parts;
  while (parts.size() + 1 < max_parts) {
    const size_t at = input.find(kSeparator);
    if (at == std::string_view::npos) break;
    parts.push_back(input.substr(0, at));
    input.remove_prefix(at + kSeparator.size());
  }
  parts.push_back(input);
  return parts;
}

// What the commands derive from a resolved config; each step may refuse the values.
void derive_settings(const flux8::Config& cfg) {
  flux8::fuzz::expect_only_input_errors([&] {
    const flux8::FluxConfig model = flux8::FluxConfig::from_config(cfg);
    const int64_t image_tokens = model.image_tokens(cfg.get_int("image_size"));
    const flux8::ParamLayout layout = flux8::ParamLayout::build(model);
    (void)layout.total();
    (void)flux8::model_flops(model,
                             flux8::StepShape{cfg.get_int("micro_batch_size"), model.text_seq_len, image_tokens});
  });
  flux8::fuzz::expect_only_input_errors([&] { (void)flux8::TrainConfig::from_config(cfg); });
  flux8::fuzz::expect_only_input_errors([&] { (void)flux8::Fp8Config::from_config(cfg); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ConfigDir config_dir;
  const std::vector<std::string_view> parts =
      split(std::string_view(reinterpret_cast<const char*>(data), size), std::size(kFileNames) + 1);
  for (size_t i = 0; i < std::size(kFileNames); ++i)
    config_dir.write(kFileNames[i], i < parts.size() ? parts[i] : std::string_view());
  std::vector<std::string> overrides;
  if (parts.size() > std::size(kFileNames)) {
    std::string_view rest = parts.back();
    while (!rest.empty()) {
      const size_t eol = rest.find('\n');
      overrides.emplace_back(rest.substr(0, eol));
      rest.remove_prefix(eol == std::string_view::npos ? rest.size() : eol + 1);
    }
  }
  flux8::fuzz::expect_only_input_errors([&] {
    const flux8::Config cfg = flux8::Config::load((fs::path(config_dir.dir) / kFileNames[0]).string(), overrides);
    // dump() promises text that loads back to the same values: failing to load it is a finding.
    const std::string dumped = cfg.dump();
    try {
      (void)flux8::Config::load_text(dumped, "dump of the fuzzed config");
    } catch (const flux8::Error& e) {
      std::fprintf(stderr, "finding: Config::dump() wrote text that does not load: %s\n--- dump:\n%s\n", e.what(),
                   dumped.c_str());
      std::abort();
    }
    derive_settings(cfg);
  });
  return 0;
}
