#pragma once
// Helpers shared by the unit tests: a fresh temporary directory per test and error capture.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"

namespace flux8::testing {

// A directory named after the running test (suite, name, pid), so tests cannot see each
// other's files; removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        std::filesystem::temp_directory_path() / fmt::format("flux8_{}_{}_{}", info ? info->test_suite_name() : "none",
                                                             info ? info->name() : "none", ::getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~TempDir() { std::filesystem::remove_all(dir_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  std::string path(const std::string& name = "") const { return (dir_ / name).string(); }
  std::string file(const std::string& name) const { return path(name); }
  // Writes `text` to `name` (creating directories) and returns its path.
  std::string write(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = dir_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }
  std::vector<std::string> listing() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) out.push_back(e.path().filename().string());
    return out;
  }

 private:
  std::filesystem::path dir_;
};

// The message of the flux8::Error `f` throws; a test failure if it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a flux8::Error";
  return "";
}

// A whole file's bytes (a test failure if it cannot be opened), and the reverse.
inline std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f) << path;
  return std::string(std::istreambuf_iterator<char>(f), {});
}
inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Runs `flux8 <args>` (the binary next to the tests) with its output captured in `log_file`;
// returns its exit status (-1 if it did not exit normally) and puts the output in *log.
#ifdef FLUX8_BINARY
inline int run_flux8(const std::string& args, const std::string& log_file, std::string* log) {
  const int rc = std::system((std::string(FLUX8_BINARY) + " " + args + " > " + log_file + " 2>&1").c_str());
  *log = read_bytes(log_file);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}
#endif

// The call fails with a message that contains `what` (the op, and the tensor where it names one).
template <typename F>
void expect_refused(const std::string& what, F call) {
  try {
    call();
    ADD_FAILURE() << "expected an error containing \"" << what << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

inline void expect_mentions(const std::string& msg, std::initializer_list<std::string> parts) {
  for (const std::string& p : parts)
    EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "':\n" << msg;
}

}  // namespace flux8::testing
