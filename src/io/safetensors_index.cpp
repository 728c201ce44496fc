#include "io/safetensors_index.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/checked.h"
#include "core/error.h"
#include "core/text_file.h"

namespace flux8 {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string in_quotes(std::string_view text) {
  std::string out = "'";
  out += quote_excerpt(text, 160);
  out += '\'';
  return out;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Why `name` cannot be a shard file beside the index, or "" when it can: the index decides which
// files are opened, so it may only name files in its own folder.
std::string shard_name_problem(const std::string& name) {
  if (name.empty()) return "an empty file name";
  if (name.size() > 255) return "longer than a file name can be";
  if (name.find('/') != std::string::npos || name.find('\\') != std::string::npos)
    return "a path; shards must be files in the index's folder";
  if (name.find('\0') != std::string::npos) return "a name with a NUL byte";
  if (name == "." || name == "..") return "not a file name";
  if (!ends_with(name, ".safetensors")) return "not a .safetensors file";
  return "";
}

}  // namespace

SafetensorsIndex SafetensorsIndex::parse(std::string_view text, const std::string& path) {
  std::string error;
  const std::optional<json> parsed = parse_json(text, error);
  if (!parsed) fail("safetensors index '{}': not valid JSON: {}", path, quote_excerpt(error, 200));
  if (!parsed->is_object()) fail("safetensors index '{}': the file is not a JSON object", path);
  if (const auto meta = parsed->find("metadata"); meta != parsed->end()) {
    if (!meta->is_object()) fail("safetensors index '{}': \"metadata\" is not an object", path);
    if (const auto total = meta->find("total_size"); total != meta->end()) {
      const bool count = total->is_number_unsigned() ||
                         (total->is_number_float() && total->get<double>() >= 0 && total->get<double>() < 0x1p63);
      if (!count) fail("safetensors index '{}': metadata.total_size is not a byte count", path);
    }
  }
  const auto map = parsed->find("weight_map");
  if (map == parsed->end() || !map->is_object())
    fail("safetensors index '{}': no \"weight_map\" object (tensor name -> shard file); is this an index file?", path);
  SafetensorsIndex index;
  std::set<std::string> shards;
  for (const auto& [tensor, file] : map->items()) {
    if (tensor.empty()) fail("safetensors index '{}': weight_map has an empty tensor name", path);
    if (!file.is_string())
      fail("safetensors index '{}': weight_map entry {} is not a file name string", path, in_quotes(tensor));
    const std::string& name = file.get_ref<const std::string&>();
    const std::string problem = shard_name_problem(name);
    if (!problem.empty())
      fail("safetensors index '{}': weight_map entry {} names {}, which is {}", path, in_quotes(tensor),
           in_quotes(name), problem);
    index.weight_map[tensor] = name;
    shards.insert(name);
  }
  if (index.weight_map.empty()) fail("safetensors index '{}': weight_map lists no tensor", path);
  index.shards.assign(shards.begin(), shards.end());
  return index;
}

SafetensorsSet SafetensorsSet::open_file(const std::string& path) {
  SafetensorsSet set;
  set.path_ = path;
  set.files_.push_back(std::make_unique<SafetensorsReader>(path));
  for (const std::string& name : set.files_[0]->names()) set.where_[name] = 0;
  return set;
}

SafetensorsSet SafetensorsSet::open_index(const std::string& index_path) {
  const SafetensorsIndex index =
      SafetensorsIndex::parse(read_text_or_fail(index_path, "safetensors index"), index_path);
  SafetensorsSet set;
  set.path_ = set.index_path_ = index_path;
  const fs::path folder = fs::path(index_path).parent_path();
  std::map<std::string, size_t> file_number;
  for (const std::string& shard : index.shards) {
    const fs::path shard_path = folder / shard;
    std::error_code ec;
    if (!fs::exists(shard_path, ec)) {
      const auto first = std::find_if(index.weight_map.begin(), index.weight_map.end(),
                                      [&](const auto& e) { return e.second == shard; });
      fail(
          "safetensors index '{}' puts tensor {} (and maybe others) in shard '{}', which is missing from {}; "
          "an incomplete download or copy? Fetch the whole folder again",
          index_path, in_quotes(first->first), shard, folder.string());
    }
    file_number[shard] = set.files_.size();
    set.files_.push_back(std::make_unique<SafetensorsReader>(shard_path.string()));
  }
  for (const auto& [tensor, shard] : index.weight_map) {
    const size_t n = file_number.at(shard);
    if (!set.files_[n]->contains(tensor))
      fail(
          "safetensors index '{}' puts tensor {} in shard '{}', which has no such tensor (a shard from another "
          "checkpoint, or a damaged index?)",
          index_path, in_quotes(tensor), set.files_[n]->path());
    set.where_[tensor] = n;
  }
  for (size_t n = 0; n < set.files_.size(); ++n)
    for (const std::string& tensor : set.files_[n]->names()) {
      const auto it = index.weight_map.find(tensor);
      if (it == index.weight_map.end())
        fail(
            "safetensors shard '{}' holds tensor {}, which its index '{}' does not list (a shard from another "
            "checkpoint?)",
            set.files_[n]->path(), in_quotes(tensor), index_path);
      if (file_number.at(it->second) != n)
        fail(
            "safetensors shard '{}' holds tensor {}, which its index '{}' puts in '{}'; a tensor must be in one "
            "shard",
            set.files_[n]->path(), in_quotes(tensor), index_path, it->second);
    }
  return set;
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> out;
  for (const auto& f : files_)
    for (std::string& name : f->names()) out.push_back(std::move(name));
  return out;
}

const SafetensorsReader& SafetensorsSet::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) fail("'{}' has no tensor {} ({} tensors)", path_, in_quotes(name), where_.size());
  return *files_[it->second];
}

const std::map<std::string, std::string>& SafetensorsSet::metadata() const {
  static const std::map<std::string, std::string> none;
  return index_path_.empty() && files_.size() == 1 ? files_[0]->metadata() : none;
}

std::vector<size_t> assign_shards(const std::vector<uint64_t>& tensor_bytes, uint64_t max_shard_bytes) {
  std::vector<size_t> shard_of;
  size_t shard = 0;
  uint64_t filled = 0;
  for (uint64_t bytes : tensor_bytes) {
    const bool fits = filled < max_shard_bytes && bytes <= max_shard_bytes - filled;
    if (filled > 0 && !fits) {
      ++shard;
      filled = 0;
    }
    shard_of.push_back(shard);
    filled = checked_add(filled, bytes).value_or(std::numeric_limits<uint64_t>::max());
  }
  return shard_of;
}

std::string safetensors_index_json(const std::map<std::string, std::string>& weight_map, uint64_t total_size) {
  json j;
  j["metadata"] = {{"total_size", total_size}};
  j["weight_map"] = json::object();
  for (const auto& [tensor, file] : weight_map) j["weight_map"][tensor] = file;
  return j.dump(2) + "\n";
}

uint64_t parse_byte_size(std::string_view text, const std::string& what) {
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  std::string unit(text.substr(digits));
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::tolower(c); });
  static const std::map<std::string, uint64_t> units = {{"", 1},
                                                        {"b", 1},
                                                        {"kb", 1000},
                                                        {"mb", 1000'000},
                                                        {"gb", 1000'000'000},
                                                        {"tb", 1000'000'000'000},
                                                        {"kib", 1ull << 10},
                                                        {"mib", 1ull << 20},
                                                        {"gib", 1ull << 30},
                                                        {"tib", 1ull << 40}};
  const auto u = units.find(unit);
  std::optional<uint64_t> value =
      digits > 0 && digits <= 19 && u != units.end() ? std::optional<uint64_t>(0) : std::nullopt;
  for (size_t i = 0; value && i < digits; ++i) {
    value = checked_mul<uint64_t>(*value, 10);
    if (value) value = checked_add<uint64_t>(*value, static_cast<uint64_t>(text[i] - '0'));
  }
  if (value) value = checked_mul<uint64_t>(*value, u->second);
  if (!value || *value == 0 || *value > uint64_t(std::numeric_limits<int64_t>::max()))
    fail("{}: '{}' is not a size; give a positive number of bytes with an optional unit, e.g. 10GB, 500MB, 2GiB", what,
         quote_excerpt(text, 40));
  return *value;
}

}  // namespace flux8
