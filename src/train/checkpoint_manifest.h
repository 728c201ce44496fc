#pragma once
// The JSON files of a checkpoint directory (src/train/checkpoint.h), read strictly: a manifest or
// trainer state that is not what flux8 writes is refused with the file and the key named, before
// any of its numbers is used.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flux8 {

// A file's size and digests: one SHA-256 of the whole file, or (the large files since format
// version 2) one per piece of piece_bytes from offset 0, which verify side by side.
struct FileRecord {
  uint64_t bytes = 0;
  std::string sha256;
  uint64_t piece_bytes = 0;
  std::vector<std::string> piece_sha256;
};

struct Manifest {
  int version = 0;
  int64_t step = 0;
  std::map<std::string, FileRecord> files;
};

// manifest.json's text parsed and checked: a known format version, a step >= 0, file names
// without a path, sizes and digests of the right types, piece lists that cover their files.
// Fails with a short problem that starts with "manifest.json" (the caller names the directory).
Manifest manifest_from_text(const std::string& text);

// The manifest.json text of a checkpoint of `step` with these files.
std::string manifest_to_text(int64_t step, const std::map<std::string, FileRecord>& files);

}  // namespace flux8
