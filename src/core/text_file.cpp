#include "core/text_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace flux8 {

std::optional<std::string> read_file_text(const std::string& path, std::string& error, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. fstat on
  // the opened descriptor: what is checked is what is read, and a directory or a device is
  // refused before any read.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    error = std::strerror(errno);
    return std::nullopt;
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    error = "not a regular file";
    return std::nullopt;
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    error = fmt::format("{} bytes, more than the {} this file may have", st.st_size, max_bytes);
    return std::nullopt;
  }
  // A file that grew since fstat is read up to the size checked; one that shrank is cut short.
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      error = std::strerror(errno);
      return std::nullopt;
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
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
