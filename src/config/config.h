#pragma once
// A resolved flux8 configuration: one value for every registered key (schema.h) plus where each
// value came from. Sources, lowest priority first: schema default < included files (in order,
// depth first) < the including file < --set overrides < set() calls.
//
//   Config cfg = Config::load("configs/exp.yaml", {"micro_batch_size=4"});
//   int64_t h = cfg.get_int("hidden_size");
//   cfg.source("hidden_size");  // "configs/models/flux_535m.yaml:5"
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "config/schema.h"

namespace YAML {
class Node;
}

namespace flux8 {

// Config files are kilobytes; the limits keep a crafted one (or an include of /dev/zero, a
// directory, or a file including itself through many others) to a clear error in bounded time.
inline constexpr uint64_t kMaxConfigFileBytes = 1ull << 20;
inline constexpr size_t kMaxIncludeDepth = 16;
inline constexpr size_t kMaxConfigFilesRead = 256;

class Config {
 public:
  // Every key at its schema default.
  Config();

  // Reads `path` (following include:/bases:), then applies `overrides`, each "key=value" with the
  // value in YAML syntax ("axes_dim=[16,56,56]"). Throws flux8::Error naming file, line and key;
  // yaml-cpp's and the file system's errors become such an Error too. Bounded: a config
  // file is at most kMaxConfigFileBytes, includes nest at most kMaxIncludeDepth deep and one
  // load reads at most kMaxConfigFilesRead files.
  static Config load(const std::string& path, const std::vector<std::string>& overrides = {});

  // Like load(), from YAML text instead of a file (e.g. the resolved config a checkpoint's
  // trainer_state.json stores). `origin` stands in for the file name in provenance and errors;
  // includes are resolved relative to its directory. The cross-key checks are the readers'
  // (FluxConfig::from_config, TrainConfig::from_config).
  static Config load_text(const std::string& yaml_text, const std::string& origin,
                          const std::vector<std::string>& overrides = {});

  // Merges one YAML file (and its includes) over the current values.
  void merge_file(const std::string& path);
  // Applies one "key=value" command-line override.
  void apply_override(const std::string& key_equals_value);
  // Sets `key` from YAML text parsed with the key's type; `source` is recorded as provenance.
  void set(const std::string& key, const std::string& value_yaml, const std::string& source = "set()");

  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;  // also reads int keys
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;  // string and enum keys
  std::vector<int64_t> get_int_list(const std::string& key) const;
  std::vector<double> get_float_list(const std::string& key) const;  // also reads int lists
  const ConfigValue& get(const std::string& key) const;

  // "configs/x.yaml:3", "--set", "set()" or "default".
  const std::string& source(const std::string& key) const;
  // The top-level file given to load(), "" for a default Config.
  const std::string& path() const { return path_; }
  // What loading found worth saying but not refusing (a Primus experiment's keys that flux8 has
  // no use for), one line each; the command prints them.
  const std::vector<std::string>& warnings() const { return warnings_; }

  // The resolved config as YAML (sections as comments, provenance as trailing comments);
  // loading it back gives the same values.
  std::string dump() const;

 private:
  struct Entry {
    ConfigValue value;
    std::string source;
  };
  struct IncludeWalk;  // the files being read (for cycles and depth) and how many were read
  // `included_at` ("file:line") names the include line that led here, "" for the top file.
  void merge_file(const std::string& path, IncludeWalk& walk, const std::string& included_at);
  void merge_text(const std::string& text, const std::string& path, IncludeWalk& walk);
  void merge_primus(const YAML::Node& root, const std::string& path, IncludeWalk& walk);
  void store(const std::string& key, ConfigValue value, const std::string& source);
  void check_aliases_agree() const;
  const Entry& entry(const std::string& key) const;

  std::map<std::string, Entry> entries_;
  std::string path_;
  std::vector<std::string> warnings_;
};

// The keys whose values differ between two configs, in table order, each as "key: value (was
// old)" (aliases left out: their key is compared). What a resume reports against the
// checkpoint's resolved config.
std::vector<std::string> changed_keys(const Config& before, const Config& now);

// A Primus experiment file (config/primus.h) as a flux8 config: its includes, the module's
// `overrides:` keys flux8 knows (values checked), and a comment listing the keys left out
// (`flux8 config --from-primus FILE`). Include paths stay relative to FILE's directory.
std::string convert_primus_experiment(const std::string& path);

// Parses YAML text as a value of `spec`'s type and checks range/choices. `where` names the
// origin in error messages (e.g. "--set").
ConfigValue parse_config_value(const KeySpec& spec, const std::string& value_yaml, const std::string& where);

}  // namespace flux8
