#include "core/text_file.h"

#include "core/error.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace flux8 {

std::optional<std::string> read_file_text(const std::string& path, std::string& error, uint64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    error = std::strerror(errno);
    return std::nullopt;
  }
  // stat after open: the size checked is the file's that was opened, and a directory (which
  // ifstream opens on Linux) or a device is refused before any read.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    error = "not a regular file";
    return std::nullopt;
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    error = fmt::format("{} bytes, more than the {} this file may have", st.st_size, max_bytes);
    return std::nullopt;
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  // A file that grew since stat is read up to the size checked; one that shrank is cut short.
  text.resize(static_cast<size_t>(in.gcount()));
  return text;
}

std::string read_text_or_fail(const std::string& path, std::string_view what, uint64_t max_bytes) {
  std::string error;
  std::optional<std::string> text = read_file_text(path, error, max_bytes);
  if (!text) fail("cannot read {} '{}': {}", what, path, error);
  return std::move(*text);
}

std::optional<nlohmann::json> parse_json(std::string_view text, std::string& error, int max_depth) {
  // The parser's callback sees every value's depth as it is parsed: throwing from it stops the
  // parse before the deep value is built.
  struct TooDeep {};
  const nlohmann::json::parser_callback_t limit_depth = [max_depth](int depth, nlohmann::json::parse_event_t,
                                                                    nlohmann::json&) {
    if (depth > max_depth) throw TooDeep{};
    return true;
  };
  try {
    return nlohmann::json::parse(text.begin(), text.end(), limit_depth);
  } catch (const TooDeep&) {
    error = fmt::format("nested more than {} levels deep", max_depth);
  } catch (const nlohmann::json::exception& e) {
    error = e.what();
  }
  return std::nullopt;
}

std::string quote_excerpt(std::string_view text, size_t max_chars) {
  std::string out;
  for (size_t i = 0; i < text.size() && i < max_chars; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f)
      out += static_cast<char>(c);
    else
      out += fmt::format("\\x{:02x}", c);
  }
  if (text.size() > max_chars) out += "...";
  return out;
}

}  // namespace flux8
