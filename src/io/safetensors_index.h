#pragma once
// Sharded safetensors checkpoints as Hugging Face libraries write them (diffusers'
// save_pretrained, transformers): the tensors spread over several files beside an index
//
//   diffusion_pytorch_model.safetensors.index.json
//     {"metadata": {"total_size": <bytes of tensor data>},
//      "weight_map": {"<tensor>": "diffusion_pytorch_model-00001-of-00002.safetensors", ...}}
//
// and the writer of such a set. The index is untrusted input like the files it names: a shard
// name must be a plain file name in the index's folder (no separators, no "..").
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors.h"

namespace flux8 {

// The index's tensor -> shard file table, checked: an object with a "weight_map" object of
// non-empty tensor names to plain file names ending in ".safetensors", and an optional "metadata"
// object whose "total_size", when present, is a count. Fails naming `path` and the entry.
struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;
  std::vector<std::string> shards;  // the distinct file names, sorted
  static SafetensorsIndex parse(std::string_view text, const std::string& path);
};

// Tensors looked up by name across one safetensors file or the shards of an index, each shard
// opened (its header validated) once. For an index every tensor must be in the shard the index
// names, and every tensor of a shard must be listed there: a partial download or a folder that
// mixes two checkpoints fails naming the shard and the tensor.
class SafetensorsSet {
 public:
  static SafetensorsSet open_file(const std::string& path);
  static SafetensorsSet open_index(const std::string& index_path);

  // The file, or the index, this set was opened from (for messages).
  const std::string& path() const { return path_; }
  bool sharded() const { return files_.size() > 1 || !index_path_.empty(); }
  std::vector<std::string> names() const;  // every tensor, files in order, each in data order
  bool contains(const std::string& name) const { return where_.count(name) > 0; }
  // The file holding `name`; fails naming the set when there is none.
  const SafetensorsReader& file_of(const std::string& name) const;
  const SafetensorsTensor& tensor(const std::string& name) const { return file_of(name).tensor(name); }
  // The metadata of a single file (an index's shards have their own; this is empty for them).
  const std::map<std::string, std::string>& metadata() const;

 private:
  std::string path_, index_path_;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, size_t> where_;  // tensor -> index into files_
};

// Splits tensors into shards of at most `max_shard_bytes` of tensor data each, in order, the
// way Hugging Face's save_pretrained does: a tensor that would overflow the current shard starts
// the next one, and a tensor larger than the limit gets a shard of its own. Returns the shard
// number of each tensor (0-based).
std::vector<size_t> assign_shards(const std::vector<uint64_t>& tensor_bytes, uint64_t max_shard_bytes);

// The index file's text for a set of shards: "total_size" and the weight map, keys sorted.
std::string safetensors_index_json(const std::map<std::string, std::string>& weight_map, uint64_t total_size);

// "5GB" (10^9), "500MB", "64KB", "2GiB" (2^30), "4MiB", "123B" or "123": bytes; fails naming
// `what` for anything else, for 0 and for sizes beyond 2^63.
uint64_t parse_byte_size(std::string_view text, const std::string& what);

}  // namespace flux8
