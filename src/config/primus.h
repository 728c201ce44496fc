#pragma once
// Primus experiment files (AMD's Megatron/TorchTitan launcher): a top level of run metadata,
// `extends:` (or `bases:`) files, and `modules: <name>: {framework, config, model, overrides}`
// whose `overrides:` hold Megatron-style flat keys. flux8 reads the keys it knows from
// `overrides:`, includes `extends:`/`bases:` and the module's `model:` file (relative to the
// experiment file), substitutes Primus's ${VAR:default} environment references, and lists every
// other key in one warning. Internal to the config layer (config.cpp).
#include <yaml-cpp/yaml.h>

#include <string>
#include <utility>
#include <vector>

namespace flux8 {

struct PrimusSetting {
  std::string key;
  YAML::Node value;   // ${VAR:default} substituted
  std::string where;  // "file:line" of the key
};

struct PrimusExperiment {
  std::string module;                                         // "pre_trainer"
  std::vector<std::pair<std::string, std::string>> includes;  // (path as written, "file:line: extends")
  std::vector<PrimusSetting> settings;                        // flux8 keys, in file order
  std::vector<std::string> ignored;                           // keys with no flux8 meaning, as dotted paths
};

// A file with a `modules:` mapping is a Primus experiment.
bool is_primus_experiment(const YAML::Node& root);
PrimusExperiment read_primus_experiment(const YAML::Node& root, const std::string& path);
// The one warning naming every ignored key ("" when there are none).
std::string primus_ignored_warning(const PrimusExperiment& e, const std::string& path);

}  // namespace flux8
