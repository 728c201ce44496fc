#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <future>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <utility>

#include "core/checked.h"
#include "core/error.h"
#include "core/sha256.h"
#include "core/text_file.h"

namespace flux8 {

// The format is little-endian; raw copies below assume the host is too.
static_assert(std::endian::native == std::endian::little, "flux8 assumes a little-endian host");

namespace {

using json = nlohmann::json;

// Element sizes of every dtype the format defines, so files holding tensors flux8 does not
// convert (U8 masks, FP8 weights) still open and list.
size_t element_size(const std::string& dtype) {
  static const std::map<std::string, size_t> sizes = {
      {"BOOL", 1}, {"U8", 1},   {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}, {"I16", 2}, {"U16", 2},
      {"F16", 2},  {"BF16", 2}, {"I32", 4}, {"U32", 4},     {"F32", 4},     {"I64", 8},     {"U64", 8}, {"F64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

template <typename Src>
Src load(const uint8_t* p) {
  Src v;
  std::memcpy(&v, p, sizeof(Src));  // data may be unaligned
  return v;
}

// The header is untrusted: a name, a dtype or a library's message about it is quoted in an
// error as a short excerpt, never whole.
std::string in_quotes(std::string_view text) { return "'" + quote_excerpt(text, 160) + "'"; }

// A header value for an error message, without serialising a container (which may be large).
std::string describe(const json& v) {
  if (v.is_string()) return "the string " + in_quotes(v.get_ref<const std::string&>());
  if (v.is_array()) return fmt::format("a list of {}", v.size());
  if (v.is_object()) return "an object";
  return v.dump();  // a number, true, false or null: a few characters
}

// A shape entry or byte offset as a count in [0, 2^63): nullopt with the reason in `why`.
std::optional<uint64_t> as_count(const json& v, std::string& why) {
  constexpr uint64_t kMax = uint64_t(std::numeric_limits<int64_t>::max());
  if (v.is_number_unsigned() && v.get<uint64_t>() <= kMax) return v.get<uint64_t>();
  if (v.is_number_unsigned() || (v.is_number_float() && v.get<double>() >= 0x1p63))
    why = fmt::format("{} is larger than 2^63-1", v.dump());
  else if (v.is_number_integer() || (v.is_number_float() && v.get<double>() < 0))
    why = fmt::format("{} is negative", v.dump());
  else if (v.is_number_float())
    why = fmt::format("{} is not an integer (counts are written without a decimal point or exponent)", v.dump());
  else
    why = describe(v) + " is not a number";
  return std::nullopt;
}

// The reference implementation's limit on the JSON header.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// How an error names the header entry it is about.
std::string entry_label(const std::string& name) {
  return name == "__metadata__" ? "entry __metadata__" : "tensor " + in_quotes(name);
}

// A first pass over the header with nlohmann's SAX parser, which is iterative (nesting costs it
// no stack), to find what the DOM parse would not say: which entry a syntax error, an
// out-of-range number or too deep a nesting is in, and a key that occurs twice in one object.
// The DOM parser keeps the last of two equal keys silently; the reference implementation
// refuses such a header, and so does flux8, since which entry is meant cannot be known.
class HeaderScan {
 public:
  std::string problem;  // empty when the header is well-formed
  std::string entry;    // the top-level key the problem is inside, if any

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const std::string&) { return true; }
  bool string(std::string&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(size_t) { return open(); }
  bool end_object() { return close(); }
  bool start_array(size_t) { return open(); }
  bool end_array() { return close(); }
  bool key(std::string& k) {
    if (keys_.size() == 1) top_key_ = k;
    if (keys_.back().insert(k).second) return true;
    if (keys_.size() == 1) {
      entry = k;
      problem = "it appears twice in the header";
      return false;
    }
    return stop(fmt::format("key {} appears twice in its entry", in_quotes(k)));
  }
  bool parse_error(size_t, const std::string&, const nlohmann::detail::exception& e) {
    return stop(fmt::format("header is not valid JSON: {}", quote_excerpt(e.what(), 200)));
  }

 private:
  bool open() {
    if (keys_.size() >= static_cast<size_t>(kMaxJsonDepth))
      return stop(fmt::format("header is nested more than {} levels deep", kMaxJsonDepth));
    keys_.emplace_back();  // one per open object or list: its size is the nesting depth
    return true;
  }
  bool close() {
    keys_.pop_back();
    return true;
  }
  // Records the problem, inside the current top-level entry when there is one.
  bool stop(std::string why) {
    problem = std::move(why);
    if (keys_.size() >= 2) entry = top_key_;
    return false;
  }

  std::vector<std::set<std::string>> keys_;
  std::string top_key_;
};

// The header's JSON at map[8, 8 + n), checked for size, syntax, nesting depth and duplicate keys;
// `header_bytes` is set to n.
json parse_header(const uint8_t* map, size_t size, const std::string& path, uint64_t& header_bytes) {
  const uint64_t n = load<uint64_t>(map);
  if (n > size - 8)
    fail("safetensors file '{}': header length {} exceeds the {} bytes after it (truncated?)", path, n, size - 8);
  if (n > kMaxHeaderBytes)
    fail("safetensors file '{}': header length {} exceeds the format's limit of {} bytes (not a safetensors file?)",
         path, n, kMaxHeaderBytes);
  header_bytes = n;
  const std::string_view text(reinterpret_cast<const char*>(map + 8), n);
  HeaderScan scan;
  json::sax_parse(text.begin(), text.end(), &scan);
  if (!scan.problem.empty())
    fail("safetensors file '{}'{}: {}", path, scan.entry.empty() ? "" : ", " + entry_label(scan.entry), scan.problem);
  std::string error;
  std::optional<json> parsed = parse_json(text, error);
  if (!parsed) fail("safetensors file '{}': header is not valid JSON: {}", path, quote_excerpt(error, 200));
  if (!parsed->is_object()) fail("safetensors file '{}': header is {}, not a JSON object", path, describe(*parsed));
  return std::move(*parsed);
}

std::map<std::string, std::string> read_metadata(const json& entry, const std::string& path) {
  if (!entry.is_object()) fail("safetensors file '{}': __metadata__ is {}, not an object", path, describe(entry));
  std::map<std::string, std::string> metadata;
  for (const auto& [k, v] : entry.items()) {
    if (!v.is_string())
      fail("safetensors file '{}': __metadata__ value of {} is {}, not a string", path, in_quotes(k), describe(v));
    metadata[k] = v.get<std::string>();
  }
  return metadata;
}

// One tensor's header entry, checked against the data buffer [data, data + data_size).
SafetensorsTensor read_entry(const std::string& name, const json& entry, const uint8_t* data, uint64_t data_size,
                             const std::string& path) {
  struct EntryError {
    const std::string& path;
    const std::string& name;
    [[noreturn]] void operator()(const std::string& what) const {
      fail("safetensors file '{}', tensor {}: {}", path, in_quotes(name), what);
    }
  };
  const EntryError bad{path, name};
  if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") || !entry.contains("data_offsets"))
    bad("entry must be an object with dtype, shape and data_offsets");
  SafetensorsTensor t;
  t.name = name;
  const json& dtype = entry.at("dtype");
  if (!dtype.is_string()) bad(fmt::format("dtype is {}, not a string", describe(dtype)));
  t.dtype = dtype.get<std::string>();
  const size_t esize = element_size(t.dtype);
  if (esize == 0) bad(fmt::format("unknown dtype {}", in_quotes(t.dtype)));

  const json& shape = entry.at("shape");
  if (!shape.is_array()) bad(fmt::format("shape is {}, not a list", describe(shape)));
  std::string why;
  std::vector<uint64_t> nonzero;
  for (size_t i = 0; i < shape.size(); ++i) {
    const std::optional<uint64_t> d = as_count(shape[i], why);
    if (!d) bad(fmt::format("shape entry {}: {}", i, why));
    t.shape.push_back(static_cast<int64_t>(*d));
    if (*d != 0) nonzero.push_back(*d);
  }
  // The product of the non-zero dimensions must fit int64 too: a [0, 2^40, 2^40] tensor holds
  // nothing, but code that divides out or multiplies a subset of its dimensions must not wrap.
  const uint64_t int64_max = uint64_t(std::numeric_limits<int64_t>::max());
  if (!checked_product(nonzero, int64_max))
    bad(fmt::format("shape {} has more than 2^63-1 elements", shape_text(t.shape)));
  const std::optional<uint64_t> numel = checked_product(t.shape, int64_max);
  const std::optional<uint64_t> need = checked_mul<uint64_t>(*numel, esize);
  if (!need) bad(fmt::format("shape {} of {} needs more than 2^64 bytes", shape_text(t.shape), t.dtype));

  const json& off = entry.at("data_offsets");
  if (!off.is_array() || off.size() != 2) bad(fmt::format("data_offsets is {}, not [begin, end]", describe(off)));
  const std::optional<uint64_t> begin = as_count(off[0], why);
  if (!begin) bad(fmt::format("data_offsets begin: {}", why));
  const std::optional<uint64_t> end = as_count(off[1], why);
  if (!end) bad(fmt::format("data_offsets end: {}", why));
  if (*begin > *end) bad(fmt::format("data_offsets [{}, {}] must be [begin, end] with begin <= end", *begin, *end));
  if (*end > data_size)
    bad(fmt::format("data_offsets [{}, {}] run past the {}-byte data buffer (truncated?)", *begin, *end, data_size));
  if (*need != *end - *begin)
    bad(fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}] span {}", shape_text(t.shape), t.dtype,
                    *need, *begin, *end, *end - *begin));
  t.data = data + *begin;
  t.nbytes = static_cast<size_t>(*end - *begin);
  return t;
}

}  // namespace

int64_t SafetensorsTensor::numel() const {
  // The reader checked that the product fits int64.
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool safetensors_converts(const std::string& dtype) {
  return dtype == "F32" || dtype == "F64" || dtype == "BF16" || dtype == "F16" || dtype == "I32" || dtype == "I64";
}

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::u8: return "U8";
  }
  fail("dtype {} has no safetensors name", static_cast<int>(t));
}

// ---------------------------------------------------------------------------------------------
// Reader

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below as not a file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail("cannot open safetensors file '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("cannot stat safetensors file '{}': {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("safetensors file '{}' is not a regular file (a directory or a device?)", path);
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(
        "safetensors file '{}' is {} bytes, too short to hold the 8-byte header length "
        "(truncated?)",
        path, size);
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) fail("cannot mmap safetensors file '{}': {}", path, std::strerror(err));
  map_ = static_cast<const uint8_t*>(map);
  map_size_ = size;

  // parse() may throw; the destructor does not run for a half-built object.
  try {
    parse();
  } catch (...) {
    ::munmap(const_cast<uint8_t*>(map_), map_size_);
    throw;
  }
}

SafetensorsReader::SafetensorsReader(std::vector<uint8_t> bytes, const std::string& label)
    : path_(label), owned_(std::move(bytes)) {
  if (owned_.size() < 8)
    fail(
        "safetensors file '{}' is {} bytes, too short to hold the 8-byte header length "
        "(truncated?)",
        path_, owned_.size());
  map_ = owned_.data();
  map_size_ = owned_.size();
  parse();
}

void SafetensorsReader::parse() {
  // Errors name the file, and the tensor whose entry was being read; a library's exception
  // (a JSON type error, an allocation that fails) is turned into such an error here.
  std::string entry_name;
  try {
    index_header(entry_name);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail("safetensors file '{}'{}: cannot read the header: {}", path_,
         entry_name.empty() ? "" : ", " + entry_label(entry_name), quote_excerpt(e.what(), 200));
  }
}

void SafetensorsReader::index_header(std::string& entry_name) {
  const std::string& path = path_;
  uint64_t n = 0;
  const json header = parse_header(map_, map_size_, path, n);
  const uint8_t* data = map_ + 8 + n;
  const uint64_t data_size = map_size_ - 8 - n;
  for (const auto& [name, entry] : header.items()) {
    entry_name = name;
    if (name == "__metadata__")
      metadata_ = read_metadata(entry, path);
    else
      tensors_.push_back(read_entry(name, entry, data, data_size, path));
  }
  entry_name.clear();

  // The buffer must be exactly tiled by the tensors: no overlap, no gap, nothing after.
  std::sort(tensors_.begin(), tensors_.end(),
            [](const auto& a, const auto& b) { return a.data != b.data ? a.data < b.data : a.nbytes < b.nbytes; });
  uint64_t covered = 0;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const SafetensorsTensor& t = tensors_[i];
    const uint64_t begin = static_cast<uint64_t>(t.data - data);
    if (begin < covered)
      fail("safetensors file '{}': tensor {} (bytes {}..{}) overlaps tensor {}", path, in_quotes(t.name), begin,
           begin + t.nbytes, in_quotes(tensors_[i - 1].name));
    if (begin > covered)
      fail("safetensors file '{}': data bytes {}..{} before tensor {} belong to no tensor", path, covered, begin,
           in_quotes(t.name));
    covered = begin + t.nbytes;
    index_[t.name] = i;
  }
  if (covered != data_size)
    fail("safetensors file '{}': data buffer is {} bytes but the tensors cover {}", path, data_size, covered);
}

SafetensorsReader::~SafetensorsReader() {
  if (map_ && owned_.empty()) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

// Moving a std::vector keeps its buffer, so tensor pointers into owned_ stay valid.
SafetensorsReader::SafetensorsReader(SafetensorsReader&& o) noexcept
    : path_(std::move(o.path_)),
      map_(std::exchange(o.map_, nullptr)),
      map_size_(std::exchange(o.map_size_, 0)),
      owned_(std::move(o.owned_)),
      tensors_(std::move(o.tensors_)),
      index_(std::move(o.index_)),
      metadata_(std::move(o.metadata_)) {}

SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&& o) noexcept {
  if (this != &o) {
    if (map_ && owned_.empty()) ::munmap(const_cast<uint8_t*>(map_), map_size_);
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_size_ = std::exchange(o.map_size_, 0);
    owned_ = std::move(o.owned_);
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> out;
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

bool SafetensorsReader::contains(const std::string& name) const { return index_.count(name) > 0; }

const SafetensorsTensor& SafetensorsReader::tensor(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end())
    fail("safetensors file '{}' has no tensor '{}' ({} tensors in the file)", path_, name, tensors_.size());
  return tensors_[it->second];
}

template <typename T>
void SafetensorsReader::convert(const SafetensorsTensor& t, T* dst) const {
  const int64_t n = t.numel();
  const uint8_t* p = t.data;
  if (t.dtype == "F32") {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(load<float>(p + 4 * i));
  } else if (t.dtype == "F64") {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(load<double>(p + 8 * i));
  } else if (t.dtype == "BF16") {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(bf16_bits_to_f32(load<uint16_t>(p + 2 * i)));
  } else if (t.dtype == "F16") {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(f16_bits_to_f32(load<uint16_t>(p + 2 * i)));
  } else if (t.dtype == "I32") {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(load<int32_t>(p + 4 * i));
  } else if (t.dtype == "I64") {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(load<int64_t>(p + 8 * i));
  } else {
    fail(
        "safetensors file '{}', tensor {}: cannot convert dtype {} to floating point (supported: "
        "F32, F64, BF16, F16, I32, I64)",
        path_, in_quotes(t.name), t.dtype);
  }
}

template <typename T>
void SafetensorsReader::read_into(const std::string& name, T* dst, const std::vector<int64_t>* expected) const {
  const SafetensorsTensor& t = tensor(name);
  if (expected && t.shape != *expected)
    fail("safetensors file '{}', tensor '{}': shape is {} but {} was expected", path_, t.name, shape_text(t.shape),
         shape_text(*expected));
  convert(t, dst);
}

void SafetensorsReader::read_f32(const std::string& name, float* dst) const { read_into(name, dst, nullptr); }
void SafetensorsReader::read_f32(const std::string& name, float* dst,
                                 const std::vector<int64_t>& expected_shape) const {
  read_into(name, dst, &expected_shape);
}
void SafetensorsReader::read_f64(const std::string& name, double* dst) const { read_into(name, dst, nullptr); }
void SafetensorsReader::read_f64(const std::string& name, double* dst,
                                 const std::vector<int64_t>& expected_shape) const {
  read_into(name, dst, &expected_shape);
}

// ---------------------------------------------------------------------------------------------
// Writer

void SafetensorsWriter::add_entry(Entry e) {
  if (e.name.empty() || e.name == "__metadata__") fail("safetensors writer: invalid tensor name '{}'", e.name);
  for (const Entry& other : entries_)
    if (other.name == e.name) fail("safetensors writer: tensor '{}' added twice", e.name);
  for (int64_t d : e.shape)
    if (d < 0) fail("safetensors writer: tensor '{}' has negative shape {}", e.name, shape_text(e.shape));
  const std::optional<uint64_t> numel = checked_product(e.shape, uint64_t(std::numeric_limits<int64_t>::max()));
  if (!numel || !checked_mul<uint64_t>(*numel, dtype_size(e.target)))
    fail("safetensors writer: tensor '{}' has impossibly large shape {}", e.name, shape_text(e.shape));
  if (*numel > 0 && !e.fill) fail("safetensors writer: tensor '{}' has no data", e.name);
  entries_.push_back(std::move(e));
}

void SafetensorsWriter::add(const std::string& name, DType dtype, const std::vector<int64_t>& shape, const void* data) {
  const size_t esize = dtype_size(dtype);
  FillChunk fill;
  if (data)
    fill = [data, esize](size_t first, size_t count, void* dst) {
      std::memcpy(dst, static_cast<const uint8_t*>(data) + first * esize, count * esize);
    };
  add_entry({name, dtype, shape, std::move(fill), {}});
}

void SafetensorsWriter::add_f32_as(const std::string& name, const std::vector<int64_t>& shape, const float* data,
                                   DType target) {
  if (target != DType::f32 && target != DType::f64 && target != DType::bf16 && target != DType::f16)
    fail("safetensors writer: tensor '{}': cannot store f32 values as {}", name, dtype_name(target));
  FillChunk fill;
  if (data)
    fill = [data, target](size_t first, size_t count, void* dst) {
      convert_elements(data + first, DType::f32, count, target, dst);
    };
  add_entry({name, target, shape, std::move(fill), {}});
}

void SafetensorsWriter::add_filled(const std::string& name, DType dtype, const std::vector<int64_t>& shape,
                                   FillChunk fill) {
  add_entry({name, dtype, shape, std::move(fill), {}});
}

void SafetensorsWriter::add_filled_bytes(const std::string& name, const std::string& file_dtype,
                                         const std::vector<int64_t>& shape, FillChunk fill) {
  if (element_size(file_dtype) != 1)
    fail("safetensors writer: tensor '{}': '{}' is not a one-byte safetensors dtype", name, file_dtype);
  add_entry({name, DType::u8, shape, std::move(fill), file_dtype});
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

namespace {

// Owns the temp file until it is renamed, so every failure path removes it.
class TempFile {
 public:
  TempFile(std::string tmp, std::string final_path) : tmp_(std::move(tmp)), path_(std::move(final_path)) {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail_errno("cannot create");
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  void write_all(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) fail_errno("cannot write");
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void commit() {
    if (::fsync(fd_) != 0) fail_errno("cannot fsync");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail_errno("cannot close");
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      const int err = errno;
      fail("safetensors writer: cannot rename '{}' to '{}': {}", tmp_, path_, std::strerror(err));
    }
    committed_ = true;
    // The rename is durable only once the directory entry is on disk.
    const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
    const std::string dir = parent.empty() ? std::string(".") : parent.string();
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) fail("cannot open directory '{}' to fsync it: {}", dir, std::strerror(errno));
    const int rc = ::fsync(dfd), err = errno;
    ::close(dfd);
    if (rc != 0) fail("cannot fsync directory '{}': {}", dir, std::strerror(err));
  }

 private:
  [[noreturn]] void fail_errno(const char* what) {
    fail("safetensors writer: {} '{}': {}", what, tmp_, std::strerror(errno));
  }
  std::string tmp_, path_;
  int fd_ = -1;
  bool committed_ = false;
};

// The file's bytes on their way out, in pieces of kPieceBytes at fixed file offsets: a piece is
// filled into one of a few buffers while earlier ones are hashed (each piece on its own, side by
// side) and written (in order), so the device downloads or conversions that fill it overlap the
// disk, the digests cost no second read of the file, and verifying it later can hash its pieces
// in parallel too.
class PieceStream {
 public:
  static constexpr size_t kPieceBytes = SafetensorsWriter::kPieceBytes;
  static constexpr size_t kSlots = 4;  // pieces in flight: being filled, hashed or written

  explicit PieceStream(TempFile& out) : out_(out) { slots_[0].buffer.resize(kPieceBytes); }
  ~PieceStream() {  // an error unwinds: no worker may outlive us
    for (Slot& s : slots_) {
      if (s.hash.valid()) s.hash.wait();
      if (s.written.valid()) s.written.wait();
    }
  }
  PieceStream(const PieceStream&) = delete;
  PieceStream& operator=(const PieceStream&) = delete;

  uint8_t* tail() { return slots_[current_].buffer.data() + used_; }
  size_t room() const { return kPieceBytes - used_; }
  void advance(size_t n) {
    used_ += n;
    if (used_ == kPieceBytes) flush();
  }
  void put(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const size_t k = std::min(n, room());
      std::memcpy(tail(), p, k);
      p += k;
      n -= k;
      advance(k);
    }
  }
  // Everything put is written; the pieces' digests in file order.
  std::vector<std::string> finish() {
    if (used_ > 0 || digests_.empty()) flush();
    for (Slot& s : slots_) retire(s);
    return std::move(digests_);
  }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Slot {
    std::vector<uint8_t> buffer;
    size_t piece = 0;
    std::future<std::string> hash;
    std::shared_future<void> written;
  };
  // Waits for the slot's piece (rethrowing its write's error) and keeps its digest.
  void retire(Slot& s) {
    if (s.hash.valid()) digests_[s.piece] = s.hash.get();
    if (s.written.valid()) s.written.get();
    s.hash = {};
    s.written = {};
  }
  // Hands the current piece to the workers and moves to the next slot.
  void flush() {
    Slot& s = slots_[current_];
    const uint8_t* data = s.buffer.data();
    const size_t n = used_;
    s.piece = digests_.size();
    digests_.emplace_back();
    s.hash = std::async(std::launch::async, [data, n] {
      Sha256 h;
      h.update(data, n);
      return h.hex_digest();
    });
    s.written = std::async(std::launch::async, [this, data, n, previous = last_write_] {
                  if (previous.valid()) previous.get();  // in file order; a failed write stops the rest
                  out_.write_all(data, n);
                }).share();
    last_write_ = s.written;
    bytes_ += n;
    used_ = 0;
    current_ = (current_ + 1) % kSlots;
    Slot& next = slots_[current_];
    retire(next);
    if (next.buffer.empty()) next.buffer.resize(kPieceBytes);
  }

  TempFile& out_;
  Slot slots_[kSlots];
  size_t current_ = 0;
  size_t used_ = 0;
  uint64_t bytes_ = 0;
  std::vector<std::string> digests_;
  std::shared_future<void> last_write_;
};

}  // namespace

// One file being written: the header, then its entries' bytes one buffer at a time.
struct SafetensorsWriter::Job {
  const SafetensorsWriter& writer;
  std::vector<size_t> numels;
  TempFile out;
  PieceStream stream;  // after `out`: destroyed (its last write waited for) before it
  size_t entry = 0;    // the entry being filled, from element `first`
  size_t first = 0;

  Job(const SafetensorsWriter& w, const std::string& path)
      : writer(w), out(fmt::format("{}.tmp.{}", path, ::getpid()), path), stream(out) {
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!w.metadata_.empty()) header["__metadata__"] = w.metadata_;
    uint64_t offset = 0;
    for (const Entry& e : w.entries_) {
      size_t numel = 1;
      for (int64_t d : e.shape) numel *= static_cast<size_t>(d);
      numels.push_back(numel);
      const uint64_t bytes = numel * dtype_size(e.target);
      header[e.name] = {{"dtype", e.file_dtype.empty() ? std::string(safetensors_dtype_name(e.target)) : e.file_dtype},
                        {"shape", e.shape},
                        {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
    }
    std::string text = header.dump();
    // Padding to 8 bytes puts the data buffer (file offset 8 + N) on an 8-byte boundary.
    text.append((8 - text.size() % 8) % 8, ' ');
    const uint64_t n = text.size();
    stream.put(&n, 8);
    stream.put(text.data(), text.size());
  }

  // Fills the current buffer and hands it on; false once every entry is in (the last, partly
  // filled buffer is left for finish()).
  bool fill_buffer() {
    while (entry < writer.entries_.size()) {
      if (first == numels[entry]) {
        ++entry;
        first = 0;
        continue;
      }
      const Entry& e = writer.entries_[entry];
      const size_t esize = dtype_size(e.target);
      const size_t count = std::min(stream.room() / esize, numels[entry] - first);
      if (count == 0) {  // the piece's tail is shorter than one element: it straddles two pieces
        uint8_t element[16];
        e.fill(first, 1, element);
        stream.put(element, esize);
        ++first;
        return true;
      }
      const bool fills_piece = count * esize == stream.room();
      e.fill(first, count, stream.tail());
      stream.advance(count * esize);
      first += count;
      if (fills_piece) return true;  // handed on: the other files' turn
    }
    return false;
  }

  Written finish() {
    Written written;
    written.piece_sha256 = stream.finish();
    written.bytes = stream.bytes();
    out.commit();
    return written;
  }
};

SafetensorsWriter::Written SafetensorsWriter::write(const std::string& path) const {
  return write_together({{this, path}}).front();
}

std::vector<SafetensorsWriter::Written> SafetensorsWriter::write_together(const std::vector<FileToWrite>& files) {
  std::vector<std::unique_ptr<Job>> jobs;
  for (const FileToWrite& f : files) jobs.push_back(std::make_unique<Job>(*f.writer, f.path));
  std::vector<bool> filled(jobs.size(), false);
  for (bool more = true; more;) {
    more = false;
    for (size_t j = 0; j < jobs.size(); ++j) {
      if (filled[j]) continue;
      if (jobs[j]->fill_buffer())
        more = true;
      else
        filled[j] = true;
    }
  }
  std::vector<Written> written;
  for (auto& job : jobs) written.push_back(job->finish());
  return written;
}

}  // namespace flux8
