#include "config/primus.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>

#include "config/schema.h"
#include "core/error.h"
#include "core/text_file.h"

namespace flux8 {

namespace {

std::string at(const std::string& file, const YAML::Mark& mark) {
  return mark.is_null() ? file : fmt::format("{}:{}", file, mark.line + 1);
}

// Primus writes `${NAME:default}` (or `${NAME}`) for "the environment variable NAME, else the
// default"; an empty variable counts as unset.
std::string substitute_environment(const std::string& text, const std::string& where) {
  std::string out;
  size_t i = 0;
  while (i < text.size()) {
    const size_t open = text.find("${", i);
    if (open == std::string::npos) break;
    const size_t close = text.find('}', open);
    if (close == std::string::npos) fail("{}: '{}' opens ${{ without a closing }}", where, quote_excerpt(text));
    out += text.substr(i, open - i);
    const std::string inner = text.substr(open + 2, close - open - 2);
    const size_t colon = inner.find(':');
    const std::string name = inner.substr(0, colon);
    const char* value = std::getenv(name.c_str());
    if (value && *value)
      out += value;
    else if (colon != std::string::npos)
      out += inner.substr(colon + 1);
    else
      fail("{}: ${{{}}} has no default and the environment variable {} is not set", where, name, name);
    i = close + 1;
  }
  return out + text.substr(i);
}

// The value with its environment references substituted, read again as YAML so that
// "${PRIMUS_MBS:2}" is the integer 2.
YAML::Node resolve(const YAML::Node& value, const std::string& where) {
  if (!value.IsScalar() || value.Scalar().find("${") == std::string::npos) return value;
  const std::string text = substitute_environment(value.Scalar(), where);
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception&) {
    return YAML::Node(text);
  }
}

// The module flux8 trains from: pre_trainer, else the only one.
std::pair<std::string, YAML::Node> pick_module(const YAML::Node& modules, const std::string& path) {
  if (!modules.IsMap() || modules.size() == 0)
    fail("{}: `modules:` must map module names (pre_trainer, ...) to their settings", at(path, modules.Mark()));
  std::vector<std::string> names;
  for (const auto& kv : modules) {
    names.push_back(kv.first.Scalar());
    if (kv.first.Scalar() == "pre_trainer") return {"pre_trainer", kv.second};
  }
  if (names.size() == 1) return {names[0], modules.begin()->second};
  fail("{}: modules {} — flux8 trains the pre_trainer module; this file has none", at(path, modules.Mark()),
       fmt::join(names, ", "));
}

void add_includes(PrimusExperiment& e, const YAML::Node& key, const YAML::Node& value, const std::string& path) {
  const std::string where = at(path, key.Mark());
  if (value.IsScalar()) {
    e.includes.emplace_back(value.Scalar(), where + ": " + key.Scalar());
    return;
  }
  if (value.IsSequence()) {
    for (const YAML::Node& v : value) {
      if (!v.IsScalar()) break;
      e.includes.emplace_back(v.Scalar(), where + ": " + key.Scalar());
    }
    if (value.size() == e.includes.size()) return;
  }
  fail("{} in {} must be a file path or a list of file paths", key.Scalar(), where);
}

void read_overrides(PrimusExperiment& e, const YAML::Node& overrides, const std::string& prefix,
                    const std::string& path) {
  if (overrides.IsNull()) return;
  if (!overrides.IsMap()) fail("{}: {} must be a mapping of key: value lines", at(path, overrides.Mark()), prefix);
  for (const auto& kv : overrides) {
    const std::string key = kv.first.Scalar();
    const KeySpec* spec = find_config_key(key);
    if (!spec) {
      e.ignored.push_back(prefix + "." + key);
      continue;
    }
    // Megatron's null is "the default" (lr_decay_iters: null): flux8's default then, named in
    // the warning; a choice with a "none" takes it as flux8 reads `fp8: null`.
    const auto& choices = spec->choices;
    if (kv.second.IsNull() && std::find(choices.begin(), choices.end(), "none") == choices.end()) {
      e.ignored.push_back(prefix + "." + key + ": null (flux8's default kept)");
      continue;
    }
    const std::string where = at(path, kv.first.Mark());
    e.settings.push_back({key, resolve(kv.second, where), where});
  }
}

}  // namespace

bool is_primus_experiment(const YAML::Node& root) { return root.IsMap() && root["modules"].IsDefined(); }

PrimusExperiment read_primus_experiment(const YAML::Node& root, const std::string& path) {
  PrimusExperiment e;
  for (const auto& kv : root) {
    const std::string key = kv.first.Scalar();
    if (key == "extends" || key == "bases" || key == "include")
      add_includes(e, kv.first, kv.second, path);
    else if (key != "modules")
      e.ignored.push_back(key);
  }
  const auto [name, module] = pick_module(root["modules"], path);
  e.module = name;
  if (!module.IsMap()) fail("{}: modules.{} must be a mapping", at(path, module.Mark()), name);
  const std::string prefix = "modules." + name;
  for (const auto& kv : module) {
    const std::string key = kv.first.Scalar();
    if (key == "overrides") {
      read_overrides(e, kv.second, prefix + ".overrides", path);
    } else if (key == "model" && kv.second.IsScalar()) {
      // The model file, relative to the experiment (flux8's own: configs/models/*.yaml).
      e.includes.emplace_back(resolve(kv.second, at(path, kv.first.Mark())).Scalar(),
                              at(path, kv.first.Mark()) + ": " + prefix + ".model");
    } else {
      e.ignored.push_back(prefix + "." + key);
    }
  }
  return e;
}

std::string primus_ignored_warning(const PrimusExperiment& e, const std::string& path) {
  if (e.ignored.empty()) return "";
  return fmt::format(
      "{}: Primus experiment: {} key{} with no flux8 meaning, not used: {} (flux8 reads the {} module's "
      "`overrides:` keys it knows, `model:` and `extends:`/`bases:`; docs/CONFIG.md#primus-experiment-files)",
      path, e.ignored.size(), e.ignored.size() == 1 ? "" : "s", fmt::join(e.ignored, ", "), e.module);
}

}  // namespace flux8
