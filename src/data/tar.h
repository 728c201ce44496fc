#pragma once
// Tar archives as WebDataset shards use them: a streaming reader and a small writer.
//
// Format (POSIX.1-1988 ustar, with the GNU and POSIX.1-2001 pax extensions that real shards
// contain): a sequence of 512-byte blocks. Each member is one header block followed by its data
// rounded up to whole blocks; the archive ends with two all-zero blocks. Header fields used here:
//   name[0,100) mode[100,108) uid gid size[124,136) mtime[136,148) chksum[148,156) typeflag[156]
//   linkname[157,257) magic[257,263) version[263,265) ... prefix[345,500)
// Numbers are octal text (size may be GNU base-256 when its first byte has the top bit set).
// The checksum is the sum of the header bytes with the chksum field counted as spaces.
// Type '0' / NUL / '7' is a regular file; 'L' (GNU) holds the long name of the next member;
// 'x' (pax) holds "len key=value\n" records for the next member (path=, size=); 'g' (pax global),
// 'K', directories and links are skipped.
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace flux8 {

struct TarMember {
  std::string name;          // full path inside the archive (long and pax names applied)
  uint64_t size = 0;         // data bytes
  uint64_t data_offset = 0;  // where the data starts in the file (for random access later)
  // Why the member cannot be used though the archive around it is sound (its long-name or pax
  // header was malformed or oversized); empty for a good member. read_data() fails with it.
  std::string fault;
};

// An open stdio file, closed when its owner goes away.
struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using FileHandle = std::unique_ptr<std::FILE, FileCloser>;

// Reads the regular-file members of a tar archive in order, from a file or from bytes in
// memory. Every header's checksum is verified, and every size a header gives is checked against
// the bytes left in the archive before it is used: a member whose data (or padding) runs past
// the end is reported as truncated as soon as its header is read, so reading and skipping find
// the same faults, and nothing is allocated beyond what the archive holds. Each header read
// moves forward by at least one block, so any input ends in time. End of archive is a zero
// block; an archive that simply ends on a block boundary after a member is accepted (missing end
// marker), a partial block is not.
//
// Faults come in two kinds. A member whose extended header (GNU long name, pax records) is
// malformed is returned with `fault` set: the archive's framing is intact and the next member
// can be read. A header that fails its checksum, a size field that is not a number, or a size
// past the end leave no trustworthy position: next() fails, and the rest of the archive cannot
// be read. Errors are flux8::Error naming archive and member: "shard <path>, member <name>: ...".
class TarReader {
 public:
  // A tar file (a regular file: a memfd's /proc/self/fd/N path is one).
  explicit TarReader(const std::string& path);
  // Bytes in memory, named `name` in errors; `bytes` must outlive the reader.
  TarReader(std::string name, std::string_view bytes);
  ~TarReader();
  TarReader(const TarReader&) = delete;
  TarReader& operator=(const TarReader&) = delete;

  const std::string& path() const { return path_; }
  // True for a reader of bytes in memory (no file to read members from by random access).
  bool in_memory() const { return fd_ < 0; }

  // Advances to the next regular-file member (skipping the unread data of the current one).
  // Returns false at the end of the archive.
  bool next(TarMember& member);
  // The data of the current member; once per member, before the next call to next(). Fails
  // for a member with a fault.
  std::vector<uint8_t> read_data();

 private:
  void read_at(uint64_t offset, void* dst, size_t n, const std::string& member) const;
  bool read_header(uint8_t* block);  // false at the end of the archive's bytes
  [[noreturn]] void fail_at(const std::string& member, const std::string& what) const;
  std::string position() const;  // "after <last member>": a header that cannot be trusted

  std::string path_;
  int fd_ = -1;
  const char* bytes_ = nullptr;  // the archive in memory (fd_ < 0)
  uint64_t file_size_ = 0;
  uint64_t pos_ = 0;       // offset of the next header block when no data is pending
  std::string last_name_;  // previous member, for errors in a header that cannot be trusted
  TarMember current_;
  uint64_t current_end_ = 0;   // offset after current_'s padded data
  bool data_pending_ = false;  // current_'s data has not been read
  bool ended_ = false;
};

// Reads `size` bytes at `offset` of a file (random access into a shard for a member found
// earlier); `what` names it in errors. Fails, before allocating, when the file holds fewer.
std::vector<uint8_t> read_file_range(const std::string& path, uint64_t offset, uint64_t size, const std::string& what);

// Writes a tar file (regular members, ustar headers, GNU long-name entries for names over 100
// bytes, mode 0644, mtime 0 so equal content gives equal bytes). Writes path + ".tmp.<pid>",
// and finish() adds the end marker, fsyncs, renames over `path` and fsyncs the directory; a
// writer destroyed before finish() removes its temp file.
class TarWriter {
 public:
  explicit TarWriter(const std::string& path);
  ~TarWriter();
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;

  void add(const std::string& name, const void* data, size_t size);
  void add(const std::string& name, const std::string& text) { add(name, text.data(), text.size()); }
  void finish();

 private:
  void write(const void* data, size_t n);
  void write_header(const std::string& name, uint64_t size, char type);

  std::string path_, tmp_;
  FileHandle file_;
  bool finished_ = false;
};

}  // namespace flux8
