#include "data/webdataset.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/checked.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/text_file.h"
#include "io/safetensors.h"

namespace flux8 {

static_assert(std::endian::native == std::endian::little, "flux8 assumes a little-endian host");

namespace {

using json = nlohmann::json;

constexpr size_t kMaxDims = 64;  // numpy's NPY_MAXDIMS; no tensor flux8 reads has more

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

// The element count of `shape`, or nullopt for a negative dimension or an implausible shape: the
// product with empty dimensions counted as 1 must stay below 2^48, so a zero-size array cannot
// carry dimensions whose products overflow later.
std::optional<uint64_t> checked_numel(const std::vector<int64_t>& shape) {
  std::vector<int64_t> nonzero;
  for (int64_t d : shape) nonzero.push_back(d == 0 ? 1 : d);
  if (!checked_product(nonzero, uint64_t(1) << 48)) return std::nullopt;
  return checked_product(shape);
}

// The bytes `shape` of `e` holds, or nullopt (see checked_numel).
std::optional<uint64_t> checked_bytes(const std::vector<int64_t>& shape, Elem e) {
  const std::optional<uint64_t> n = checked_numel(shape);
  if (!n) return std::nullopt;
  return checked_mul<uint64_t>(*n, elem_size(e));
}

// A tensor of `shape` from the data at p (its size checked by the caller). A zero-size tensor
// has no data to convert: its empty vector's data() may be null.
HostTensor make_tensor(const uint8_t* p, const std::vector<int64_t>& shape, Elem e) {
  HostTensor t;
  t.shape = shape;
  t.data.resize(static_cast<size_t>(t.numel()));
  if (!t.data.empty()) convert(p, t.numel(), e, t.data.data());
  return t;
}

// A json value for an error message: short, whatever bytes its strings hold.
std::string json_excerpt(const json& j) {
  return quote_excerpt(j.dump(-1, ' ', false, json::error_handler_t::replace));
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
  if (!j.is_array()) fail("{}: json {} {} is not a list of sizes", where, what, json_excerpt(j));
  if (j.size() > kMaxDims) fail("{}: json {} has {} dimensions, more than {}", where, what, j.size(), kMaxDims);
  std::vector<int64_t> shape;
  for (const json& d : j) {
    // Non-negative integers parse as unsigned; anything above 2^48 cannot match a member's bytes.
    if (!d.is_number_unsigned() || d.get<uint64_t>() > (uint64_t(1) << 48))
      fail("{}: json {} {} has an entry that is not a size", where, what, json_excerpt(j));
    shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
  }
  return shape;
}

// meta[key] when present: it must be a string (a dtype) or an object (a table of them).
// `label` names it in the error ("dtypes.t5").
const json* json_member(const json& meta, const std::string& key, json::value_t type, const std::string& where,
                        const std::string& label) {
  const auto it = meta.find(key);
  if (it == meta.end()) return nullptr;
  if (it->type() != type)
    fail("{}: json '{}' is {}, expected {}", where, label, json_excerpt(*it),
         type == json::value_t::string ? "a string (a dtype such as \"bf16\")" : "an object keyed by field name");
  return &*it;
}

// Finds the layout of field `name` (or its canonical name) in the sample's json. The keys that
// describe layouts must have their types: a wrong one would otherwise decode with a default.
void json_layout(const json& meta, const std::string& name, const std::string& canon, const std::string& where,
                 std::vector<int64_t>& shape, bool& has_shape, std::string& dtype) {
  has_shape = false;
  if (!meta.is_object()) return;
  if (const json* d = json_member(meta, "dtype", json::value_t::string, where, "dtype")) dtype = d->get<std::string>();
  const json* shapes = json_member(meta, "shapes", json::value_t::object, where, "shapes");
  const json* dtypes = json_member(meta, "dtypes", json::value_t::object, where, "dtypes");
  for (const std::string& n : {name, canon}) {
    const auto f = meta.find(n);
    if (f != meta.end() && f->is_object()) {
      if (const auto s = f->find("shape"); s != f->end()) {
        shape = json_shape(*s, where, "'" + n + "'.shape");
        has_shape = true;
      }
      if (const json* d = json_member(*f, "dtype", json::value_t::string, where, n + ".dtype"))
        dtype = d->get<std::string>();
    }
    if (shapes)
      if (const auto s = shapes->find(n); s != shapes->end()) {
        shape = json_shape(*s, where, "shapes." + n);
        has_shape = true;
      }
    if (dtypes) {
      if (const json* d = json_member(*dtypes, n, json::value_t::string, where, "dtypes." + n))
        dtype = d->get<std::string>();
    }
    if (has_shape) return;
  }
}

// Runs one member's decoding; any exception from a library (nlohmann, the standard library, an
// allocation) becomes an Error naming the member.
template <typename F>
void decoding(const std::string& where, F&& decode) {
  try {
    decode();
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    fail("{}: out of memory while decoding it", where);
  } catch (const std::exception& e) {
    fail("{}: cannot decode it: {}", where, quote_excerpt(e.what(), 200));
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

namespace {

// numpy pads its headers to 64 bytes around a three-key dict, and itself refuses headers over
// 10000 bytes by default; 64 KiB is far beyond any array flux8 reads.
constexpr size_t kMaxNpyHeader = 1u << 16;

// The 'shape' tuple of a .npy header, from its '(' at `v`.
std::vector<int64_t> npy_shape(const std::string& header, size_t v, const std::string& where) {
  const size_t end = header.find(')', v);
  if (end == std::string::npos) fail("{}: .npy 'shape' tuple is not closed: {}", where, quote_excerpt(header));
  std::vector<int64_t> shape;
  size_t i = v + 1;
  while (i < end) {
    while (i < end && (header[i] == ' ' || header[i] == ',')) ++i;
    if (i >= end) break;
    uint64_t d = 0;
    size_t digits = 0;
    while (i < end && header[i] >= '0' && header[i] <= '9') {
      // Beyond 2^48 no dimension can match the member's bytes (checked_numel); stopping there
      // keeps the arithmetic far from overflow.
      if (d > (uint64_t(1) << 48))
        fail("{}: .npy shape is impossibly large: {}", where, quote_excerpt(header.substr(v, end + 1 - v)));
      d = d * 10 + static_cast<uint64_t>(header[i++] - '0');
      ++digits;
    }
    while (i < end && (header[i] == 'L' || header[i] == ' ')) ++i;  // Python 2 longs
    if (digits == 0 || (i < end && header[i] != ','))
      fail("{}: .npy 'shape' has an entry that is not a size: {}", where, quote_excerpt(header.substr(v, end + 1 - v)));
    if (shape.size() == kMaxDims) fail("{}: .npy shape has more than {} dimensions", where, kMaxDims);
    shape.push_back(static_cast<int64_t>(d));
  }
  return shape;
}

// The element type of a .npy 'descr' (byte order '<' little, '|' not applicable, '=' native,
// '>' big; then kind and size).
Elem npy_elem(const std::string& descr, const std::string& where, bool u2_is_bf16) {
  static const std::map<std::string, Elem> codes = {
      {"f2", Elem::f16}, {"f4", Elem::f32}, {"f8", Elem::f64}, {"i1", Elem::i8},  {"i2", Elem::i16}, {"i4", Elem::i32},
      {"i8", Elem::i64}, {"u1", Elem::u8},  {"u2", Elem::u16}, {"u4", Elem::u32}, {"u8", Elem::u64}, {"b1", Elem::b1}};
  const char order = descr.empty() ? '\0' : descr[0];
  const bool has_order = order == '<' || order == '|' || order == '=' || order == '>';
  const auto it = codes.find(has_order ? descr.substr(1) : descr);
  if (it == codes.end())
    fail("{}: .npy dtype '{}' is not supported (floats f2/f4/f8, ints i1..i8/u1..u8, bool)", where,
         quote_excerpt(descr));
  Elem e = it->second;
  if (order == '>' && elem_size(e) > 1)
    fail(
        "{}: .npy dtype '{}' is big-endian; flux8 reads little-endian data only. Re-save it with "
        "a.astype(a.dtype.newbyteorder('<'))",
        where, quote_excerpt(descr));
  // MLPerf Flux stores bf16 tensors as np.save(tensor.view(torch.uint16).numpy()).
  if (u2_is_bf16 && e == Elem::u16) e = Elem::bf16;
  return e;
}

// The tensor of a .npy image (decode_npy without its exception guard).
HostTensor npy_tensor(const uint8_t* data, size_t size, const std::string& where, bool u2_is_bf16) {
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
  if (header_len > kMaxNpyHeader)
    fail("{}: .npy header of {} bytes is longer than the {} any array flux8 reads needs (corrupt member?)", where,
         header_len, kMaxNpyHeader);
  if (header_len > size - header_at)
    fail("{}: .npy header of {} bytes runs past the {}-byte member (truncated)", where, header_len, size);
  const std::string header(reinterpret_cast<const char*>(data + header_at), header_len);
  const size_t open = header.find_first_not_of(' ');
  if (open == std::string::npos || header[open] != '{')
    fail("{}: .npy header is not a dict: {}", where, quote_excerpt(header));

  size_t v = npy_value(header, "descr");
  if (v == std::string::npos || (header[v] != '\'' && header[v] != '"'))
    fail("{}: .npy header has no 'descr' string: {}", where, quote_excerpt(header));
  const size_t close = header.find(header[v], v + 1);
  if (close == std::string::npos) fail("{}: .npy header is malformed: {}", where, quote_excerpt(header));
  const std::string descr = header.substr(v + 1, close - v - 1);

  v = npy_value(header, "fortran_order");
  if (v == std::string::npos) fail("{}: .npy header has no 'fortran_order': {}", where, quote_excerpt(header));
  if (header.compare(v, 4, "True") == 0)
    fail(
        "{}: .npy array is in Fortran (column-major) order; flux8 reads C order only. Re-save "
        "it with np.save(f, np.ascontiguousarray(a))",
        where);
  if (header.compare(v, 5, "False") != 0)
    fail("{}: .npy 'fortran_order' is neither True nor False: {}", where, quote_excerpt(header));

  v = npy_value(header, "shape");
  if (v == std::string::npos || header[v] != '(')
    fail("{}: .npy header has no 'shape' tuple: {}", where, quote_excerpt(header));
  const std::vector<int64_t> shape = npy_shape(header, v, where);
  const Elem e = npy_elem(descr, where, u2_is_bf16);

  const std::optional<uint64_t> expected = checked_bytes(shape, e);
  if (!expected) fail("{}: .npy shape {} is impossibly large", where, shape_text(shape));
  const uint64_t have = size - header_at - header_len;
  if (have != *expected)
    fail("{}: .npy header says {} '{}' = {} data bytes, but the member holds {} after the header", where,
         shape_text(shape), quote_excerpt(descr), *expected, have);
  return make_tensor(data + header_at + header_len, shape, e);
}

}  // namespace

HostTensor decode_npy(const uint8_t* data, size_t size, const std::string& where, bool u2_is_bf16) {
  HostTensor t;
  decoding(where, [&] { t = npy_tensor(data, size, where, u2_is_bf16); });
  return t;
}

HostTensor decode_raw(const uint8_t* data, size_t size, const std::string& dtype, const std::vector<int64_t>& shape,
                      const std::string& where, const std::string& source) {
  Elem e;
  if (!raw_dtype(dtype, e))
    fail("{}: dtype '{}' from {} is not supported for raw .bytes (bf16, f16, f32)", where, quote_excerpt(dtype),
         source);
  const std::optional<uint64_t> expected = checked_bytes(shape, e);
  if (!expected) fail("{}: shape {} from {} is impossibly large", where, shape_text(shape), source);
  if (size != *expected)
    fail("{}: {} bytes, but {} says {} {} = {} bytes", where, size, source, shape_text(shape), quote_excerpt(dtype),
         *expected);
  HostTensor t;
  decoding(where, [&] { t = make_tensor(data, shape, e); });
  return t;
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
    if (!parsed) fail("{}: invalid JSON: {}", where_text(raw.shard, m.name), quote_excerpt(error, 200));
    if (!parsed->is_object())
      fail("{}: json is {}, expected an object (\"shapes\", \"dtypes\", \"caption\", ...)",
           where_text(raw.shard, m.name), json_excerpt(*parsed));
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

// The json's "timestep", checked before any member is decoded: a float must hold it.
std::optional<float> json_timestep(const json& meta, const std::string& where) {
  if (!meta.is_object()) return std::nullopt;
  const auto it = meta.find("timestep");
  if (it == meta.end()) return std::nullopt;
  const double v = it->is_number() ? it->get<double>() : std::nan("");
  if (!std::isfinite(v) || std::fabs(v) > std::numeric_limits<float>::max())
    fail("{}: json timestep {} is not a number a float holds", where, json_excerpt(*it));
  return static_cast<float>(v);
}

// The json's caption, unless a .txt member gave one.
void apply_caption(Sample& s, const json& meta) {
  if (!meta.is_object()) return;
  for (const char* k : {"caption", "prompt"})
    if (const auto it = meta.find(k); it != meta.end() && it->is_string()) {
      s.caption = it->get<std::string>();
      return;
    }
}

// One member into the sample (by its extension; others are not flux8's to decode).
void decode_member(const SampleMember& m, const RawSample& raw, const json& meta, const std::string& meta_member,
                   Sample& s, FieldSink& sink, bool& caption_from_txt) {
  std::string key, ext;
  if (!split_member_name(m.name, key, ext)) return;
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
      fail("{}: a .{} member needs a field name (KEY.FIELD.{}, e.g. {}.t5.{})", where, format, format, raw.key, format);
    if (format == "npy" || is_npy(m.data))
      sink.put(field, decode_npy(m.data.data(), m.data.size(), where, format == "bytes"), m.name);
    else
      sink.put(field, decode_raw_member(m, field, where, raw, meta, meta_member), m.name);
  } else if (format == "safetensors") {
    decode_safetensors_member(m, field, where, sink);
  }
}

}  // namespace

Sample decode_sample(const RawSample& raw) {
  for (const SampleMember& m : raw.members)
    if (!m.fault.empty())
      fail("{}: {} (the shard around it is intact; its sample cannot be used)", where_text(raw.shard, m.name), m.fault);
  Sample s;
  s.key = raw.key;
  s.shard = raw.shard;
  std::string meta_member;
  json meta;
  std::optional<float> timestep;
  decoding(where_text(raw.shard, "(json of sample " + raw.key + ")"), [&] {
    meta = read_meta(raw, meta_member);
    timestep = json_timestep(meta, where_text(raw.shard, meta_member));
  });
  FieldSink sink(s, raw);
  bool caption_from_txt = false;
  for (const SampleMember& m : raw.members)
    decoding(where_text(raw.shard, m.name),
             [&] { decode_member(m, raw, meta, meta_member, s, sink, caption_from_txt); });
  if (!caption_from_txt) apply_caption(s, meta);
  if (timestep) s.fields["timestep"] = HostTensor{{}, {*timestep}};
  return s;
}

Sample load_sample(const RawSample& raw) {
  RawSample full = raw;
  for (SampleMember& m : full.members)
    if (m.fault.empty() && m.data.size() != m.size) m.data = read_file_range(raw.shard, m.offset, m.size, m.name);
  return decode_sample(full);
}

// ---------------------------------------------------------------------------------------------
// Reader

WebDatasetReader::WebDatasetReader(const std::string& shard_path) : tar_(shard_path) {}

WebDatasetReader::WebDatasetReader(std::string name, std::string_view bytes) : tar_(std::move(name), bytes) {}

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
    SampleMember m{pending_.name, pending_.data_offset, pending_.size, {}, pending_.fault};
    // A member with a fault has no data to read; decode_sample reports it.
    if (with_data && m.fault.empty()) m.data = tar_.read_data();
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
