#include "data/webdataset.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/text_file.h"
#include "io/safetensors.h"

namespace flux8 {

static_assert(std::endian::native == std::endian::little, "flux8 assumes a little-endian host");

namespace {

using json = nlohmann::json;

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string where_text(const std::string& shard, const std::string& member) {
  return fmt::format("shard {}, member {}", shard, member);
}

// Element types the decoders convert to f32.
enum class Elem { f16, bf16, f32, f64, i8, i16, i32, i64, u8, u16, u32, u64, b1 };

size_t elem_size(Elem e) {
  switch (e) {
    case Elem::i8:
    case Elem::u8:
    case Elem::b1: return 1;
    case Elem::f16:
    case Elem::bf16:
    case Elem::i16:
    case Elem::u16: return 2;
    case Elem::f32:
    case Elem::i32:
    case Elem::u32: return 4;
    default: return 8;
  }
}

template <typename T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // member data may be unaligned
  return v;
}

template <typename T, typename F>
void convert_each(const uint8_t* p, int64_t n, float* out, F to_float) {
  for (int64_t i = 0; i < n; ++i) out[i] = to_float(load<T>(p + sizeof(T) * static_cast<size_t>(i)));
}

// One loop per element type (a switch per element is far slower on W1's 4.2 MB text features);
// f32, what most shards hold, is a plain copy.
void convert(const uint8_t* p, int64_t n, Elem e, float* out) {
  const auto cast = [](auto v) { return static_cast<float>(v); };
  switch (e) {
    case Elem::f32: std::memcpy(out, p, static_cast<size_t>(n) * sizeof(float)); break;
    case Elem::f16: convert_each<uint16_t>(p, n, out, [](uint16_t b) { return f16_bits_to_f32(b); }); break;
    case Elem::bf16: convert_each<uint16_t>(p, n, out, [](uint16_t b) { return bf16_bits_to_f32(b); }); break;
    case Elem::f64: convert_each<double>(p, n, out, cast); break;
    case Elem::i8: convert_each<int8_t>(p, n, out, cast); break;
    case Elem::i16: convert_each<int16_t>(p, n, out, cast); break;
    case Elem::i32: convert_each<int32_t>(p, n, out, cast); break;
    case Elem::i64: convert_each<int64_t>(p, n, out, cast); break;
    case Elem::u8: convert_each<uint8_t>(p, n, out, cast); break;
    case Elem::u16: convert_each<uint16_t>(p, n, out, cast); break;
    case Elem::u32: convert_each<uint32_t>(p, n, out, cast); break;
    case Elem::u64: convert_each<uint64_t>(p, n, out, cast); break;
    case Elem::b1: convert_each<uint8_t>(p, n, out, [](uint8_t b) { return b != 0 ? 1.0f : 0.0f; }); break;
  }
}

// numel with an overflow guard: a corrupt shape must not wrap around to a plausible size.
bool checked_numel(const std::vector<int64_t>& shape, uint64_t& numel) {
  numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    const uint64_t v = static_cast<uint64_t>(d);
    if (v != 0 && numel > (uint64_t(1) << 40) / v) return false;
    numel *= v;
  }
  return true;
}

HostTensor make_tensor(const uint8_t* p, const std::vector<int64_t>& shape, Elem e) {
  HostTensor t;
  t.shape = shape;
  t.data.resize(static_cast<size_t>(t.numel()));
  convert(p, t.numel(), e, t.data.data());
  return t;
}

bool raw_dtype(std::string name, Elem& e) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name.rfind("torch.", 0) == 0) name = name.substr(6);
  if (name == "bf16" || name == "bfloat16")
    e = Elem::bf16;
  else if (name == "f16" || name == "fp16" || name == "float16" || name == "half")
    e = Elem::f16;
  else if (name == "f32" || name == "fp32" || name == "float32" || name == "float")
    e = Elem::f32;
  else
    return false;
  return true;
}

// The value text after "'key':" in a .npy header dict, or npos.
size_t npy_value(const std::string& header, const std::string& key) {
  size_t k = header.find("'" + key + "'");
  if (k == std::string::npos) k = header.find("\"" + key + "\"");
  if (k == std::string::npos) return std::string::npos;
  const size_t colon = header.find(':', k + key.size() + 2);
  if (colon == std::string::npos) return std::string::npos;
  size_t v = colon + 1;
  while (v < header.size() && header[v] == ' ') ++v;
  return v;
}

// The MLPerf preprocessed layout (docs/FLUX.md, The training objective), used for headerless .bytes members when the
// sample's json gives no shape: the MLPerf shards themselves store .npy images (see the header),
// so this only serves raw dumps of the same tensors.
struct DefaultLayout {
  const char* field;
  std::vector<int64_t> shape;
};
const std::vector<DefaultLayout>& mlperf_defaults() {
  static const std::vector<DefaultLayout> d = {
      {"t5", {256, 4096}}, {"clip", {768}}, {"mean", {16, 32, 32}}, {"logvar", {16, 32, 32}}};
  return d;
}

std::vector<int64_t> json_shape(const json& j, const std::string& where, const std::string& what) {
  if (!j.is_array()) fail("{}: json {} {} is not a list of sizes", where, what, j.dump());
  std::vector<int64_t> shape;
  for (const json& d : j) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0)
      fail("{}: json {} {} has an entry that is not a size", where, what, j.dump());
    shape.push_back(d.get<int64_t>());
  }
  return shape;
}

// Finds the layout of field `name` (or its canonical name) in the sample's json.
void json_layout(const json& meta, const std::string& name, const std::string& canon, const std::string& where,
                 std::vector<int64_t>& shape, bool& has_shape, std::string& dtype) {
  has_shape = false;
  if (!meta.is_object()) return;
  if (meta.contains("dtype") && meta["dtype"].is_string()) dtype = meta["dtype"].get<std::string>();
  for (const std::string& n : {name, canon}) {
    if (meta.contains(n) && meta[n].is_object()) {
      const json& f = meta[n];
      if (f.contains("shape")) {
        shape = json_shape(f["shape"], where, "'" + n + "'.shape");
        has_shape = true;
      }
      if (f.contains("dtype") && f["dtype"].is_string()) dtype = f["dtype"].get<std::string>();
    }
    if (meta.contains("shapes") && meta["shapes"].is_object() && meta["shapes"].contains(n)) {
      shape = json_shape(meta["shapes"][n], where, "shapes." + n);
      has_shape = true;
    }
    if (meta.contains("dtypes") && meta["dtypes"].is_object() && meta["dtypes"].contains(n) &&
        meta["dtypes"][n].is_string())
      dtype = meta["dtypes"][n].get<std::string>();
    if (has_shape) return;
  }
}

constexpr char kNpyMagic[] = "\x93NUMPY";

bool is_npy(const std::vector<uint8_t>& d) { return d.size() >= 6 && std::memcmp(d.data(), kNpyMagic, 6) == 0; }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Names

bool split_member_name(const std::string& name, std::string& key, std::string& extension) {
  const size_t slash = name.rfind('/');
  const size_t base = slash == std::string::npos ? 0 : slash + 1;
  if (base >= name.size() || name[base] == '.') return false;  // hidden ("._x" from macOS tar)
  const size_t dot = name.find('.', base);
  if (dot == std::string::npos || dot + 1 >= name.size()) return false;
  key = name.substr(0, dot);
  extension = name.substr(dot + 1);
  return true;
}

std::string canonical_field_name(const std::string& name) {
  static const std::map<std::string, std::string> aliases = {{"latents", "latent"},
                                                             {"prompt_embeds", "t5"},
                                                             {"t5_encodings", "t5"},
                                                             {"pooled_prompt_embeds", "clip"},
                                                             {"clip_encodings", "clip"}};
  auto it = aliases.find(name);
  return it == aliases.end() ? name : it->second;
}

// ---------------------------------------------------------------------------------------------
// Decoders

HostTensor decode_npy(const uint8_t* data, size_t size, const std::string& where, bool u2_is_bf16) {
  // Layout: magic "\x93NUMPY", major, minor, header length (u16 for v1, u32 for v2/v3), the
  // header (a Python dict literal, padded with spaces and '\n'), then the array data.
  if (size < 10 || std::memcmp(data, kNpyMagic, 6) != 0) fail("{}: not a .npy file (no \\x93NUMPY magic)", where);
  const int major = data[6];
  size_t header_len = 0, header_at = 0;
  if (major == 1) {
    header_len = load<uint16_t>(data + 8);
    header_at = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) fail("{}: .npy v{} file of {} bytes is truncated", where, major, size);
    header_len = load<uint32_t>(data + 8);
    header_at = 12;
  } else {
    fail("{}: .npy format version {}.{} is not supported (1.0, 2.0 and 3.0 are)", where, major, data[7]);
  }
  if (header_at + header_len > size)
    fail("{}: .npy header of {} bytes runs past the {}-byte member (truncated)", where, header_len, size);
  const std::string header(reinterpret_cast<const char*>(data + header_at), header_len);

  size_t v = npy_value(header, "descr");
  if (v == std::string::npos || (header[v] != '\'' && header[v] != '"'))
    fail("{}: .npy header has no 'descr' string: {}", where, header);
  const size_t close = header.find(header[v], v + 1);
  if (close == std::string::npos) fail("{}: .npy header is malformed: {}", where, header);
  const std::string descr = header.substr(v + 1, close - v - 1);

  v = npy_value(header, "fortran_order");
  if (v == std::string::npos) fail("{}: .npy header has no 'fortran_order': {}", where, header);
  if (header.compare(v, 4, "True") == 0)
    fail(
        "{}: .npy array is in Fortran (column-major) order; flux8 reads C order only. Re-save "
        "it with np.save(f, np.ascontiguousarray(a))",
        where);
  if (header.compare(v, 5, "False") != 0) fail("{}: .npy 'fortran_order' is neither True nor False: {}", where, header);

  v = npy_value(header, "shape");
  if (v == std::string::npos || header[v] != '(') fail("{}: .npy header has no 'shape' tuple: {}", where, header);
  const size_t end = header.find(')', v);
  if (end == std::string::npos) fail("{}: .npy 'shape' tuple is not closed: {}", where, header);
  std::vector<int64_t> shape;
  {
    size_t i = v + 1;
    while (i < end) {
      while (i < end && (header[i] == ' ' || header[i] == ',')) ++i;
      if (i >= end) break;
      int64_t d = 0;
      size_t digits = 0;
      while (i < end && header[i] >= '0' && header[i] <= '9') {
        if (d > (int64_t(1) << 40)) fail("{}: .npy shape is impossibly large: {}", where, header);
        d = d * 10 + (header[i++] - '0');
        ++digits;
      }
      while (i < end && (header[i] == 'L' || header[i] == ' ')) ++i;  // Python 2 longs
      if (digits == 0 || (i < end && header[i] != ','))
        fail("{}: .npy 'shape' has an entry that is not a size: {}", where, header);
      shape.push_back(d);
    }
  }

  // descr: byte order ('<' little, '|' not applicable, '=' native, '>' big), kind, size.
  if (descr.size() < 2) fail("{}: .npy dtype '{}' is not understood", where, descr);
  const char order = descr[0];
  const std::string code = (order == '<' || order == '|' || order == '=' || order == '>') ? descr.substr(1) : descr;
  static const std::map<std::string, Elem> codes = {
      {"f2", Elem::f16}, {"f4", Elem::f32}, {"f8", Elem::f64}, {"i1", Elem::i8},  {"i2", Elem::i16}, {"i4", Elem::i32},
      {"i8", Elem::i64}, {"u1", Elem::u8},  {"u2", Elem::u16}, {"u4", Elem::u32}, {"u8", Elem::u64}, {"b1", Elem::b1}};
  auto it = codes.find(code);
  if (it == codes.end())
    fail("{}: .npy dtype '{}' is not supported (floats f2/f4/f8, ints i1..i8/u1..u8, bool)", where, descr);
  Elem e = it->second;
  if (order == '>' && elem_size(e) > 1)
    fail(
        "{}: .npy dtype '{}' is big-endian; flux8 reads little-endian data only. Re-save it with "
        "a.astype(a.dtype.newbyteorder('<'))",
        where, descr);
  // MLPerf Flux stores bf16 tensors as np.save(tensor.view(torch.uint16).numpy()).
  if (u2_is_bf16 && e == Elem::u16) e = Elem::bf16;

  uint64_t numel = 0;
  if (!checked_numel(shape, numel)) fail("{}: .npy shape {} is impossibly large", where, shape_text(shape));
  const uint64_t expected = numel * elem_size(e);
  const uint64_t have = size - header_at - header_len;
  if (have != expected)
    fail("{}: .npy header says {} '{}' = {} data bytes, but the member holds {} after the header", where,
         shape_text(shape), descr, expected, have);
  return make_tensor(data + header_at + header_len, shape, e);
}

HostTensor decode_raw(const uint8_t* data, size_t size, const std::string& dtype, const std::vector<int64_t>& shape,
                      const std::string& where, const std::string& source) {
  Elem e;
  if (!raw_dtype(dtype, e))
    fail("{}: dtype '{}' from {} is not supported for raw .bytes (bf16, f16, f32)", where, dtype, source);
  uint64_t numel = 0;
  if (!checked_numel(shape, numel)) fail("{}: shape {} from {} is impossibly large", where, shape_text(shape), source);
  const uint64_t expected = numel * elem_size(e);
  if (size != expected)
    fail("{}: {} bytes, but {} says {} {} = {} bytes", where, size, source, shape_text(shape), dtype, expected);
  return make_tensor(data, shape, e);
}

namespace {

// The sample's json member, if any: it describes the .bytes members, wherever it sits in the tar.
json read_meta(const RawSample& raw, std::string& meta_member) {
  json meta;
  for (const SampleMember& m : raw.members) {
    std::string key, ext;
    if (!split_member_name(m.name, key, ext) || ext != "json") continue;
    if (!meta_member.empty())
      fail("{}: second json member in sample '{}' (first: {})", where_text(raw.shard, m.name), raw.key, meta_member);
    meta_member = m.name;
    std::string error;
    std::optional<json> parsed =
        parse_json(std::string_view(reinterpret_cast<const char*>(m.data.data()), m.data.size()), error);
    if (!parsed) fail("{}: invalid JSON: {}", where_text(raw.shard, m.name), error);
    meta = std::move(*parsed);
  }
  return meta;
}

// Stores decoded fields under their canonical names; a field given by two members is an error.
class FieldSink {
 public:
  FieldSink(Sample& s, const RawSample& raw) : s_(s), raw_(raw) {}
  void put(const std::string& field, HostTensor t, const std::string& member) {
    const std::string canon = canonical_field_name(field);
    auto [it, fresh] = source_member_.emplace(canon, member);
    if (!fresh)
      fail("{}: field '{}' is already given by member {} of sample '{}'", where_text(raw_.shard, member), canon,
           it->second, raw_.key);
    s_.fields[canon] = std::move(t);
  }

 private:
  Sample& s_;
  const RawSample& raw_;
  std::map<std::string, std::string> source_member_;  // canonical field -> member
};

// A raw .bytes member: its shape and dtype from the sample's json, else the MLPerf layout.
HostTensor decode_raw_member(const SampleMember& m, const std::string& field, const std::string& where,
                             const RawSample& raw, const json& meta, const std::string& meta_member) {
  const std::string canon = canonical_field_name(field);
  std::vector<int64_t> shape;
  bool has_shape = false;
  std::string dtype;
  json_layout(meta, field, canon, where, shape, has_shape, dtype);
  std::string source = meta_member.empty() ? "the sample's json" : "json";
  if (!has_shape) {
    auto d = std::find_if(mlperf_defaults().begin(), mlperf_defaults().end(),
                          [&](const DefaultLayout& l) { return canon == l.field; });
    if (d == mlperf_defaults().end())
      fail(
          "{}: raw .bytes member, but {} no shape for field '{}' (add \"shapes\": "
          "{{\"{}\": [...]}} and \"dtypes\" to {}.json, or store it as .npy)",
          where, meta_member.empty() ? "the sample has no json to give" : "its json gives", field, field, raw.key);
    shape = d->shape;
    source = fmt::format("the MLPerf default layout for '{}' (no shape in the json)", canon);
  } else if (dtype.empty() && canon != "t5" && canon != "clip" && canon != "mean" && canon != "logvar") {
    fail(
        "{}: json gives shape {} for field '{}' but no dtype (\"dtypes\": {{\"{}\": "
        "\"bf16\"}})",
        where, shape_text(shape), field, field);
  }
  if (dtype.empty()) dtype = "bf16";  // the MLPerf fields are bf16
  return decode_raw(m.data.data(), m.data.size(), dtype, shape, where, source);
}

// A .safetensors member: every tensor as a field, or the one tensor of a named field.
void decode_safetensors_member(const SampleMember& m, const std::string& field, const std::string& where,
                               FieldSink& sink) {
  SafetensorsReader st(m.data, where);
  const std::vector<std::string> names = st.names();
  const auto read = [&](const std::string& name) {
    const SafetensorsTensor& t = st.tensor(name);
    HostTensor h;
    h.shape = t.shape;
    h.data.resize(static_cast<size_t>(t.numel()));
    st.read_f32(name, h.data.data());
    return h;
  };
  if (field.empty()) {
    for (const std::string& n : names) sink.put(n, read(n), m.name);
    return;
  }
  const std::string canon = canonical_field_name(field);
  std::string pick;
  if (names.size() == 1)
    pick = names[0];
  else if (st.contains(field))
    pick = field;
  else if (st.contains(canon))
    pick = canon;
  else
    fail(
        "{}: {} tensors ({}) and none is named '{}'; store one tensor per member or name "
        "it like the field",
        where, names.size(), fmt::join(names, ", "), field);
  sink.put(field, read(pick), m.name);
}

// The json's caption (unless a .txt member gave one) and timestep.
void apply_meta(Sample& s, const json& meta, bool caption_from_txt, const RawSample& raw,
                const std::string& meta_member) {
  if (!meta.is_object()) return;
  if (!caption_from_txt) {
    for (const char* k : {"caption", "prompt"})
      if (meta.contains(k) && meta[k].is_string()) {
        s.caption = meta[k].get<std::string>();
        break;
      }
  }
  if (meta.contains("timestep")) {
    if (!meta["timestep"].is_number())
      fail("{}: json timestep {} is not a number", where_text(raw.shard, meta_member), meta["timestep"].dump());
    HostTensor t;
    t.data = {meta["timestep"].get<float>()};
    s.fields["timestep"] = std::move(t);
  }
}

}  // namespace

Sample decode_sample(const RawSample& raw) {
  Sample s;
  s.key = raw.key;
  s.shard = raw.shard;
  std::string meta_member;
  const json meta = read_meta(raw, meta_member);
  FieldSink sink(s, raw);
  bool caption_from_txt = false;
  for (const SampleMember& m : raw.members) {
    std::string key, ext;
    if (!split_member_name(m.name, key, ext)) continue;
    const std::string where = where_text(raw.shard, m.name);
    const size_t last_dot = ext.rfind('.');
    const std::string format = last_dot == std::string::npos ? ext : ext.substr(last_dot + 1);
    const std::string field = last_dot == std::string::npos ? std::string() : ext.substr(0, last_dot);
    if (format == "txt" && (field.empty() || field == "caption" || field == "prompt")) {
      std::string text(m.data.begin(), m.data.end());
      while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
      s.caption = std::move(text);
      caption_from_txt = true;
    } else if (format == "npy" || format == "bytes") {
      if (field.empty())
        fail("{}: a .{} member needs a field name (KEY.FIELD.{}, e.g. {}.t5.{})", where, format, format, raw.key,
             format);
      if (format == "npy" || is_npy(m.data))
        sink.put(field, decode_npy(m.data.data(), m.data.size(), where, format == "bytes"), m.name);
      else
        sink.put(field, decode_raw_member(m, field, where, raw, meta, meta_member), m.name);
    } else if (format == "safetensors") {
      decode_safetensors_member(m, field, where, sink);
    }
    // Any other extension (images, class labels, a second json) is not ours to decode.
  }
  apply_meta(s, meta, caption_from_txt, raw, meta_member);
  return s;
}

Sample load_sample(const RawSample& raw) {
  RawSample full = raw;
  for (SampleMember& m : full.members)
    if (m.data.size() != m.size) m.data = read_file_range(raw.shard, m.offset, m.size, m.name);
  return decode_sample(full);
}

// ---------------------------------------------------------------------------------------------
// Reader

WebDatasetReader::WebDatasetReader(const std::string& shard_path) : tar_(shard_path) {}

bool WebDatasetReader::next_raw(RawSample& out, bool with_data) {
  out.shard = tar_.path();
  out.key.clear();
  out.members.clear();
  for (;;) {
    if (!has_pending_) {
      if (at_end_ || !tar_.next(pending_)) {
        at_end_ = true;
        break;
      }
      has_pending_ = true;
    }
    std::string key, ext;
    if (!split_member_name(pending_.name, key, ext)) {
      has_pending_ = false;  // not part of any sample; its data is skipped by the next read
      continue;
    }
    if (out.members.empty())
      out.key = key;
    else if (key != out.key)
      break;  // first member of the next sample
    SampleMember m{pending_.name, pending_.data_offset, pending_.size, {}};
    if (with_data) m.data = tar_.read_data();
    out.members.push_back(std::move(m));
    has_pending_ = false;
  }
  return !out.members.empty();
}

bool WebDatasetReader::next(Sample& out) {
  RawSample raw;
  if (!next_raw(raw, true)) return false;
  out = decode_sample(raw);
  return true;
}

bool WebDatasetReader::skip() {
  RawSample raw;
  return next_raw(raw, false);
}

}  // namespace flux8
