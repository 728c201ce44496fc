// TensorBoard event files: CRC-32C against published check values, and the hand-written
// protobuf encoding against the bytes TensorBoard's own protobuf classes produce for the same
// Event (tensorboard.compat.proto.event_pb2, serialized once; tests/python/test_tensorboard.py
// reads whole files back with TensorBoard's reader).
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/text_file.h"
#include "io/tfevents.h"
#include "test_util.h"

namespace flux8 {
namespace {

using namespace flux8::testing;

std::string unhex(std::string_view hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return out;
}

std::string bytes_of(std::initializer_list<int> v) {
  std::string s;
  for (int b : v) s.push_back(static_cast<char>(b));
  return s;
}

TEST(Crc32c, MatchesPublishedCheckValues) {
  // RFC 3720 (iSCSI) appendix B.4 and the "123456789" check value of the CRC catalogue.
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string up, down;
  for (int i = 0; i < 32; ++i) up.push_back(static_cast<char>(i)), down.push_back(static_cast<char>(31 - i));
  EXPECT_EQ(crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down), 0x113FDB5Cu);
}

TEST(Crc32c, ContinuesAcrossPieces) { EXPECT_EQ(crc32c("6789", crc32c("12345")), crc32c("123456789")); }

TEST(Crc32c, MaskedAsTfRecordMasksIt) {
  // TensorBoard's record_writer.masked_crc32c gives these.
  EXPECT_EQ(masked_crc32c("123456789"), 0xc78ab0e5u);
  EXPECT_EQ(masked_crc32c(bytes_of({24, 0, 0, 0, 0, 0, 0, 0})), 0x224b7fa3u);
}

TEST(TfRecord, FramesLengthPayloadAndBothChecksums) {
  EXPECT_EQ(tf_record("abc"), unhex("0300000000000000b099490e6162636e57f121"));
}

TEST(TfEvent, FileVersionEvent) {
  EXPECT_EQ(tfevent::file_version(1.5), unhex("09000000000000f83f1a0d627261696e2e4576656e743a32"));
}

TEST(TfEvent, ScalarSummary) {
  EXPECT_EQ(tfevent::scalar(1.5, 3, "train/loss", 0.25f),
            unhex("09000000000000f83f10032a130a110a0a747261696e2f6c6f7373150000803e"));
}

TEST(TfEvent, ImageSummary) {
  EXPECT_EQ(tfevent::image(1.5, 7, "img", "PNG", 2, 3, 3),
            unhex("09000000000000f83f10072a140a120a03696d67220b0802100318032203504e47"));
}

TEST(TfEvent, SessionStartAtAMultiByteStep) {
  EXPECT_EQ(tfevent::session_start(2.0, 300), unhex("09000000000000004010ac023a020801"));
}

TEST(EventFileWriter, WritesTheVersionRecordFirstThenOneRecordAnEvent) {
  TempDir dir;
  std::string path;
  {
    EventFileWriter w(dir.file("tb"));
    path = w.path();
    w.add_scalar("loss", 5, 0.5);
  }
  EXPECT_EQ(std::filesystem::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u) << path;
  const std::string bytes = read_text_or_fail(path, "event file");
  // The first record holds the file_version event: wall time (9 bytes) + "brain.Event:2" (15).
  ASSERT_GE(bytes.size(), 16u + 24u);
  EXPECT_EQ(bytes.substr(0, 8), bytes_of({24, 0, 0, 0, 0, 0, 0, 0}));
  const std::string first = bytes.substr(12, 24);
  EXPECT_EQ(first.substr(9), unhex("1a0d627261696e2e4576656e743a32"));
  EXPECT_EQ(bytes.substr(0, 16 + 24), tf_record(first));
  // The scalar's record follows, framed the same way.
  const std::string rest = bytes.substr(40);
  ASSERT_GE(rest.size(), 16u);
  const size_t n = static_cast<unsigned char>(rest[0]);
  ASSERT_EQ(rest.size(), 16 + n);
  EXPECT_EQ(rest.substr(12, n).substr(9), unhex("10052a0d0a0b0a046c6f7373150000003f"));
}

TEST(EventFileWriter, NamesTheDirectoryItCannotCreate) {
  TempDir dir;
  const std::string blocker = dir.write("file", "x");
  try {
    EventFileWriter w(blocker + "/tb");
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find(blocker + "/tb"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("tensorboard_dir"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flux8
