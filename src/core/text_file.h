#pragma once
// Whole-file text reads and JSON parsing that leave the error message to the caller, which
// knows what the file is and what to do about it. Both are bounded: a read refuses what is not
// a regular file or is larger than the caller allows (a config that includes /dev/zero must not
// read until memory runs out), and a parse refuses nesting deeper than `kMaxJsonDepth` (a crafted
// header of nested brackets must not exhaust the stack when the value is later walked or printed).
#include <nlohmann/json.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace flux8 {

// Text files flux8 reads whole (configs, manifests, trainer state) are kilobytes; 64 MiB leaves
// room for any real one.
inline constexpr uint64_t kMaxTextFileBytes = 64ull << 20;
// JSON flux8 reads is at most a few levels deep (safetensors headers: 3).
inline constexpr int kMaxJsonDepth = 64;

// The file's bytes, or nullopt with the reason in `error` (cannot be opened: errno's text; not a
// regular file; larger than max_bytes).
std::optional<std::string> read_file_text(const std::string& path, std::string& error,
                                          uint64_t max_bytes = kMaxTextFileBytes);

// The file's bytes; fails with "cannot read <what> '<path>': <reason>" otherwise.
std::string read_text_or_fail(const std::string& path, std::string_view what, uint64_t max_bytes = kMaxTextFileBytes);

// `text` parsed, or nullopt with the reason in `error`: the parser's message, a number outside
// double's range, or nesting deeper than max_depth.
std::optional<nlohmann::json> parse_json(std::string_view text, std::string& error, int max_depth = kMaxJsonDepth);

// A short quotation of untrusted text for an error message: at most `max_chars` characters,
// non-printable bytes escaped, "..." when cut.
std::string quote_excerpt(std::string_view text, size_t max_chars = 80);

}  // namespace flux8
