#include "train/checkpoint_manifest.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "core/error.h"
#include "core/text_file.h"
#include "train/checkpoint.h"

namespace flux8 {

using nlohmann::json;

namespace {

constexpr const char* kManifestFile = "manifest.json";

// Typed reads of one JSON object's fields; every error names `where` (the file, or the file and
// the enclosing key) and the field, and quotes at most a short excerpt of the bad value.
class Fields {
 public:
  Fields(const json& object, std::string where) : j_(object), where_(std::move(where)) {
    if (!j_.is_object()) fail("{}: expected a JSON object, got {}", where_, excerpt(j_));
  }
  const json& at(const char* key) {
    known_.insert(key);
    const auto it = j_.find(key);
    if (it == j_.end()) fail("{}: missing field '{}'", where_, key);
    return *it;
  }
  bool has(const char* key) const { return j_.contains(key); }
  int64_t integer(const char* key, int64_t min, int64_t max = std::numeric_limits<int64_t>::max()) {
    const json& v = at(key);
    const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(max)
                                             : v.is_number_integer() && v.get<int64_t>() <= max;
    if (!fits || v.get<int64_t>() < min) {
      if (max == std::numeric_limits<int64_t>::max())
        fail("{}: field '{}' must be an integer >= {}, got {}", where_, key, min, excerpt(v));
      fail("{}: field '{}' must be an integer from {} to {}, got {}", where_, key, min, max, excerpt(v));
    }
    return v.get<int64_t>();
  }
  uint64_t unsigned_integer(const char* key, uint64_t min = 0) {
    const json& v = at(key);
    if (!v.is_number_unsigned() || v.get<uint64_t>() < min)
      fail("{}: field '{}' must be an integer >= {}, got {}", where_, key, min, excerpt(v));
    return v.get<uint64_t>();
  }
  std::string string(const char* key) {
    const json& v = at(key);
    if (!v.is_string()) fail("{}: field '{}' must be a string, got {}", where_, key, excerpt(v));
    return v.get<std::string>();
  }
  std::string sha256(const char* key) {
    const json& v = at(key);
    if (!is_sha256(v)) fail("{}: field '{}' must be a SHA-256 digest (64 hex digits), got {}", where_, key, excerpt(v));
    return v.get<std::string>();
  }
  // Fails naming the first field that none of the reads above asked for.
  void refuse_unknown(const char* why) const {
    for (const auto& [key, value] : j_.items())
      if (!known_.count(key)) fail("{}: unknown field '{}' ({})", where_, quote_excerpt(key), why);
  }

  static std::string excerpt(const json& v) { return quote_excerpt(v.dump()); }
  static bool is_sha256(const json& v) {
    if (!v.is_string()) return false;
    const std::string& s = v.get_ref<const std::string&>();
    return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
  }

 private:
  const json& j_;
  std::string where_;
  std::set<std::string> known_;
};

json parse_or_fail(const std::string& text, const std::string& where) {
  std::string error;
  std::optional<json> parsed = parse_json(text, error);
  if (!parsed) fail("{}: not valid JSON: {}", where, error);
  return std::move(*parsed);
}

FileRecord file_record(const json& value, const std::string& name) {
  Fields f(value, fmt::format("{}: files.{}", kManifestFile, name));
  FileRecord r;
  r.bytes = f.unsigned_integer("bytes");
  if (!f.has("piece_sha256")) {
    r.sha256 = f.sha256("sha256");
    return r;
  }
  r.piece_bytes = f.unsigned_integer("piece_bytes", 1);
  const json& pieces = f.at("piece_sha256");
  // An empty file has one (empty) piece.
  const uint64_t want = std::max<uint64_t>(1, r.bytes / r.piece_bytes + (r.bytes % r.piece_bytes != 0));
  if (!pieces.is_array() || pieces.size() != want)
    fail("{} lists {} piece digests of {} bytes for {} ({} bytes), expected {}", kManifestFile,
         pieces.is_array() ? std::to_string(pieces.size()) : Fields::excerpt(pieces), r.piece_bytes, name, r.bytes,
         want);
  for (const json& d : pieces) {
    if (!Fields::is_sha256(d))
      fail("{}: files.{}: field 'piece_sha256' must list SHA-256 digests (64 hex digits), got {}", kManifestFile, name,
           Fields::excerpt(d));
    r.piece_sha256.push_back(d.get<std::string>());
  }
  return r;
}

// JSON has no NaN or infinity; a non-finite loss is stored as a string.
json loss_to_json(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return x;
}

double loss_from_json(const json& v, const std::string& where) {
  if (v.is_number()) return v.get<double>();
  if (v == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (v == "inf" || v == "-inf") return (v == "inf" ? 1 : -1) * std::numeric_limits<double>::infinity();
  fail("{}: field 'last_loss' must be a number, \"nan\", \"inf\" or \"-inf\", got {}", where, Fields::excerpt(v));
}

}  // namespace

Manifest manifest_from_text(const std::string& text) {
  try {
    const json j = parse_or_fail(text, kManifestFile);
    Fields f(j, kManifestFile);
    Manifest m;
    m.version = static_cast<int>(f.integer("format_version", 1, std::numeric_limits<int>::max()));
    if (m.version > kCheckpointFormatVersion)
      fail("{} has format_version {}; this flux8 reads version {} (written by a newer flux8?)", kManifestFile,
           m.version, kCheckpointFormatVersion);
    m.step = f.integer("step", 0);
    const json& files = f.at("files");
    if (!files.is_object()) fail("{}: field 'files' must be an object, got {}", kManifestFile, Fields::excerpt(files));
    for (const auto& [name, rec] : files.items()) {
      if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
        fail("{} lists an invalid file name '{}'", kManifestFile, quote_excerpt(name));
      m.files[name] = file_record(rec, name);
    }
    return m;
  } catch (const json::exception& e) {  // none expected after the checks above: still named
    fail("{} is not a valid manifest: {}", kManifestFile, e.what());
  }
}

std::string manifest_to_text(int64_t step, const std::map<std::string, FileRecord>& files) {
  json manifest;
  manifest["format"] = "flux8-checkpoint";
  manifest["format_version"] = kCheckpointFormatVersion;
  manifest["step"] = step;
  manifest["files"] = json::object();
  for (const auto& [name, r] : files)
    manifest["files"][name] =
        r.piece_sha256.empty()
            ? json{{"bytes", r.bytes}, {"sha256", r.sha256}}
            : json{{"bytes", r.bytes}, {"piece_bytes", r.piece_bytes}, {"piece_sha256", r.piece_sha256}};
  return manifest.dump(2) + "\n";
}

std::string trainer_state_to_json(const TrainerState& s) {
  json j;
  j["step"] = s.step;
  j["consumed_samples"] = s.consumed_samples;
  j["data_epoch"] = s.data_epoch;
  j["data_position"] = s.data_position;
  j["seed"] = s.seed;
  j["skipped_steps"] = s.skipped_steps;
  j["last_loss"] = loss_to_json(s.last_loss);
  j["config_yaml"] = s.config_yaml;
  j["flux8_version"] = s.flux8_version;
  return j.dump(2) + "\n";
}

TrainerState trainer_state_from_json(const std::string& text, const std::string& where) {
  try {
    const json j = parse_or_fail(text, where);
    Fields f(j, where);
    TrainerState s;
    // Counts and positions: never negative (the loader takes the position as unsigned).
    s.step = f.integer("step", 0);
    s.consumed_samples = f.integer("consumed_samples", 0);
    s.data_epoch = f.integer("data_epoch", 0);
    s.data_position = f.integer("data_position", 0);
    s.skipped_steps = f.integer("skipped_steps", 0, s.step);  // a skipped step is one of the steps
    s.seed = f.unsigned_integer("seed");
    s.last_loss = loss_from_json(f.at("last_loss"), where);
    s.config_yaml = f.string("config_yaml");
    s.flux8_version = f.string("flux8_version");
    f.refuse_unknown("written by a newer flux8, or edited by hand?");
    return s;
  } catch (const json::exception& e) {
    fail("{}: not a valid trainer state: {}", where, e.what());
  }
}

}  // namespace flux8
