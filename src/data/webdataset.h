#pragma once
// WebDataset samples from tar shards, decoded into f32 host tensors.
//
// Grouping: consecutive members with the same key form one sample; the key is the member path
// up to the first dot of its basename (directory included), the rest names field and format:
//   "000123.t5.bytes"  -> field "t5",     raw little-endian bytes (or an .npy image, see below)
//   "x.clip.npy"       -> field "clip",   NumPy .npy (v1/v2/v3 header, C order)
//   "x.latents.safetensors" -> field "latent", the single tensor or the one named like the field;
//   "x.safetensors"    -> every tensor of the file, each a field under its own name
//   "x.txt"            -> caption;  "x.json" -> metadata (dtype/shape of .bytes members,
//                         "caption"/"prompt", "timestep")
// Other extensions (.jpg, .cls, ...) are ignored. Field names are canonicalised:
//   latents -> latent, prompt_embeds / t5_encodings -> t5,
//   pooled_prompt_embeds / clip_encodings -> clip
//
// MLPerf Flux preprocessed shards (mlcommons/training_results_v5.1, NVIDIA flux1
// scripts/to_webdataset.py and task_encoder.py): members KEY.json ({"key": ..., and for the
// COCO validation set "timestep": 0..7}), KEY.t5.bytes, KEY.clip.bytes, KEY.mean.bytes,
// KEY.logvar.bytes, where each .bytes member is the np.save() image of the bf16 tensor viewed
// as uint16 (descr '<u2'): t5 [256, 4096], clip [768], mean/logvar [16, 32, 32]. So a .bytes
// member that starts with the .npy magic is read as .npy, with '<u2' meaning bf16 bits.
// Headerless .bytes members are raw little-endian data whose dtype/shape come from the json
//   {"shapes": {"t5": [256, 4096]}, "dtypes": {"t5": "bf16"}}  or  {"t5": {"shape": [..],
//   "dtype": ".."}}  (dtypes bf16, f16, f32; a top-level "dtype" applies to every field)
// and, for the MLPerf fields when the json gives no shape, the MLPerf layout above in bf16.
// The json "timestep" becomes field "timestep", a scalar (shape []).
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "data/sample.h"
#include "data/tar.h"

namespace flux8 {

// A member of a sample: its name, where its data lies in the shard, and the data once read.
struct SampleMember {
  std::string name;
  uint64_t offset = 0, size = 0;
  std::vector<uint8_t> data;
  std::string fault;  // TarMember::fault: the member cannot be used (decode_sample fails with it)
};

// The members of one sample, not yet decoded (data empty when read header-only).
struct RawSample {
  std::string shard, key;
  std::vector<SampleMember> members;
};

// Splits a member name into key and extension ("dir/000123.t5.bytes" -> "dir/000123",
// "t5.bytes"); false for names without a dot in the basename or hidden files (".x", "._x").
bool split_member_name(const std::string& name, std::string& key, std::string& extension);
// "latents" -> "latent", "prompt_embeds" -> "t5", ...; other names unchanged.
std::string canonical_field_name(const std::string& name);

// Decodes the members (with data) into a sample. Member data is untrusted: whatever the bytes,
// this returns or throws flux8::Error naming the shard, the member and what is wrong (library
// exceptions are turned into such errors), in time and memory bounded by the data's size.
Sample decode_sample(const RawSample& raw);
// Reads the data of a header-only RawSample by random access in its shard file, then decodes it.
Sample load_sample(const RawSample& raw);

// Individual decoders of untrusted bytes, with decode_sample's guarantees; `where` ("shard S,
// member M") prefixes error messages, which quote at most a short excerpt of the input.
HostTensor decode_npy(const uint8_t* data, size_t size, const std::string& where, bool u2_is_bf16 = false);
// Raw little-endian `dtype` ("bf16", "f16", "f32", also "bfloat16", "float16", "float32");
// `source` says where dtype and shape came from, for the size-mismatch message.
HostTensor decode_raw(const uint8_t* data, size_t size, const std::string& dtype, const std::vector<int64_t>& shape,
                      const std::string& where, const std::string& source = "the expected layout");

// Reads the samples of one shard in order. A tar framing fault (TarReader) fails next_raw(),
// next() and skip(), and the rest of the shard cannot be read; a member with a fault of its own
// is returned in its sample, whose decoding then fails.
class WebDatasetReader {
 public:
  explicit WebDatasetReader(const std::string& shard_path);
  // A shard in memory, named `name` in errors; `bytes` must outlive the reader (its samples
  // are read with data: load_sample needs a file).
  WebDatasetReader(std::string name, std::string_view bytes);
  const std::string& shard() const { return tar_.path(); }

  // Groups the next sample's members, reading their data when `with_data`, else only headers
  // (for skipping; read and skip see the same structural faults). False at the end. A fault
  // in the header after a sample's last member loses that sample too: the header might have
  // been one of its members.
  bool next_raw(RawSample& out, bool with_data);
  // Reads and decodes the next sample; false at the end of the shard.
  bool next(Sample& out);
  // Skips the next sample without reading its data; false at the end of the shard.
  bool skip();
  // The last member whose header was read (for messages about faults between samples).
  const std::string& last_member() const { return pending_.name; }

 private:
  TarReader tar_;
  TarMember pending_;  // header read, belongs to the next sample
  bool has_pending_ = false;
  bool at_end_ = false;
};

}  // namespace flux8
