#include "config/config.h"

#include <fmt/ranges.h>
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

#include "config/primus.h"
#include "core/error.h"
#include "core/text_file.h"

namespace fs = std::filesystem;

namespace flux8 {
namespace {

constexpr const char* kKeyHelp = "all keys are listed in docs/CONFIG.md and by `flux8 config --list`";
// Paths and keys quoted in errors come from the file: long enough for any real one, bounded.
constexpr size_t kMaxQuotedPath = 300;
// A "key" longer than any registered one is not a typo of one (and an edit distance to it
// would cost time quadratic in its length).
constexpr size_t kMaxSuggestedKeyLength = 64;

// yaml-cpp marks are 0-based; editors count from 1.
std::string at(const std::string& file, const YAML::Mark& mark) {
  if (mark.is_null()) return file;
  return fmt::format("{}:{}", file, mark.line + 1);
}

[[noreturn]] void fail_unknown_key(const std::string& key, const std::string& where) {
  const std::string guess = key.size() <= kMaxSuggestedKeyLength ? closest_config_key(key) : "";
  const std::string hint = guess.empty() ? "" : fmt::format("; did you mean '{}'?", guess);
  fail("unknown config key '{}' in {}{} ({})", quote_excerpt(key), where, hint, kKeyHelp);
}

// A value quoted for an error message: short, printable, and written without walking nested
// values (a list shows its scalars, deeper entries as [...] or {...}).
std::string node_text(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "no value";
  if (node.IsScalar()) return fmt::format("'{}'", quote_excerpt(node.Scalar()));
  if (node.IsMap()) return "a mapping";
  std::string flow = "[";
  for (const YAML::Node& e : node) {
    if (flow.size() > 80) break;  // quote_excerpt cuts it with "..."
    if (flow.size() > 1) flow += ", ";
    flow += e.IsScalar() ? e.Scalar() : e.IsSequence() ? "[...]" : e.IsMap() ? "{...}" : "null";
  }
  return fmt::format("'{}'", quote_excerpt(flow + "]"));
}

[[noreturn]] void fail_value(const KeySpec& spec, const std::string& where, const std::string& got) {
  fail("{} in {} must be {}, got {}", spec.name, where, describe_allowed(spec), got);
}

bool parse_int(const std::string& s, int64_t& out) {
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && p == end && !s.empty();
}

bool parse_real(const std::string& s, double& out) {
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && p == end && !s.empty() && std::isfinite(out);
}

bool parse_bool(std::string s, bool& out) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "true" || s == "yes" || s == "on") return out = true, true;
  if (s == "false" || s == "no" || s == "off") return out = false, true;
  return false;
}

// Number scalars must also lie in the key's range; lists check every element. Integers are
// written as integers: 1e12, 1.5, true or a number beyond int64 are refused, never rounded or
// truncated. Every integer key's range lies within +-2^53, where the double comparison is exact.
template <typename T>
T number(const KeySpec& spec, const YAML::Node& node, const std::string& where, const std::string& whole) {
  T v{};
  bool ok = node.IsScalar();
  if constexpr (std::is_same_v<T, int64_t>)
    ok = ok && parse_int(node.Scalar(), v);
  else
    ok = ok && parse_real(node.Scalar(), v);
  if (!ok || !spec.range.contains(static_cast<double>(v))) fail_value(spec, where, whole);
  return v;
}

ConfigValue parse_node(const KeySpec& spec, const YAML::Node& node, const std::string& where) {
  const std::string got = node_text(node);
  if (spec.type == KeyType::int_list || spec.type == KeyType::float_list) {
    if (!node.IsSequence()) fail_value(spec, where, got);
    if (spec.type == KeyType::int_list) {
      std::vector<int64_t> v;
      for (const YAML::Node& e : node) v.push_back(number<int64_t>(spec, e, where, got));
      return v;
    }
    std::vector<double> v;
    for (const YAML::Node& e : node) v.push_back(number<double>(spec, e, where, got));
    return v;
  }
  // Megatron writes `fp8: null` for "off": a null value selects a choice key's "none".
  if (node.IsNull() && spec.type == KeyType::choice &&
      std::find(spec.choices.begin(), spec.choices.end(), "none") != spec.choices.end())
    return std::string("none");
  if (!node.IsScalar()) fail_value(spec, where, got);
  switch (spec.type) {
    case KeyType::integer: return number<int64_t>(spec, node, where, got);
    case KeyType::real: return number<double>(spec, node, where, got);
    case KeyType::boolean: {
      bool b;
      if (!parse_bool(node.Scalar(), b)) fail_value(spec, where, got);
      return b;
    }
    case KeyType::string: return node.Scalar();
    case KeyType::choice:
      if (std::find(spec.choices.begin(), spec.choices.end(), node.Scalar()) == spec.choices.end())
        fail_value(spec, where, got);
      return node.Scalar();
    default: break;
  }
  fail("flux8 bug: key type of '{}' not handled", spec.name);
}

// yaml-cpp bounds the depth its parser recurses to (YAML::DeepRecursion, from version 0.7, whose
// header is included so that an older yaml-cpp, which a value nested [[[[...]]]] thousands deep
// drives into a stack overflow, fails the build instead).
YAML::Node load_yaml(const std::string& text, const std::string& file) {
  if (text.size() > kMaxConfigFileBytes)
    fail("{}: {} bytes of config, more than the {} a config may have", file, text.size(), kMaxConfigFileBytes);
  try {
    return YAML::Load(text);
  } catch (const YAML::DeepRecursion& e) {
    fail("{}: malformed YAML: values nested {} or more levels deep (config values are scalars or flat lists)",
         at(file, e.mark), e.depth());
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) fail("{}: malformed YAML: {}", file, quote_excerpt(e.msg, 200));
    fail("{}:{}:{}: malformed YAML: {}", file, e.mark.line + 1, e.mark.column + 1, quote_excerpt(e.msg, 200));
  }
}

// The files named by include:/bases: (a string or a list of strings), in order.
std::vector<std::pair<std::string, YAML::Mark>> include_list(const YAML::Node& key, const YAML::Node& value,
                                                             const std::string& file) {
  std::vector<std::pair<std::string, YAML::Mark>> out;
  if (value.IsScalar()) {
    out.emplace_back(value.Scalar(), value.Mark());
    return out;
  }
  if (value.IsSequence()) {
    for (const YAML::Node& e : value) {
      if (!e.IsScalar()) break;
      out.emplace_back(e.Scalar(), e.Mark());
    }
    if (out.size() == value.size()) return out;
  }
  fail("{} in {} must be a file path or a list of file paths, got {}", key.Scalar(), at(file, value.Mark()),
       node_text(value));
}

// include: (flux8), bases: (Primus's model files) and extends: (Primus experiments) mean the same.
bool is_include_key(const std::string& key) { return key == "include" || key == "bases" || key == "extends"; }

// `inc` resolved against the including file's directory.
std::string resolve_include(const std::string& file, const std::string& inc) {
  return (fs::path(file).parent_path() / inc).lexically_normal().string();
}

// Only a regular file is read: not a directory, a device such as /dev/zero, or a FIFO (whose
// open would block).
void check_regular_file(const std::string& path, const std::string& from, bool included) {
  const std::string shown = quote_excerpt(path, kMaxQuotedPath);
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found)
    fail("{}config file '{}' does not exist{}", from, shown,
         included ? " (includes are relative to the including file)" : "");
  if (ec) fail("{}cannot read config file '{}': {}", from, shown, ec.message());
  if (!fs::is_regular_file(st))
    fail("{}config file '{}' is {}; a config must be a regular YAML file", from, shown,
         fs::is_directory(st) ? "a directory" : "a device, FIFO or socket, not a regular file");
}

// The identity of a file for cycle detection: its canonical path when there is one.
std::string file_identity(const std::string& path) {
  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(path, ec);
  return ec ? fs::path(path).lexically_normal().string() : canonical.string();
}

}  // namespace

struct Config::IncludeWalk {
  std::vector<std::string> chain;  // files being read, outermost first
  size_t files_read = 0;
};

ConfigValue parse_config_value(const KeySpec& spec, const std::string& value_yaml, const std::string& where) {
  // `--set key=` clears a string key (YAML would read an empty value as null).
  if (value_yaml.empty() && spec.type == KeyType::string) return std::string();
  if (value_yaml.size() > kMaxConfigFileBytes)
    fail("{} in {}: a value of {} bytes, more than the {} a whole config may have", spec.name, where, value_yaml.size(),
         kMaxConfigFileBytes);
  YAML::Node node;
  try {
    node = YAML::Load(value_yaml);
  } catch (const YAML::Exception& e) {
    fail("{} in {}: value '{}' is malformed YAML ({}); lists are written [1, 2, 3]", spec.name, where,
         quote_excerpt(value_yaml), quote_excerpt(e.msg, 200));
  }
  return parse_node(spec, node, where);
}

Config::Config() {
  for (const KeySpec& k : config_keys()) entries_[k.name] = Entry{k.default_value, "default"};
}

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  Config cfg;
  cfg.path_ = path;
  IncludeWalk walk;
  cfg.merge_file(path, walk, "");
  for (const std::string& o : overrides) cfg.apply_override(o);
  cfg.check_aliases_agree();
  return cfg;
}

Config Config::load_text(const std::string& yaml_text, const std::string& origin,
                         const std::vector<std::string>& overrides) {
  Config cfg;
  cfg.path_ = origin;
  IncludeWalk walk;
  cfg.merge_text(yaml_text, origin, walk);
  for (const std::string& o : overrides) cfg.apply_override(o);
  cfg.check_aliases_agree();
  return cfg;
}

void Config::merge_file(const std::string& path) {
  IncludeWalk walk;
  merge_file(path, walk, "");
}

void Config::merge_file(const std::string& path, IncludeWalk& walk, const std::string& included_at) {
  const std::string from = included_at.empty() ? "" : included_at + ": ";
  // Cycles are detected on the stack of files being read, so a file included twice through
  // different branches (a diamond) is fine; the depth and count limits bound the rest.
  const std::string id = file_identity(path);
  if (std::find(walk.chain.begin(), walk.chain.end(), id) != walk.chain.end()) {
    std::string cycle;
    for (auto it = std::find(walk.chain.begin(), walk.chain.end(), id); it != walk.chain.end(); ++it)
      cycle += *it + " -> ";
    fail("{}include cycle: {}{}", from, cycle, id);
  }
  if (walk.chain.size() >= kMaxIncludeDepth)
    fail("{}including '{}' nests includes {} files deep, more than the {} allowed ({} includes it)", from,
         quote_excerpt(path, kMaxQuotedPath), walk.chain.size() + 1, kMaxIncludeDepth, walk.chain.back());
  if (++walk.files_read > kMaxConfigFilesRead)
    fail(
        "{}including '{}' reads more than {} config files in one load (a file included from several places counts "
        "each time)",
        from, quote_excerpt(path, kMaxQuotedPath), kMaxConfigFilesRead);
  check_regular_file(path, from, !included_at.empty());
  std::string error;
  const std::optional<std::string> text = read_file_text(path, error, kMaxConfigFileBytes);
  if (!text) fail("{}cannot read config file '{}': {}", from, quote_excerpt(path, kMaxQuotedPath), error);
  walk.chain.push_back(id);
  merge_text(*text, path, walk);
  walk.chain.pop_back();
}

void Config::merge_text(const std::string& text, const std::string& path, IncludeWalk& walk) {
  const YAML::Node root = load_yaml(text, path);
  if (root.IsNull()) return;  // an empty file sets nothing
  if (!root.IsMap()) fail("{}: the top level of a config file must be a mapping of key: value lines", path);
  if (is_primus_experiment(root)) {
    merge_primus(root, path, walk);
    return;
  }

  // Includes first, whatever their position in the file, so this file's keys override them.
  std::set<std::string> seen;
  for (const auto& kv : root) {
    const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "";
    if (key.empty()) fail("{}: config keys must be plain names", at(path, kv.first.Mark()));
    if (!seen.insert(key).second)
      fail("{}: key '{}' appears twice in the same file", at(path, kv.first.Mark()), quote_excerpt(key));
    if (!is_include_key(key)) continue;
    for (const auto& [inc, mark] : include_list(kv.first, kv.second, path)) {
      const std::string where = at(path, mark);
      merge_file(resolve_include(path, inc), walk,
                 fmt::format("{}: {} '{}'", where, key, quote_excerpt(inc, kMaxQuotedPath)));
    }
  }
  for (const auto& kv : root) {
    const std::string key = kv.first.Scalar();
    if (is_include_key(key)) continue;
    const std::string where = at(path, kv.first.Mark());
    const KeySpec* spec = find_config_key(key);
    if (!spec) fail_unknown_key(key, where);
    // A missing value has no line of its own (yaml-cpp marks the next one): name the key's.
    const YAML::Mark mark = kv.second.IsNull() ? kv.first.Mark() : kv.second.Mark();
    store(key, parse_node(*spec, kv.second, at(path, mark)), where);
  }
}

// Includes (extends/bases and the module's model file) first, then the module's overrides
// that flux8 knows; the rest in one warning.
void Config::merge_primus(const YAML::Node& root, const std::string& path, IncludeWalk& walk) {
  const PrimusExperiment e = read_primus_experiment(root, path);
  for (const auto& [inc, where] : e.includes)
    merge_file(resolve_include(path, inc), walk, fmt::format("{} '{}'", where, quote_excerpt(inc, kMaxQuotedPath)));
  for (const PrimusSetting& s : e.settings)
    store(s.key, parse_node(*find_config_key(s.key), s.value, s.where), s.where);
  if (const std::string w = primus_ignored_warning(e, path); !w.empty()) warnings_.push_back(w);
}

// An alias (schema.h: KeyAlias) sets its key too, with the alias named in the provenance.
void Config::store(const std::string& key, ConfigValue value, const std::string& source) {
  if (const KeyAlias* alias = find_key_alias(key)) {
    const std::string& given = std::get<std::string>(value);
    for (const auto& [from, to] : alias->values)
      if (from == given) entries_[alias->key] = Entry{to, fmt::format("{} ({})", source, key)};
  }
  entries_[key] = Entry{std::move(value), source};
}

// Two aliases of one key set to different values (exp_avg_dtype bf16, exp_avg_sq_dtype fp32):
// flux8 has one key for both, so it cannot honour them.
void Config::check_aliases_agree() const {
  for (const KeyAlias& a : config_key_aliases())
    for (const KeyAlias& b : config_key_aliases()) {
      if (a.key != b.key || a.alias >= b.alias) continue;
      const Entry &x = entry(a.alias), &y = entry(b.alias);
      if (x.source == "default" || y.source == "default" || x.value == y.value) continue;
      fail("{} is {} ({}) but {} is {} ({}): flux8 keeps both in one type, {}; set both to the same value", a.alias,
           std::get<std::string>(x.value), x.source, b.alias, std::get<std::string>(y.value), y.source, a.key);
    }
}

void Config::apply_override(const std::string& key_equals_value) {
  const size_t eq = key_equals_value.find('=');
  if (eq == std::string::npos)
    fail("--set '{}' must have the form key=value (e.g. --set micro_batch_size=4)", quote_excerpt(key_equals_value));
  std::string key = key_equals_value.substr(0, eq);
  key.erase(0, key.find_first_not_of(" \t"));
  key.erase(key.find_last_not_of(" \t") + 1);
  if (key.empty())
    fail("--set '{}' has no key before '=' (the form is key=value, e.g. --set micro_batch_size=4)",
         quote_excerpt(key_equals_value));
  set(key, key_equals_value.substr(eq + 1), "--set");
}

void Config::set(const std::string& key, const std::string& value_yaml, const std::string& source) {
  const KeySpec* spec = find_config_key(key);
  if (!spec) fail_unknown_key(key, source);
  store(key, parse_config_value(*spec, value_yaml, source), source);
}

const Config::Entry& Config::entry(const std::string& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) fail("flux8 bug: config key '{}' is read but not registered in src/config/schema.cpp", key);
  return it->second;
}

const ConfigValue& Config::get(const std::string& key) const { return entry(key).value; }
const std::string& Config::source(const std::string& key) const { return entry(key).source; }

namespace {
template <typename T>
const T& typed(const ConfigValue& v, const std::string& key, const char* getter) {
  if (const T* p = std::get_if<T>(&v)) return *p;
  fail("flux8 bug: {}('{}') called on a key of another type", getter, key);
}
}  // namespace

int64_t Config::get_int(const std::string& key) const { return typed<int64_t>(get(key), key, "get_int"); }
double Config::get_float(const std::string& key) const {
  if (const int64_t* i = std::get_if<int64_t>(&get(key))) return static_cast<double>(*i);
  return typed<double>(get(key), key, "get_float");
}
bool Config::get_bool(const std::string& key) const { return typed<bool>(get(key), key, "get_bool"); }
std::string Config::get_string(const std::string& key) const { return typed<std::string>(get(key), key, "get_string"); }
std::vector<int64_t> Config::get_int_list(const std::string& key) const {
  return typed<std::vector<int64_t>>(get(key), key, "get_int_list");
}
std::vector<double> Config::get_float_list(const std::string& key) const {
  if (const auto* i = std::get_if<std::vector<int64_t>>(&get(key))) return std::vector<double>(i->begin(), i->end());
  return typed<std::vector<double>>(get(key), key, "get_float_list");
}

std::vector<std::string> changed_keys(const Config& before, const Config& now) {
  std::vector<std::string> out;
  for (const KeySpec& k : config_keys()) {
    if (find_key_alias(k.name) || before.get(k.name) == now.get(k.name)) continue;
    out.push_back(fmt::format("{}: {} (was {})", k.name, format_key_value(k, now.get(k.name)),
                              format_key_value(k, before.get(k.name))));
  }
  return out;
}

std::string Config::dump() const {
  std::string out = "# flux8 resolved config; trailing comments say where each value came from\n";
  std::string section;
  for (const KeySpec& k : config_keys()) {
    if (find_key_alias(k.name)) continue;  // its key holds the value, with the alias in its provenance
    if (k.section != section) {
      section = k.section;
      out += fmt::format("\n# ---- {} ----\n", section);
    }
    const Entry& e = entry(k.name);
    out += fmt::format("{}: {}  # {}\n", k.name, format_key_value(k, e.value), e.source);
  }
  return out;
}

}  // namespace flux8

namespace flux8 {

std::string convert_primus_experiment(const std::string& path) {
  check_regular_file(path, "", false);
  std::string error;
  const std::optional<std::string> text = read_file_text(path, error, kMaxConfigFileBytes);
  if (!text) fail("cannot read '{}': {}", quote_excerpt(path, kMaxQuotedPath), error);
  const YAML::Node root = load_yaml(*text, path);
  if (!is_primus_experiment(root))
    fail("{} is not a Primus experiment (it has no `modules:` mapping); flux8 reads it as it is: flux8 config -c {}",
         path, path);
  const PrimusExperiment e = read_primus_experiment(root, path);
  std::string out = fmt::format("# flux8 config converted from the Primus experiment {} (module {})\n", path, e.module);
  if (!e.ignored.empty()) out += fmt::format("# left out, no flux8 meaning: {}\n", fmt::join(e.ignored, ", "));
  if (!e.includes.empty()) {
    out += "include:  # relative to the directory of " + path + "\n";
    for (const auto& [inc, where] : e.includes) out += fmt::format("  - {}  # {}\n", inc, where);
  }
  for (const PrimusSetting& s : e.settings) {
    const KeySpec& spec = *find_config_key(s.key);
    out += fmt::format("{}: {}  # {}\n", s.key, format_key_value(spec, parse_node(spec, s.value, s.where)), s.where);
  }
  return out;
}

}  // namespace flux8
