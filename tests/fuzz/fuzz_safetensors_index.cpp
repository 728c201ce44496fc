// libFuzzer target: the index of a sharded safetensors checkpoint (a diffusers folder's
// diffusion_pytorch_model.safetensors.index.json). Each input is parsed on its own
// (SafetensorsIndex::parse) and opened as the index of a folder made once per process, whose
// index file is a symbolic link to a memfd holding the input and whose two shards hold tensors
// "a", "b" (s-1.safetensors) and "c" (s-2.safetensors): a weight map naming them reaches the
// shard cross-checks, and any other name the missing-shard and path refusals.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "fuzz_input.h"
#include "io/safetensors.h"
#include "io/safetensors_index.h"

namespace {

namespace fs = std::filesystem;

struct ShardFolder {
  std::string dir, index;
  flux8::fuzz::MemFile text{"index.json"};

  ShardFolder() {
    std::string buf = (fs::temp_directory_path() / "flux8-fuzz-index-XXXXXX").string();
    if (!mkdtemp(buf.data())) {
      std::perror("fuzz harness: mkdtemp");
      std::abort();
    }
    dir = buf;
    const std::vector<float> values{1, 2};
    for (const auto& [file, tensors] : {std::pair<const char*, std::vector<const char*>>{"s-1.safetensors", {"a", "b"}},
                                        {"s-2.safetensors", {"c"}}}) {
      flux8::SafetensorsWriter w;
      for (const char* t : tensors) w.add(t, flux8::DType::f32, {2}, values.data());
      w.write((fs::path(dir) / file).string());
    }
    index = (fs::path(dir) / "model.safetensors.index.json").string();
    fs::create_symlink(text.path(), index);
  }
  ~ShardFolder() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static ShardFolder folder;
  const std::string text(reinterpret_cast<const char*>(data), size);
  flux8::fuzz::expect_only_input_errors([&] { (void)flux8::SafetensorsIndex::parse(text, "fuzz/index.json"); });
  folder.text.assign(text);
  flux8::fuzz::expect_only_input_errors([&] {
    const flux8::SafetensorsSet set = flux8::SafetensorsSet::open_index(folder.index);
    for (const std::string& name : set.names()) (void)set.tensor(name);
  });
  return 0;
}
