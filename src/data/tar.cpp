#include "data/tar.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <optional>

#include "core/checked.h"
#include "core/error.h"
#include "core/text_file.h"

namespace flux8 {
namespace {

constexpr uint64_t kBlock = 512;
// Long names and pax records are a few hundred bytes; a larger extended header is not one flux8
// can use, and reading it would only spend memory.
constexpr uint64_t kMaxExtendedHeader = 1u << 20;

// `n` rounded up to whole blocks, or nullopt where that passes 2^64.
std::optional<uint64_t> padded_size(uint64_t n) {
  const std::optional<uint64_t> up = checked_add<uint64_t>(n, kBlock - 1);
  if (!up) return std::nullopt;
  return *up / kBlock * kBlock;
}

// Zero bytes after `n` data bytes up to the next block boundary.
size_t padding(size_t n) { return (kBlock - n % kBlock) % kBlock; }

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
// the remaining bytes a big-endian number. Returns false when the field is not a number or the
// number does not fit 64 bits.
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
    if (out >> 61) return false;
    out = out * 8 + static_cast<uint64_t>(p[i] - '0');
    any = true;
  }
  for (; i < n; ++i)
    if (p[i] != 0 && p[i] != ' ') return false;
  return any;
}

std::string errno_text() { return std::strerror(errno); }

// What a pax extended header says about the member after it.
struct PaxFields {
  std::string path;
  uint64_t size = 0;
  bool has_size = false;
};

// Applies the records of a pax extended header ("<len> <key>=<value>\n" ...) that flux8 uses.
// Every length is checked against the bytes left before it is used. Returns the fault, or an
// empty string.
std::string apply_pax(std::string_view data, PaxFields& out) {
  size_t pos = 0;
  while (pos < data.size()) {
    if (data[pos] == '\0') break;  // some writers pad with NULs
    const size_t left = data.size() - pos;
    size_t sp = pos;
    uint64_t len = 0;
    while (sp < data.size() && data[sp] >= '0' && data[sp] <= '9' && len <= left) {
      len = len * 10 + static_cast<uint64_t>(data[sp++] - '0');
    }
    // A record is "<len> <key>=<value>\n", its length counting itself: more than the digits
    // and the space, and no more than what is left.
    if (sp == pos || sp >= data.size() || data[sp] != ' ' || len > left || len < sp - pos + 2 ||
        data[pos + len - 1] != '\n')
      return fmt::format("malformed pax record at byte {} of the extended header: {}", pos,
                         quote_excerpt(data.substr(pos, 40)));
    const std::string_view rec = data.substr(sp + 1, pos + len - 1 - (sp + 1));  // without the '\n'
    const size_t eq = rec.find('=');
    if (eq == std::string_view::npos) return fmt::format("pax record '{}' has no '='", quote_excerpt(rec));
    const std::string_view key = rec.substr(0, eq), value = rec.substr(eq + 1);
    if (key == "path") {
      out.path = std::string(value);
    } else if (key == "size") {
      std::optional<uint64_t> v = value.empty() ? std::nullopt : std::optional<uint64_t>(0);
      for (size_t i = 0; v && i < value.size(); ++i) {
        const std::optional<uint64_t> tens = checked_mul<uint64_t>(*v, 10);
        v = value[i] >= '0' && value[i] <= '9' && tens
                ? checked_add<uint64_t>(*tens, static_cast<uint64_t>(value[i] - '0'))
                : std::nullopt;
      }
      if (!v) return fmt::format("pax size '{}' is not a number of bytes that fits 64 bits", quote_excerpt(value));
      out.size = *v;
      out.has_size = true;
    }
    pos += len;
  }
  return {};
}

// The checksum field of header `h` matches its bytes (the field counted as spaces; some old
// writers summed signed chars).
bool checksum_matches(const uint8_t* h, uint64_t stored, uint64_t& sum) {
  sum = 0;
  int64_t signed_sum = 0;
  for (uint64_t i = 0; i < kBlock; ++i) {
    const uint8_t c = (i >= 148 && i < 156) ? uint8_t(' ') : h[i];
    sum += c;
    signed_sum += static_cast<int8_t>(c);
  }
  return stored == sum || static_cast<int64_t>(stored) == signed_sum;
}

// The member name a header gives (POSIX ustar "ustar\0" keeps a path prefix; GNU "ustar  " uses
// that area otherwise).
std::string header_name(const uint8_t* h) {
  std::string name = field_text(h, 100);
  if (std::memcmp(h + 257, "ustar\0", 6) == 0) {
    const std::string prefix = field_text(h + 345, 155);
    if (!prefix.empty()) name = prefix + "/" + name;
  }
  return name;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Reader

TarReader::TarReader(const std::string& path) : path_(path) {
  // Non-blocking: opening a FIFO for reading would otherwise wait for a writer, forever. (On a
  // regular file the flag changes nothing.)
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) fail("shard {}: cannot open: {}", path, errno_text());
  struct stat st {};
  std::string problem;
  if (::fstat(fd_, &st) != 0)
    problem = "cannot stat: " + errno_text();
  else if (!S_ISREG(st.st_mode))
    problem = "not a regular file (a shard must be a .tar file)";
  if (!problem.empty()) {
    ::close(fd_);
    fd_ = -1;
    fail("shard {}: {}", path, problem);
  }
  file_size_ = static_cast<uint64_t>(st.st_size);
}

TarReader::TarReader(std::string name, std::string_view bytes)
    : path_(std::move(name)), bytes_(bytes.data()), file_size_(bytes.size()) {}

TarReader::~TarReader() {
  if (fd_ >= 0) ::close(fd_);
}

void TarReader::fail_at(const std::string& member, const std::string& what) const {
  fail("shard {}, member {}: {}", path_, member, what);
}

std::string TarReader::position() const {
  return last_name_.empty() ? std::string("(none yet: first header)") : "after " + last_name_;
}

// Callers have checked [offset, offset + n) against file_size_; a short read means the file
// shrank since it was opened.
void TarReader::read_at(uint64_t offset, void* dst, size_t n, const std::string& member) const {
  if (fd_ < 0) {
    if (n > 0) std::memcpy(dst, bytes_ + offset, n);
    return;
  }
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::pread(fd_, static_cast<char*>(dst) + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail_at(member, fmt::format("read error at byte {}: {}", offset + done, errno_text()));
    if (r == 0)
      fail_at(member, fmt::format("the file ends at byte {}, before the {} bytes at byte {} (did it change while "
                                  "being read?)",
                                  offset + done, n, offset));
    done += static_cast<size_t>(r);
  }
}

bool TarReader::read_header(uint8_t* block) {
  const uint64_t left = file_size_ - pos_;
  if (left == 0) return false;
  if (left < kBlock)
    fail_at(position(), fmt::format("the file ends {} bytes into a 512-byte header block at byte {} (truncated "
                                    "shard; re-copy or regenerate it)",
                                    left, pos_));
  read_at(pos_, block, kBlock, position());
  pos_ += kBlock;
  return true;
}

bool TarReader::next(TarMember& member) {
  if (ended_) return false;
  if (data_pending_) {
    pos_ = current_end_;
    data_pending_ = false;
  }
  std::string long_name, fault;
  PaxFields pax;
  bool extended = false;  // a long-name or pax header waits for its member
  uint8_t h[kBlock];
  for (;;) {
    const uint64_t header_at = pos_;
    const std::string where = position();
    if (!read_header(h)) {  // end on a block boundary: tolerated missing end marker
      if (extended) fail_at(where, "the file ends after a long-name/pax header, before its member (truncated shard)");
      ended_ = true;
      return false;
    }
    if (all_zero(h)) {
      ended_ = true;
      return false;
    }
    uint64_t stored = 0, sum = 0;
    if (!parse_number(h + 148, 8, stored))
      fail_at(where, fmt::format("header at byte {} has no valid checksum field; this is not a tar "
                                 "header (corrupt shard)",
                                 header_at));
    if (!checksum_matches(h, stored, sum))
      fail_at(where, fmt::format("header at byte {} has checksum {} but its bytes sum to {} "
                                 "(corrupt shard; re-copy or regenerate it)",
                                 header_at, stored, sum));
    const std::string name = !pax.path.empty() ? pax.path : !long_name.empty() ? long_name : header_name(h);
    uint64_t size = 0;
    if (!parse_number(h + 124, 12, size))
      fail_at(name, fmt::format("header at byte {} has an invalid size field (corrupt shard)", header_at));
    const char type = static_cast<char>(h[156]);
    const bool extension = type == 'L' || type == 'x' || type == 'g' || type == 'K';
    if (pax.has_size && !extension) size = pax.size;
    const uint64_t data_at = pos_;
    const std::optional<uint64_t> padded = padded_size(size);
    if (!padded || *padded > file_size_ - data_at)
      fail_at(name, fmt::format("header says {} data bytes from byte {}, but the file ends at byte {} "
                                "(truncated or corrupt shard; re-copy or regenerate it)",
                                size, data_at, file_size_));
    const uint64_t data_end = data_at + *padded;

    if (type == 'L' || type == 'x') {
      extended = true;
      if (size > kMaxExtendedHeader) {
        fault = fmt::format("its {} header of {} bytes is larger than the {} flux8 reads",
                            type == 'L' ? "long-name" : "pax", size, kMaxExtendedHeader);
      } else {
        std::string data(size, '\0');
        read_at(data_at, data.data(), data.size(), name);
        if (type == 'L') {
          long_name = field_text(reinterpret_cast<const uint8_t*>(data.data()), data.size());
        } else if (std::string bad = apply_pax(data, pax); !bad.empty()) {
          fault = std::move(bad);
        }
      }
      pos_ = data_end;
      continue;
    }
    if (type == 'g' || type == 'K') {  // global pax, long link name: nothing flux8 uses
      pos_ = data_end;
      continue;
    }
    last_name_ = name;
    if (type == '0' || type == '\0' || type == '7') {
      current_ = TarMember{name, size, data_at, fault};
      current_end_ = data_end;
      data_pending_ = true;
      member = current_;
      return true;
    }
    // Directories, links, devices: no data of interest; skip whatever data they declare.
    long_name.clear();
    fault.clear();
    pax = PaxFields{};
    extended = false;
    pos_ = data_end;
  }
}

std::vector<uint8_t> TarReader::read_data() {
  if (!data_pending_) fail("shard {}: read_data() without a current member (or read twice)", path_);
  data_pending_ = false;
  pos_ = current_end_;
  if (!current_.fault.empty()) fail_at(current_.name, current_.fault);
  // The size was checked against the file when the header was read: a valid member of this
  // size needs this memory too.
  std::vector<uint8_t> data;
  try {
    data.resize(current_.size);
  } catch (const std::bad_alloc&) {
    fail_at(current_.name, fmt::format("{} data bytes do not fit in memory", current_.size));
  }
  read_at(current_.data_offset, data.data(), data.size(), current_.name);
  return data;
}

std::vector<uint8_t> read_file_range(const std::string& path, uint64_t offset, uint64_t size, const std::string& what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // as TarReader's
  if (fd < 0) fail("shard {}, member {}: cannot open: {}", path, what, errno_text());
  struct stat st {};
  const std::optional<uint64_t> end = checked_add(offset, size);
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || !end || *end > static_cast<uint64_t>(st.st_size)) {
    ::close(fd);
    fail(
        "shard {}, member {}: the file no longer holds {} bytes at byte {} (shard changed or truncated since it was "
        "indexed?)",
        path, what, size, offset);
  }
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
    write(zeros, padding(name.size() + 1));
  }
  write_header(name, size, '0');
  write(data, size);
  write(zeros, padding(size));
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
