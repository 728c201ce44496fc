#pragma once
// Hand-made bytes for the data pipeline's tests: .npy images, tar headers and pax records
// (including what the tar writer never produces).
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"

namespace flux8::testing::data {

// A .npy v1.0 (or v2.0) image: descr as given, C order, data bytes as given.
inline std::string npy(const std::string& descr, const std::vector<int64_t>& shape, const std::string& data,
                       int version = 1, bool fortran = false) {
  std::string shape_text = "(";
  for (int64_t d : shape) shape_text += std::to_string(d) + ", ";
  if (shape.size() > 1) shape_text.resize(shape_text.size() - 2);
  if (shape.size() == 1) shape_text.resize(shape_text.size() - 1);
  shape_text += ")";
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': {}, 'shape': {}, }}", descr,
                                   fortran ? "True" : "False", shape_text);
  const size_t prefix = version == 1 ? 10 : 12;
  while ((prefix + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(version);
  out += '\0';
  const uint32_t n = static_cast<uint32_t>(header.size());
  out.append(reinterpret_cast<const char*>(&n), version == 1 ? 2 : 4);
  return out + header + data;
}
template <typename T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
inline std::string npy_f32(const std::vector<int64_t>& shape, const std::vector<float>& v) {
  return npy("<f4", shape, bytes_of(v));
}
inline std::vector<uint16_t> bf16_bits(const std::vector<float>& v) {
  std::vector<uint16_t> out;
  for (float f : v) out.push_back(f32_to_bf16_bits(f));
  return out;
}

// Header `h` with its checksum computed (again, after an edit).
inline std::string rechecksummed(std::string h) {
  std::memset(h.data() + 148, ' ', 8);
  unsigned sum = 0;
  for (char c : h) sum += static_cast<uint8_t>(c);
  std::snprintf(h.data() + 148, 8, "%06o", sum);
  h[155] = ' ';
  return h;
}

// One 512-byte header assembled by hand (octal fields, checksum), for cases the writer never
// produces: pax headers, ustar prefixes, directories.
inline std::string raw_header(const std::string& name, uint64_t size, char type, const std::string& prefix = "") {
  std::string h(512, '\0');
  std::memcpy(h.data(), name.data(), std::min<size_t>(name.size(), 100));
  std::snprintf(h.data() + 100, 8, "%07o", 0644);
  std::snprintf(h.data() + 124, 12, "%011llo", static_cast<unsigned long long>(size));
  std::snprintf(h.data() + 136, 12, "%011o", 0);
  h[156] = type;
  std::memcpy(h.data() + 257, "ustar", 6);
  std::memcpy(h.data() + 263, "00", 2);
  std::memcpy(h.data() + 345, prefix.data(), prefix.size());
  return rechecksummed(std::move(h));
}
inline std::string padded(const std::string& data) { return data + std::string((512 - data.size() % 512) % 512, '\0'); }
// A pax record "<len> key=value\n", where len counts the whole record including itself.
inline std::string pax_record(const std::string& key, const std::string& value) {
  const std::string body = " " + key + "=" + value + "\n";
  size_t len = body.size() + 1;
  while (std::to_string(len).size() + body.size() != len) ++len;
  return std::to_string(len) + body;
}

}  // namespace flux8::testing::data
