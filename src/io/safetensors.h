#pragma once
// safetensors files (https://github.com/huggingface/safetensors, format only): an 8-byte
// little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the data buffer, offsets relative to its start. Checkpoints use this format so flux8
// weights load in PyTorch/diffusers and reference checkpoints load here.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace flux8 {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;              // as in the file: "F32", "BF16", "F16", "F64", "I64", ...
  std::vector<int64_t> shape;     // [] is a scalar
  const uint8_t* data = nullptr;  // inside the read-only mapping; may be unaligned
  size_t nbytes = 0;
  int64_t numel() const;
};

// Maps a file read-only and validates the whole header on open, so a damaged checkpoint fails
// before training starts, naming the file and the tensor. Any bytes are safe to open: every
// problem (a header over 100 MB, nesting, numbers out of range, sizes that would wrap, offsets
// that overlap or leave the file, duplicate names) is a flux8::Error, found before anything is
// allocated for the tensors. Only a file that shrinks while mapped can still fault on access.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  // Parses a safetensors image held in memory (e.g. a WebDataset tar member); the reader owns
  // the bytes. `label` names the source in error messages, as the path does for files.
  SafetensorsReader(std::vector<uint8_t> bytes, const std::string& label);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&& other) noexcept;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // in file (data offset) order
  bool contains(const std::string& name) const;
  const SafetensorsTensor& tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Converts a F32/F64/BF16/F16/I32/I64 tensor into dst (numel elements). The overloads with
  // `expected_shape` first check the stored shape and fail naming both shapes.
  void read_f32(const std::string& name, float* dst) const;
  void read_f32(const std::string& name, float* dst, const std::vector<int64_t>& expected_shape) const;
  void read_f64(const std::string& name, double* dst) const;
  void read_f64(const std::string& name, double* dst, const std::vector<int64_t>& expected_shape) const;

 private:
  void parse();  // validates the image at map_[0, map_size_) and fills the tensor index
  // parse()'s work; `entry_name` is the header entry being read, for parse()'s error message.
  void index_header(std::string& entry_name);
  template <typename T>
  void convert(const SafetensorsTensor& t, T* dst) const;
  // convert() after checking the stored shape against `expected` (when given).
  template <typename T>
  void read_into(const std::string& name, T* dst, const std::vector<int64_t>* expected) const;

  std::string path_;
  const uint8_t* map_ = nullptr;  // the file mapping, or owned_.data() for an in-memory image
  size_t map_size_ = 0;
  std::vector<uint8_t> owned_;              // in-memory image; empty for a mapped file
  std::vector<SafetensorsTensor> tensors_;  // sorted by data offset
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and writes them atomically, streaming: the file's bytes pass through a few
// 32 MiB pieces (one filled while earlier ones are hashed and written), so writing a checkpoint
// of any size holds no copy of it in host memory, and its digests are computed from the bytes
// as they are written instead of by reading the file back.
class SafetensorsWriter {
 public:
  // Produces elements [first, first + count) of a tensor, in the file's dtype, into dst
  // (count · dtype_size bytes). Called in order of `first`, on the thread that calls write().
  using FillChunk = std::function<void(size_t first, size_t count, void* dst)>;

  // Stores `data` as is: `dtype` says what the bytes already are. The data must stay alive
  // until write().
  void add(const std::string& name, DType dtype, const std::vector<int64_t>& shape, const void* data);
  // Stores f32 data converted to `target` (bf16/f16 round to nearest even) while writing.
  void add_f32_as(const std::string& name, const std::vector<int64_t>& shape, const float* data, DType target);
  // A tensor of `dtype` whose bytes `fill` produces while the file is written (e.g. downloaded
  // from the device a piece at a time).
  void add_filled(const std::string& name, DType dtype, const std::vector<int64_t>& shape, FillChunk fill);
  // A tensor of a one-byte dtype flux8 has no DType for ("F8_E4M3", "F8_E5M2", "I8", ...): `fill`
  // produces its bytes as above.
  void add_filled_bytes(const std::string& name, const std::string& file_dtype, const std::vector<int64_t>& shape,
                        FillChunk fill);
  void set_metadata(const std::string& key, const std::string& value);

  // The file is hashed as it is written, in pieces of kPieceBytes from offset 0 (the last one
  // shorter), each piece's SHA-256 on its own: a checkpoint's verification hashes them in
  // parallel (a single SHA-256 of a 100 GB file is one core's work for over a minute).
  static constexpr size_t kPieceBytes = size_t{32} << 20;
  struct Written {
    uint64_t bytes = 0;
    std::vector<std::string> piece_sha256;  // hex digests of the pieces, in file order
  };
  // Writes path + ".tmp.<pid>", fsyncs it, renames it over `path` and fsyncs the directory, so
  // a crash leaves either the old file or the complete new one.
  Written write(const std::string& path) const;
  // Writes several files side by side, each as write() does: their buffers are filled in turn
  // on the calling thread (a backend's downloads stay on one thread) while each file's own
  // workers hash and write, so the files are hashed in parallel. The files are
  // renamed into place one after another once all are written: an error while producing or
  // writing any of them leaves none.
  struct FileToWrite {
    const SafetensorsWriter* writer;
    std::string path;
  };
  static std::vector<Written> write_together(const std::vector<FileToWrite>& files);

 private:
  struct Job;  // one file being written (safetensors.cpp)
  struct Entry {
    std::string name;
    DType target;  // what the file holds
    std::vector<int64_t> shape;
    FillChunk fill;
    std::string file_dtype;  // the header's dtype when DType has none (add_filled_bytes)
  };
  void add_entry(Entry e);

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Whether read_f32/read_f64 convert a tensor of this file dtype.
bool safetensors_converts(const std::string& dtype);

// "F32", "F64", "BF16", "F16": the file's name for a flux8 dtype.
const char* safetensors_dtype_name(DType t);

}  // namespace flux8
