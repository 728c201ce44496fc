#include "io/tfevents.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace flux8 {

namespace {

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// The protobuf wire format, the parts an Event needs: field keys, varints, fixed-width
// little-endian numbers and length-delimited fields.
enum WireType : uint32_t { varint = 0, fixed64 = 1, length_delimited = 2, fixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_key(std::string& out, uint32_t field, WireType type) { put_varint(out, (uint64_t{field} << 3) | type); }

template <class T>
void put_little_endian(std::string& out, T v) {
  unsigned char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // the hosts flux8 builds for are little-endian
  out.append(reinterpret_cast<const char*>(bytes), sizeof(T));
}

void put_int(std::string& out, uint32_t field, int64_t v) {
  put_key(out, field, varint);
  put_varint(out, static_cast<uint64_t>(v));  // negative int64: ten bytes, two's complement
}
void put_double(std::string& out, uint32_t field, double v) {
  put_key(out, field, fixed64);
  put_little_endian(out, v);
}
void put_float(std::string& out, uint32_t field, float v) {
  put_key(out, field, fixed32);
  put_little_endian(out, v);
}
void put_bytes(std::string& out, uint32_t field, std::string_view v) {
  put_key(out, field, length_delimited);
  put_varint(out, v.size());
  out.append(v);
}

// tensorflow.Event's fields, as TensorFlow's event.proto numbers them.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5, kEventSessionLog = 7;
// Summary.value; Summary.Value's tag, simple_value and image; Summary.Image's fields.
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimple = 2, kValueImage = 4;
constexpr uint32_t kImageHeight = 1, kImageWidth = 2, kImageColorspace = 3, kImageEncoded = 4;
constexpr uint32_t kSessionLogStatus = 1, kSessionLogStart = 1;

std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  if (step != 0) put_int(e, kEventStep, step);  // proto3: a zero is left out
  return e;
}

std::string summary_event(double wall_time, int64_t step, const std::string& value) {
  std::string summary;
  put_bytes(summary, kSummaryValue, value);
  std::string e = event_header(wall_time, step);
  put_bytes(e, kEventSummary, summary);
  return e;
}

}  // namespace

uint32_t crc32c(std::string_view data, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  crc = ~crc;
  for (unsigned char b : data) crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

namespace tfevent {

std::string file_version(double wall_time) {
  std::string e = event_header(wall_time, 0);
  put_bytes(e, kEventFileVersion, "brain.Event:2");
  return e;
}

std::string scalar(double wall_time, int64_t step, std::string_view tag, float value) {
  std::string v;
  put_bytes(v, kValueTag, tag);
  put_float(v, kValueSimple, value);
  return summary_event(wall_time, step, v);
}

std::string image(double wall_time, int64_t step, std::string_view tag, std::string_view png, int height, int width,
                  int channels) {
  std::string img;
  put_int(img, kImageHeight, height);
  put_int(img, kImageWidth, width);
  put_int(img, kImageColorspace, channels);
  put_bytes(img, kImageEncoded, png);
  std::string v;
  put_bytes(v, kValueTag, tag);
  put_bytes(v, kValueImage, img);
  return summary_event(wall_time, step, v);
}

std::string session_start(double wall_time, int64_t step) {
  std::string log;
  put_int(log, kSessionLogStatus, kSessionLogStart);
  std::string e = event_header(wall_time, step);
  put_bytes(e, kEventSessionLog, log);
  return e;
}

}  // namespace tfevent

std::string tf_record(std::string_view payload) {
  std::string out;
  std::string length;
  put_little_endian(length, static_cast<uint64_t>(payload.size()));
  out += length;
  put_little_endian(out, masked_crc32c(length));
  out.append(payload);
  put_little_endian(out, masked_crc32c(payload));
  return out;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

EventFileWriter::EventFileWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) fail("cannot create the TensorBoard directory {} (tensorboard_dir): {}", dir, ec.message());
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  const double now = unix_seconds();
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." +
                                         host + "." + std::to_string(::getpid())))
              .string();
  out_.open(path_, std::ios::binary | std::ios::app);
  if (!out_) fail("cannot open {} for writing (TensorBoard events; set tensorboard_dir elsewhere)", path_);
  write(tfevent::file_version(now));
}

void EventFileWriter::write(const std::string& event) {
  out_ << tf_record(event);
  out_.flush();
  if (!out_) fail("cannot write {} (TensorBoard events): is the disk full?", path_);
}

void EventFileWriter::add_scalar(std::string_view tag, int64_t step, double value) {
  write(tfevent::scalar(unix_seconds(), step, tag, static_cast<float>(value)));
}

void EventFileWriter::add_image(std::string_view tag, int64_t step, std::string_view png, int width, int height) {
  write(tfevent::image(unix_seconds(), step, tag, png, height, width, 3));
}

void EventFileWriter::add_session_start(int64_t step) { write(tfevent::session_start(unix_seconds(), step)); }

}  // namespace flux8
