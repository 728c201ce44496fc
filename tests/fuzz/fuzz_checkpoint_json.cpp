// libFuzzer target: the JSON files of a checkpoint directory. Each input is read both as
// trainer_state.json (trainer_state_from_json) and as manifest.json, verified against a
// checkpoint directory made once per process whose manifest.json is a symbolic link to a memfd
// holding the input; its other files are small and fixed, so a manifest can list them with
// matching sizes and reach the digest checks.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "fuzz_input.h"
#include "train/checkpoint.h"

namespace {

namespace fs = std::filesystem;

struct CheckpointDir {
  std::string root, dir;
  flux8::fuzz::MemFile manifest{"manifest.json"};

  CheckpointDir() {
    std::string buf = (fs::temp_directory_path() / "flux8-fuzz-checkpoint-XXXXXX").string();
    if (!mkdtemp(buf.data())) {
      std::perror("fuzz harness: mkdtemp");
      std::abort();
    }
    root = buf;
    dir = (fs::path(root) / flux8::checkpoint_dir_name(1)).string();
    fs::create_directory(dir);
    // Sizes 1, 2, 3 and 0 bytes: the seed manifests list them with these sizes.
    for (const auto& [name, text] : {std::pair{"model.safetensors", "m"},
                                     {"optimizer.safetensors", "op"},
                                     {"trainer_state.json", "{}\n"},
                                     {"fp8_state.safetensors", ""}})
      std::ofstream(fs::path(dir) / name, std::ios::binary) << text;
    fs::create_symlink(manifest.path(), fs::path(dir) / "manifest.json");
  }
  ~CheckpointDir() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static CheckpointDir checkpoint;
  const std::string text(reinterpret_cast<const char*>(data), size);
  flux8::fuzz::expect_only_input_errors([&] { (void)flux8::trainer_state_from_json(text, "fuzz/trainer_state.json"); });
  checkpoint.manifest.assign(text);
  flux8::fuzz::expect_only_input_errors([&] { flux8::verify_checkpoint(checkpoint.dir); });
  flux8::fuzz::expect_only_input_errors([&] { (void)flux8::resolve_weights_path(checkpoint.dir); });
  return 0;
}
