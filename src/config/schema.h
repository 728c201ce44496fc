#pragma once
// The config schema: every YAML/--set key flux8 understands, declared once (schema.cpp) with
// its type, default, allowed range or choices, section and one-line help. The Config loader,
// `flux8 config --list` and docs/CONFIG.md all follow this table, so an unknown key is always
// an error and never silently ignored.
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace flux8 {

enum class KeyType { integer, real, boolean, string, choice, int_list, float_list };

// One resolved value. `choice` keys hold their choice as a std::string.
using ConfigValue = std::variant<int64_t, double, bool, std::string, std::vector<int64_t>, std::vector<double>>;

// Closed or open numeric interval; applies to scalars and to every element of a list.
struct Range {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;  // lo itself excluded ("> 0" rather than ">= 0")
  bool contains(double v) const { return (lo_open ? v > lo : v >= lo) && v <= hi; }
  std::string describe() const;  // ">= 1", "> 0", "in [0, 1]", "" when unbounded
};

struct KeySpec {
  std::string name;
  std::string section;  // "model", "runtime", ...
  KeyType type;
  ConfigValue default_value;
  Range range;
  std::vector<std::string> choices;  // only for KeyType::choice
  std::string help;
};

// A key under another framework's name (Megatron's exp_avg_dtype for adam_moment_precision):
// registered like any key, but setting it sets `key` to the mapped value, and the resolved config
// (dump()) shows only `key`, whose provenance names the alias.
struct KeyAlias {
  std::string alias, key;
  std::vector<std::pair<std::string, std::string>> values;  // the alias's value -> the key's
};
const std::vector<KeyAlias>& config_key_aliases();
const KeyAlias* find_key_alias(std::string_view name);  // nullptr when `name` is no alias

// All registered keys, in table order (which is also the order of dump() and docs).
const std::vector<KeySpec>& config_keys();
// nullptr when `name` is not registered.
const KeySpec* find_config_key(std::string_view name);
// The registered key closest to `name` by edit distance, or "" when none is close enough.
std::string closest_config_key(std::string_view name);

std::string_view key_type_name(KeyType t);  // "int", "float", "bool", ...
// A value as YAML flow text: 3072, 1e-06, true, "flux", [16, 56, 56].
std::string format_config_value(const ConfigValue& v);
// As format_config_value, but enum choices unquoted (they are plain identifiers).
std::string format_key_value(const KeySpec& spec, const ConfigValue& v);
// What is allowed for a key, e.g. "an integer >= 1" or "one of: cpu, cuda".
std::string describe_allowed(const KeySpec& spec);

// The key table as plain text, grouped by section (`flux8 config --list`).
std::string describe_keys();

}  // namespace flux8
