#pragma once
// Whole-file text reads and JSON parsing that leave the error message to the caller, which
// knows what the file is and what to do about it.
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace flux8 {

// The file's bytes, or nullopt when it cannot be opened (errno says why).
std::optional<std::string> read_file_text(const std::string& path);

// `text` parsed, or nullopt with the parser's message in `error`.
std::optional<nlohmann::json> parse_json(std::string_view text, std::string& error);

}  // namespace flux8
