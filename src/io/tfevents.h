#pragma once
// TensorBoard event files (events.out.tfevents.*) written without TensorFlow: TFRecord framing
// (length, masked CRC32C of the length, payload, masked CRC32C of the payload) around
// tensorflow.Event protobuf messages encoded by hand. Only what a training run writes is
// encoded: scalar summaries (Summary.Value.simple_value), image summaries (Summary.Image, PNG
// bytes) and SessionLog START, with which TensorBoard drops the points a resumed run repeats.
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

namespace flux8 {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `data`, continuing from `crc` (0 to
// start).
uint32_t crc32c(std::string_view data, uint32_t crc = 0);
// TFRecord's masked form of a CRC: rotated right by 15 bits plus 0xa282ead8.
uint32_t masked_crc32c(std::string_view data);

// The protobuf encodings, each a complete tensorflow.Event message.
namespace tfevent {
std::string file_version(double wall_time);  // Event{wall_time, file_version: "brain.Event:2"}
std::string scalar(double wall_time, int64_t step, std::string_view tag, float value);
// png: the encoded image; height, width in pixels; channels 3 (RGB) or 4 (RGBA).
std::string image(double wall_time, int64_t step, std::string_view tag, std::string_view png, int height, int width,
                  int channels);
std::string session_start(double wall_time, int64_t step);  // Event{session_log: {status: START}}
}  // namespace tfevent

// `payload` framed as one TFRecord.
std::string tf_record(std::string_view payload);

// One event file in `dir` (created when missing), named as TensorFlow names them:
// events.out.tfevents.<unix seconds>.<host>.<pid>. Each add_* writes one record and flushes, so
// TensorBoard shows a running job's points and a crash loses none. Errors name the file.
class EventFileWriter {
 public:
  explicit EventFileWriter(const std::string& dir);
  const std::string& path() const { return path_; }

  void add_scalar(std::string_view tag, int64_t step, double value);
  // An image summary from PNG bytes (io/png.h writes them) of width × height pixels, RGB.
  void add_image(std::string_view tag, int64_t step, std::string_view png, int width, int height);
  // A resumed run's first event: TensorBoard discards what earlier files hold at `step` and
  // after (SessionLog START).
  void add_session_start(int64_t step);

 private:
  void write(const std::string& event);
  std::string path_;
  std::ofstream out_;
};

// Unix time in seconds, with the fraction.
double unix_seconds();

}  // namespace flux8
