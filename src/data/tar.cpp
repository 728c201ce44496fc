#include "data/tar.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>

#include "core/error.h"

namespace flux8 {
namespace {

constexpr uint64_t kBlock = 512;

uint64_t round_up(uint64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

bool all_zero(const uint8_t* b) {
  return std::all_of(b, b + kBlock, [](uint8_t c) { return c == 0; });
}

// A NUL-terminated (or field-filling) text field.
std::string field_text(const uint8_t* p, size_t n) {
  size_t len = 0;
  while (len < n && p[len] != 0) ++len;
  return std::string(reinterpret_cast<const char*>(p), len);
}

// Octal text (leading spaces, terminated by NUL or space), or GNU base-256: first byte 0x80,
// the remaining bytes a big-endian number. Returns false when the field is not a number.
bool parse_number(const uint8_t* p, size_t n, uint64_t& out) {
  out = 0;
  if (p[0] & 0x80) {
    if (p[0] != 0x80) return false;  // negative or oversized
    for (size_t i = 1; i < n; ++i) {
      if (out >> 56) return false;
      out = (out << 8) | p[i];
    }
    return true;
  }
  size_t i = 0;
  while (i < n && p[i] == ' ') ++i;
  bool any = false;
  for (; i < n && p[i] >= '0' && p[i] <= '7'; ++i) {
    if (out >> 60) return false;
    out = out * 8 + static_cast<uint64_t>(p[i] - '0');
    any = true;
  }
  for (; i < n; ++i)
    if (p[i] != 0 && p[i] != ' ') return false;
  return any;
}

std::string errno_text() { return std::strerror(errno); }

// Applies the records of a pax extended header ("<len> <key>=<value>\n" ...) that flux8 uses.
void apply_pax(const std::vector<uint8_t>& data, std::string& path, uint64_t& size, bool& has_size,
               const std::function<void(const std::string&)>& bad) {
  size_t pos = 0;
  while (pos < data.size()) {
    if (data[pos] == 0) break;  // some writers pad with NULs
    size_t sp = pos;
    uint64_t len = 0;
    while (sp < data.size() && data[sp] >= '0' && data[sp] <= '9')
      len = len * 10 + static_cast<uint64_t>(data[sp++] - '0');
    if (sp >= data.size() || data[sp] != ' ' || len == 0 || pos + len > data.size() || data[pos + len - 1] != '\n')
      bad(fmt::format("malformed pax record at byte {} of the extended header", pos));
    const char* text = reinterpret_cast<const char*>(data.data());
    const std::string rec(text + sp + 1, text + pos + len - 1);  // without the '\n'
    const size_t eq = rec.find('=');
    if (eq == std::string::npos) bad(fmt::format("pax record '{}' has no '='", rec));
    const std::string key = rec.substr(0, eq), value = rec.substr(eq + 1);
    if (key == "path") {
      path = value;
    } else if (key == "size") {
      uint64_t v = 0;
      if (value.empty() || value.size() > 19 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; }))
        bad(fmt::format("pax size '{}' is not a number", value));
      for (char c : value) v = v * 10 + static_cast<uint64_t>(c - '0');
      size = v;
      has_size = true;
    }
    pos += len;
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Reader

TarReader::TarReader(const std::string& path) : path_(path) {
  file_.reset(std::fopen(path.c_str(), "rbe"));
  if (!file_) fail("shard {}: cannot open: {}", path, errno_text());
  struct stat st {};
  if (::fstat(::fileno(file_.get()), &st) != 0) {
    const std::string err = errno_text();
    file_.reset();
    fail("shard {}: cannot stat: {}", path, err);
  }
  file_size_ = static_cast<uint64_t>(st.st_size);
}

void TarReader::fail_at(const std::string& member, const std::string& what) const {
  fail("shard {}, member {}: {}", path_, member, what);
}

std::string TarReader::position() const {
  return last_name_.empty() ? std::string("(none yet: first header)") : "after " + last_name_;
}

void TarReader::seek(uint64_t offset) {
  if (::fseeko(file_.get(), static_cast<off_t>(offset), SEEK_SET) != 0)
    fail("shard {}: cannot seek to byte {}: {}", path_, offset, errno_text());
}

bool TarReader::read_block(uint8_t* block, const char* what) {
  const size_t got = std::fread(block, 1, kBlock, file_.get());
  if (got == kBlock) {
    pos_ += kBlock;
    return true;
  }
  if (std::ferror(file_.get())) fail("shard {}: read error at byte {}: {}", path_, pos_, errno_text());
  if (got == 0) return false;
  fail_at(position(), fmt::format("the file ends {} bytes into a 512-byte {} block at byte {} (truncated "
                                  "shard; re-copy or regenerate it)",
                                  got, what, pos_));
}

bool TarReader::next(TarMember& member) {
  if (ended_) return false;
  if (data_pending_) {
    pos_ = current_.data_offset + round_up(current_.size);
    seek(pos_);
    data_pending_ = false;
  }
  std::string long_name, pax_path;
  uint64_t pax_size = 0;
  bool has_pax_size = false;
  uint8_t h[kBlock];
  for (;;) {
    const uint64_t header_at = pos_;
    const std::string where = position();
    if (!read_block(h, "header")) {  // EOF on a block boundary: tolerated missing end marker
      if (!long_name.empty() || !pax_path.empty())
        fail_at(where,
                "the file ends after a long-name/pax header, before its member "
                "(truncated shard)");
      ended_ = true;
      return false;
    }
    if (all_zero(h)) {
      ended_ = true;
      return false;
    }
    uint64_t stored = 0;
    if (!parse_number(h + 148, 8, stored))
      fail_at(where, fmt::format("header at byte {} has no valid checksum field; this is not a tar "
                                 "header (corrupt shard)",
                                 header_at));
    uint64_t sum = 0;
    int64_t signed_sum = 0;  // some old writers summed signed chars
    for (uint64_t i = 0; i < kBlock; ++i) {
      const uint8_t c = (i >= 148 && i < 156) ? uint8_t(' ') : h[i];
      sum += c;
      signed_sum += static_cast<int8_t>(c);
    }
    if (stored != sum && static_cast<int64_t>(stored) != signed_sum)
      fail_at(where, fmt::format("header at byte {} has checksum {} but its bytes sum to {} "
                                 "(corrupt shard; re-copy or regenerate it)",
                                 header_at, stored, sum));

    std::string name = field_text(h, 100);
    // POSIX ustar ("ustar\0") keeps a path prefix; GNU ("ustar  ") uses that area otherwise.
    if (std::memcmp(h + 257, "ustar\0", 6) == 0) {
      const std::string prefix = field_text(h + 345, 155);
      if (!prefix.empty()) name = prefix + "/" + name;
    }
    const std::string shown = !pax_path.empty() ? pax_path : !long_name.empty() ? long_name : name;
    uint64_t size = 0;
    if (!parse_number(h + 124, 12, size))
      fail_at(shown, fmt::format("header at byte {} has an invalid size field", header_at));
    if (has_pax_size) size = pax_size;
    const char type = static_cast<char>(h[156]);
    const uint64_t data_at = pos_;
    if (data_at + round_up(size) > file_size_)
      fail_at(shown, fmt::format("header says {} data bytes (padded to {}) from byte {}, but the "
                                 "file ends at byte {} (truncated shard; re-copy or regenerate it)",
                                 size, round_up(size), data_at, file_size_));

    if (type == 'L' || type == 'x' || type == 'g' || type == 'K') {
      if (size > (64u << 20)) fail_at(shown, fmt::format("extended header of {} bytes is implausibly large", size));
      std::vector<uint8_t> data(size);
      if (size > 0 && std::fread(data.data(), 1, size, file_.get()) != size)
        fail_at(shown, "short read in an extended header");
      pos_ = data_at + round_up(size);
      seek(pos_);
      if (type == 'L') {
        long_name = field_text(data.data(), data.size());
      } else if (type == 'x') {
        apply_pax(data, pax_path, pax_size, has_pax_size, [&](const std::string& what) { fail_at(shown, what); });
      }
      continue;  // 'g' (global pax) and 'K' (long link name) carry nothing flux8 uses
    }

    const std::string full = !pax_path.empty() ? pax_path : !long_name.empty() ? long_name : name;
    if (type == '0' || type == '\0' || type == '7') {
      current_ = TarMember{full, size, data_at};
      last_name_ = full;
      data_pending_ = true;
      member = current_;
      return true;
    }
    // Directories, links, devices: no data of interest; skip whatever data they declare.
    last_name_ = full;
    long_name.clear();
    pax_path.clear();
    has_pax_size = false;
    pos_ = data_at + round_up(size);
    seek(pos_);
  }
}

std::vector<uint8_t> TarReader::read_data() {
  if (!data_pending_) fail("shard {}: read_data() without a current member (or read twice)", path_);
  std::vector<uint8_t> data(current_.size);
  if (current_.size > 0 && std::fread(data.data(), 1, current_.size, file_.get()) != current_.size)
    fail_at(current_.name, fmt::format("short read of {} bytes at byte {} (file changed while "
                                       "reading?)",
                                       current_.size, current_.data_offset));
  pos_ = current_.data_offset + round_up(current_.size);
  seek(pos_);
  data_pending_ = false;
  return data;
}

std::vector<uint8_t> read_file_range(const std::string& path, uint64_t offset, uint64_t size, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("shard {}, member {}: cannot open: {}", path, what, errno_text());
  std::vector<uint8_t> data(size);
  uint64_t done = 0;
  while (done < size) {
    const ssize_t r = ::pread(fd, data.data() + done, size - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      const std::string err = r < 0 ? errno_text() : std::string("end of file");
      ::close(fd);
      fail(
          "shard {}, member {}: cannot read {} bytes at byte {}: {} (shard changed or truncated "
          "since it was indexed?)",
          path, what, size, offset, err);
    }
    done += static_cast<uint64_t>(r);
  }
  ::close(fd);
  return data;
}

// ---------------------------------------------------------------------------------------------
// Writer

TarWriter::TarWriter(const std::string& path) : path_(path), tmp_(path + ".tmp." + std::to_string(::getpid())) {
  file_.reset(std::fopen(tmp_.c_str(), "wbe"));
  if (!file_) fail("tar writer: cannot create '{}': {}", tmp_, errno_text());
}

TarWriter::~TarWriter() {
  file_.reset();
  if (!finished_) ::unlink(tmp_.c_str());
}

void TarWriter::write(const void* data, size_t n) {
  if (n > 0 && std::fwrite(data, 1, n, file_.get()) != n)
    fail("tar writer: cannot write '{}': {} (disk full?)", tmp_, errno_text());
}

void TarWriter::write_header(const std::string& name, uint64_t size, char type) {
  uint8_t h[kBlock] = {};
  std::memcpy(h, name.data(), std::min<size_t>(name.size(), 100));
  std::snprintf(reinterpret_cast<char*>(h + 100), 8, "%07o", 0644);
  std::snprintf(reinterpret_cast<char*>(h + 108), 8, "%07o", 0);
  std::snprintf(reinterpret_cast<char*>(h + 116), 8, "%07o", 0);
  if (size < (uint64_t(1) << 33)) {
    std::snprintf(reinterpret_cast<char*>(h + 124), 12, "%011llo", static_cast<unsigned long long>(size));
  } else {  // GNU base-256 for members of 8 GiB and more
    h[124] = 0x80;
    for (int i = 0; i < 8; ++i) h[135 - i] = static_cast<uint8_t>(size >> (8 * i));
  }
  std::snprintf(reinterpret_cast<char*>(h + 136), 12, "%011o", 0);
  h[156] = static_cast<uint8_t>(type);
  if (type == 'L') {
    std::memcpy(h + 257, "ustar  ", 8);  // GNU magic + version, as GNU tar writes long names
  } else {
    std::memcpy(h + 257, "ustar", 6);
    std::memcpy(h + 263, "00", 2);
  }
  std::memset(h + 148, ' ', 8);
  unsigned sum = 0;
  for (uint8_t c : h) sum += c;
  std::snprintf(reinterpret_cast<char*>(h + 148), 8, "%06o", sum);  // 6 digits, NUL, space
  h[155] = ' ';
  write(h, kBlock);
}

void TarWriter::add(const std::string& name, const void* data, size_t size) {
  if (finished_) fail("tar writer: add('{}') after finish() of '{}'", name, path_);
  if (name.empty()) fail("tar writer: empty member name in '{}'", path_);
  static const uint8_t zeros[kBlock] = {};
  if (name.size() > 100) {
    write_header("././@LongLink", name.size() + 1, 'L');
    write(name.c_str(), name.size() + 1);
    write(zeros, round_up(name.size() + 1) - (name.size() + 1));
  }
  write_header(name, size, '0');
  write(data, size);
  write(zeros, round_up(size) - size);
}

void TarWriter::finish() {
  if (finished_) return;
  static const uint8_t zeros[2 * kBlock] = {};
  write(zeros, sizeof zeros);
  if (std::fflush(file_.get()) != 0) fail("tar writer: cannot flush '{}': {}", tmp_, errno_text());
  if (::fsync(::fileno(file_.get())) != 0) fail("tar writer: cannot fsync '{}': {}", tmp_, errno_text());
  std::FILE* f = file_.release();
  if (std::fclose(f) != 0) fail("tar writer: cannot close '{}': {}", tmp_, errno_text());
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail("tar writer: cannot rename '{}' to '{}': {}", tmp_, path_, errno_text());
  finished_ = true;
  // The rename is durable only once the directory entry is on disk.
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace flux8
