// The bounded whole-file reads and JSON parses every small input file goes through.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <string>

#include "core/text_file.h"
#include "test_util.h"

namespace flux8 {
namespace {

using namespace flux8::testing;

std::string read_error(const std::string& path, uint64_t max_bytes = kMaxTextFileBytes) {
  std::string error;
  EXPECT_FALSE(read_file_text(path, error, max_bytes).has_value()) << path;
  return error;
}

TEST(TextFile, ReadsARegularFileWhole) {
  TempDir dir;
  const std::string path = dir.write("a.txt", std::string(5000, 'x') + "end");
  std::string error;
  const auto text = read_file_text(path, error);
  ASSERT_TRUE(text.has_value()) << error;
  EXPECT_EQ(text->size(), 5003u);
  EXPECT_EQ(text->substr(5000), "end");
}

TEST(TextFile, RefusesWhatIsNotARegularFileWithoutWaiting) {
  TempDir dir;
  EXPECT_EQ(read_error(dir.path()), "not a regular file");
  EXPECT_EQ(read_error("/dev/zero"), "not a regular file");
  // A FIFO with no writer: a blocking open would wait forever.
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(read_error(fifo), "not a regular file");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_NE(read_error(dir.file("absent")).find("No such file"), std::string::npos);
}

TEST(TextFile, RefusesAFileOverTheLimitBeforeReadingIt) {
  TempDir dir;
  const std::string path = dir.write("big.txt", std::string(1025, 'x'));
  EXPECT_EQ(read_error(path, 1024), "1025 bytes, more than the 1024 this file may have");
  expect_mentions(error_of([&] { read_text_or_fail(path, "config file", 1024); }), {"config file", path, "1025 bytes"});
}

TEST(TextFile, JsonNestingAndNumbersAreBounded) {
  std::string error;
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  EXPECT_FALSE(parse_json(deep, error).has_value());
  EXPECT_NE(error.find("nested more than 64 levels"), std::string::npos) << error;
  EXPECT_TRUE(parse_json(std::string(64, '[') + std::string(64, ']'), error).has_value()) << error;
  EXPECT_FALSE(parse_json("{\"a\": 1e400}", error).has_value());
  EXPECT_FALSE(error.empty());
}

TEST(TextFile, QuotedExcerptsAreShortAndPrintable) {
  EXPECT_EQ(quote_excerpt("abc"), "abc");
  EXPECT_EQ(quote_excerpt(std::string("a\0\n", 3)), "a\\x00\\x0a");
  EXPECT_EQ(quote_excerpt(std::string(1 << 20, 'y'), 8), "yyyyyyyy...");
}

}  // namespace
}  // namespace flux8
