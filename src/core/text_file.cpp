#include "core/text_file.h"

#include <fstream>
#include <sstream>

namespace flux8 {

std::optional<std::string> read_file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::optional<nlohmann::json> parse_json(std::string_view text, std::string& error) {
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    error = e.what();
    return std::nullopt;
  }
}

}  // namespace flux8
