#include "train/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "backend/transfer.h"
#include "core/error.h"
#include "core/sha256.h"
#include "core/text_file.h"
#include "fp8/state_io.h"
#include "io/safetensors.h"
#include "model/weights_io.h"
#include "train/checkpoint_manifest.h"
#include "train/checkpoint_shards.h"
#include "train/data_parallel.h"

namespace flux8 {

namespace fs = std::filesystem;

namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kFp8File = "fp8_state.safetensors";
constexpr const char* kStateFile = "trainer_state.json";
constexpr const char* kManifestFile = "manifest.json";
constexpr const char* kTmpPrefix = ".tmp-";

// ---- durable file-system operations ------------------------------------------------------

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) fail("cannot open '{}' to fsync it: {}", path, std::strerror(errno));
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc != 0) fail("cannot fsync '{}': {} (is the disk full or failing?)", path, std::strerror(err));
}

void write_file_durably(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create '{}': {}", path, std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail("cannot write '{}': {} (is the disk full?)", path, std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc != 0) fail("cannot fsync '{}': {}", path, std::strerror(err));
}

// Swaps two directory entries atomically (Linux renameat2 RENAME_EXCHANGE); false when the
// file system does not support it.
bool exchange_paths(const std::string& a, const std::string& b) {
#ifdef RENAME_EXCHANGE
  return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0;
#else
  return false;
#endif
}

void rename_path(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) fail("cannot rename '{}' to '{}': {}", from, to, std::strerror(errno));
}

// ---- checkpoint directories --------------------------------------------------------------

std::optional<int64_t> parse_step_dir(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return std::nullopt;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

struct StepDir {
  int64_t step;
  std::string path;
  std::string name;
};

// Newest first.
std::vector<StepDir> list_step_dirs(const std::string& root) {
  std::vector<StepDir> dirs;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return dirs;
  for (const fs::directory_entry& e : fs::directory_iterator(root)) {
    const std::string name = e.path().filename().string();
    const auto step = parse_step_dir(name);
    if (step && e.is_directory(ec)) dirs.push_back({*step, e.path().string(), name});
  }
  std::sort(dirs.begin(), dirs.end(),
            [](const StepDir& a, const StepDir& b) { return a.step != b.step ? a.step > b.step : a.name > b.name; });
  return dirs;
}

// ---- manifest ----------------------------------------------------------------------------

// Throws an Error with a short problem (no directory prefix) when the manifest is unusable.
Manifest read_manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifestFile).string();
  std::error_code ec;
  if (!fs::exists(path, ec))
    fail("{} is missing (the checkpoint was never finished, or is not a flux8 checkpoint)", kManifestFile);
  std::string error;
  const std::optional<std::string> text = read_file_text(path, error);
  if (!text) fail("{} cannot be read: {}", kManifestFile, error);
  Manifest m = manifest_from_text(*text);
  for (const char* required : {kModelFile, kOptimizerFile, kStateFile})
    if (!m.files.count(required)) fail("{} does not list {}", kManifestFile, required);
  return m;
}

// Checks one file's presence and size against its manifest record; "" when they match.
std::string check_file_size(const std::string& dir, const std::string& name, const FileRecord& rec) {
  const std::string path = (fs::path(dir) / name).string();
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) return fmt::format("{} is missing ({})", name, ec.message());
  if (size != rec.bytes)
    return fmt::format(
        "{} has {} bytes, manifest says {} (the file is incomplete: a run was "
        "probably killed while writing or copying it, or the disk filled up)",
        name, size, rec.bytes);
  return "";
}

// One unit of verification: a whole file (piece < 0) or one piece of it.
struct DigestCheck {
  const std::string* name;
  const FileRecord* rec;
  int64_t piece;
};

std::string check_digest(const std::string& dir, const DigestCheck& c) {
  const std::string path = (fs::path(dir) / *c.name).string();
  try {
    if (c.piece < 0) {
      const std::string digest = sha256_file(path);
      if (digest != c.rec->sha256)
        return fmt::format("{} has sha256 {}, manifest says {}: the file was altered or damaged on disk", *c.name,
                           digest, c.rec->sha256);
      return "";
    }
    const uint64_t begin = static_cast<uint64_t>(c.piece) * c.rec->piece_bytes;
    const uint64_t end = begin + std::min(c.rec->bytes - begin, c.rec->piece_bytes);
    const std::string digest = sha256_file_range(path, begin, end - begin);
    const std::string& want = c.rec->piece_sha256[static_cast<size_t>(c.piece)];
    if (digest != want)
      return fmt::format("{} bytes [{}, {}) have sha256 {}, manifest says {}: the file was altered or damaged on disk",
                         *c.name, begin, end, digest, want);
    return "";
  } catch (const std::exception& e) {  // on a worker thread: reported, never thrown
    return e.what();
  }
}

// Every file's digests (or only file `only`'s), their pieces spread over the CPU's cores (a
// resume reads the whole checkpoint here: 16 GB at W2's slice, ~144 GB at 12B); the first
// problem in the manifest's order, or "".
std::string check_digests(const std::string& dir, const Manifest& m, const char* only = nullptr) {
  std::vector<DigestCheck> checks;
  for (const auto& [name, rec] : m.files) {
    if (only && name != only) continue;
    if (rec.piece_sha256.empty())
      checks.push_back({&name, &rec, -1});
    else
      for (size_t i = 0; i < rec.piece_sha256.size(); ++i) checks.push_back({&name, &rec, static_cast<int64_t>(i)});
  }
  std::vector<std::string> problems(checks.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next++) < checks.size();) problems[i] = check_digest(dir, checks[i]);
  };
  const size_t threads =
      std::min<size_t>(checks.size(), std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  for (std::string& p : problems)
    if (!p.empty()) return p;
  return "";
}

// "" when `dir` is a complete checkpoint; else the first problem found. `hash` = false checks
// only presence and sizes (cheap: used when pruning).
std::string checkpoint_problem(const std::string& dir, bool hash) {
  try {
    const Manifest m = read_manifest(dir);
    const auto named = parse_step_dir(fs::path(dir).filename().string());
    if (named && *named != m.step)
      return fmt::format("{} is for step {}, but the directory is named for step {}", kManifestFile, m.step, *named);
    // Presence and sizes of all files first: cheap, and the likely damage.
    for (const auto& [name, rec] : m.files) {
      std::string p = check_file_size(dir, name, rec);
      if (!p.empty()) return p;
    }
    if (!hash) return "";
    return check_digests(dir, m);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// ---- contents ----------------------------------------------------------------------------

std::vector<int64_t> dims(const Shape& s) { return std::vector<int64_t>(s.d.begin(), s.d.begin() + s.rank); }

void check_moments(const ParamStore& store, const Tensor& m, const Tensor& v, const char* what, int64_t elements = -1) {
  if (elements < 0) elements = store.layout().total();
  for (const auto& [t, name] : {std::pair{&m, "adam_m"}, std::pair{&v, "adam_v"}}) {
    if (!t->defined() || t->numel() != elements || !t->contiguous() ||
        (t->dtype != DType::f32 && t->dtype != DType::f64 && t->dtype != DType::bf16))
      fail(
          "{}: {} must be a contiguous f32/f64/bf16 buffer of {} elements laid out like the "
          "parameters, got {}",
          what, name, elements, t->str());
  }
}

std::string optimizer_tensor_name(const char* moment, const std::string& param) {
  return std::string(moment) + "." + param;
}

// The model file: every parameter under its reference name, F32 (also a plain weights file).
SafetensorsWriter model_writer(const TrainerState& state, const std::vector<ParamInfo>& params, const FlatSource& src) {
  return reference_weights_writer(params, src, DType::f32,
                                  {{"flux8_config", state.config_yaml},
                                   {"flux8_step", std::to_string(state.step)},
                                   {"flux8_version", state.flux8_version}});
}

// The optimizer state's file: the two moments of every parameter, as f32 whatever they are
// stored in (PyTorch's AdamW state).
SafetensorsWriter optimizer_writer(const TrainerState& state, const std::vector<ParamInfo>& params, const FlatSource& m,
                                   const FlatSource& v) {
  SafetensorsWriter writer;
  auto scratch = std::make_shared<std::vector<uint8_t>>();
  for (const auto& [moment, src] : {std::pair{"exp_avg", &m}, std::pair{"exp_avg_sq", &v}})
    for (const ParamInfo& p : params)
      writer.add_filled(optimizer_tensor_name(moment, p.name), DType::f32, dims(p.shape),
                        src->fill(p, DType::f32, scratch));
  writer.set_metadata("format", "pt");
  writer.set_metadata("flux8_optimizer", "adamw");
  writer.set_metadata("flux8_step", std::to_string(state.step));
  return writer;
}

// The moments of flat range `range` into adam_m and adam_v, which hold those elements.
void load_optimizer(const std::string& path, const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v,
                    Backend& be, FlatRange range) {
  const SafetensorsReader file(path);
  std::vector<std::string> problems;
  size_t expected = 0;
  for (const char* moment : {"exp_avg", "exp_avg_sq"})
    for (const ParamInfo& p : store.layout().params()) {
      ++expected;
      const std::string name = optimizer_tensor_name(moment, p.name);
      if (!file.contains(name)) problems.push_back("missing: " + name);
    }
  if (problems.empty() && file.names().size() != expected)
    problems.push_back(fmt::format("{} tensors, the model needs {}", file.names().size(), expected));
  if (!problems.empty())
    fail("optimizer state {} does not match this model ({}{}); was it saved with another config?", path,
         problems.front(), problems.size() > 1 ? fmt::format(" and {} more", problems.size() - 1) : "");
  UploadBuffers buffers;
  for (const auto& [moment, flat] : {std::pair{"exp_avg", &adam_m}, std::pair{"exp_avg_sq", &adam_v}})
    for (const ParamInfo& p : store.layout().params()) {
      const std::string name = optimizer_tensor_name(moment, p.name);
      if (file.tensor(name).shape != dims(p.shard.full))
        fail("safetensors file '{}', tensor '{}': shape is [{}] but [{}] was expected", path, name,
             fmt::join(file.tensor(name).shape, ", "), fmt::join(dims(p.shard.full), ", "));
      const int64_t n = p.shape.numel();
      const int64_t begin = std::max(p.offset, range.begin), end = std::min(p.offset + n, range.end());
      if (end <= begin) continue;
      const size_t es = dtype_size(flat->dtype);
      char* first = static_cast<char*>(flat->data) + static_cast<size_t>(begin - range.begin) * es;
      if (begin == p.offset && end == p.offset + n) {  // bf16 moments: rounded on the way
        upload_file_shard(be, file, name, p, Tensor(first, flat->dtype, p.shape), buffers);
        continue;
      }
      // A parameter across the range's edge: this rank's part of its (shard's) elements.
      std::vector<double>& whole = buffers.f64;
      whole.resize(static_cast<size_t>(p.shard.full.numel()));
      file.read_f64(name, whole.data());
      const std::vector<double> mine = p.shard.sharded() ? take_shard(p.shard, p.shard.rank, whole) : whole;
      from_host(be, Tensor(first, flat->dtype, Shape{end - begin}),
                std::vector<double>(mine.begin() + (begin - p.offset), mine.begin() + (end - p.offset)));
    }
}

void remove_quietly(const std::string& path) {
  std::error_code ec;
  fs::remove_all(path, ec);
  if (ec) std::cerr << fmt::format("flux8: warning: could not remove '{}': {}\n", path, ec.message());
}

// .tmp-* directories whose writer is gone: ".tmp-step-0000100-<pid>" with no live <pid>.
void remove_stale_tmp_dirs(const std::string& root) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kTmpPrefix, 0) != 0) continue;
    const size_t dash = name.rfind('-');
    const long pid = std::strtol(name.c_str() + dash + 1, nullptr, 10);
    const bool alive = pid > 0 && pid != ::getpid() && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
    if (!alive) remove_quietly(e.path().string());
  }
}

// Checkpoints whose digests this process verified, or which it wrote, with what their files
// looked like then (names, sizes, modification times): pruning takes one as complete, or as
// damaged, without reading it again while its files are unchanged. Saves run on the
// background saver's thread too: guarded.
class KnownCheckpoints {
 public:
  // "" when `dir` is complete: from memory, or its digests verified now (and remembered).
  std::string problem(const std::string& dir) {
    const std::string print = fingerprint(dir);
    {
      const std::lock_guard<std::mutex> lock(mu_);
      const auto it = known_.find(dir);
      if (it != known_.end() && it->second.fingerprint == print) return it->second.problem;
    }
    return record(dir, checkpoint_problem(dir, /*hash=*/true));
  }
  // True the first time it is asked about `dir` (one warning per damaged checkpoint and run).
  bool first_warning(const std::string& dir) {
    const std::lock_guard<std::mutex> lock(mu_);
    return warned_.insert(dir).second;
  }
  std::string record(const std::string& dir, const std::string& problem) {
    const std::string print = fingerprint(dir);
    const std::lock_guard<std::mutex> lock(mu_);
    known_[dir] = {print, problem};
    return problem;
  }
  void forget(const std::string& dir) {
    const std::lock_guard<std::mutex> lock(mu_);
    known_.erase(dir);
  }

 private:
  static std::string fingerprint(const std::string& dir) {
    std::vector<std::string> files;
    std::error_code ec;
    for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
      const uint64_t bytes = e.file_size(ec);
      const auto mtime = e.last_write_time(ec).time_since_epoch().count();
      files.push_back(fmt::format("{}:{}:{}", e.path().filename().string(), bytes, mtime));
    }
    std::sort(files.begin(), files.end());
    return fmt::format("{}", fmt::join(files, "/"));
  }
  struct Entry {
    std::string fingerprint, problem;
  };
  std::mutex mu_;
  std::map<std::string, Entry> known_;
  std::set<std::string> warned_;
};

KnownCheckpoints& known_checkpoints() {
  static KnownCheckpoints known;
  return known;
}

// Keeps the checkpoint just written and the newest keep_last - 1 others that verify; removes
// every checkpoint older than those. A damaged checkpoint among them is not counted and not
// removed: it is left in place for inspection (it may be the only trace of what went wrong),
// and a warning names it and its problem.
void prune(const std::string& root, const std::string& just_saved, int keep_last) {
  if (keep_last <= 0) return;
  int kept = 1;  // the checkpoint just written
  for (const StepDir& d : list_step_dirs(root)) {
    if (d.path == just_saved) continue;
    if (kept >= keep_last) {
      remove_quietly(d.path);
      known_checkpoints().forget(d.path);
      continue;
    }
    const std::string problem = known_checkpoints().problem(d.path);
    if (problem.empty()) {
      ++kept;
    } else if (known_checkpoints().first_warning(d.path)) {
      std::cerr << fmt::format(
          "flux8: warning: checkpoint {} is damaged ({}); it is left in place for inspection and does not count "
          "toward keep_last_checkpoints: remove it once it is no longer needed\n",
          d.path, problem);
    }
  }
}

// FLUX8_TEST_STOP_IN_SAVE=N (for the fault tests, tests/test_faults.cpp): the save of step N
// stops this process with SIGSTOP once its model and optimizer files are in the temporary
// directory and before its manifest is, so that a test can kill it there. Read once.
void stop_here_if_testing(int64_t step) {
  static const int64_t stop_step = [] {
    const char* e = std::getenv("FLUX8_TEST_STOP_IN_SAVE");
    if (!e || !*e) return int64_t{-1};
    char* end = nullptr;
    const long long v = std::strtoll(e, &end, 10);
    if (*end != '\0' || v < 0)
      fail("FLUX8_TEST_STOP_IN_SAVE='{}': expected a step number (a test hook; unset it)", quote_excerpt(e));
    return static_cast<int64_t>(v);
  }();
  if (step == stop_step) ::raise(SIGSTOP);
}

// The files of a checkpoint of `state` written and fsynced into `tmp_dir`, the manifest last.
void write_checkpoint_files(const std::string& tmp_dir, const TrainerState& state, const SafetensorsWriter& model,
                            const SafetensorsWriter& optimizer, const SafetensorsWriter* fp8) {
  auto in_tmp = [&](const char* file) { return (fs::path(tmp_dir) / file).string(); };
  // Every file is written and fsynced by its writer (safetensors: temp file + rename). The two
  // large ones are written side by side and hashed as they are written.
  const std::vector<SafetensorsWriter::Written> written =
      SafetensorsWriter::write_together({{&model, in_tmp(kModelFile)}, {&optimizer, in_tmp(kOptimizerFile)}});
  stop_here_if_testing(state.step);
  write_file_durably(in_tmp(kStateFile), trainer_state_to_json(state));
  if (fp8) fp8->write(in_tmp(kFp8File));

  std::map<std::string, FileRecord> files;
  // The large files' digests per piece, from their writers; the small ones' (a few KB) read.
  for (const auto& [file, w] : {std::pair{kModelFile, &written[0]}, std::pair{kOptimizerFile, &written[1]}})
    files[file] = FileRecord{w->bytes, "", SafetensorsWriter::kPieceBytes, w->piece_sha256};
  std::vector<const char*> small = {kStateFile};
  if (fp8) small.push_back(kFp8File);
  for (const char* file : small)
    files[file] = FileRecord{fs::file_size(in_tmp(file)), sha256_file(in_tmp(file)), 0, {}};
  write_file_durably(in_tmp(kManifestFile), manifest_to_text(state.step, files));
  fsync_path(tmp_dir, /*directory=*/true);
}

// Renames the complete `tmp_dir` to `final_dir`. On failure the previous step-N, if any, is
// back under its name.
void publish_checkpoint(const std::string& root, const std::string& tmp_dir, const std::string& final_dir) {
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    rename_path(tmp_dir, final_dir);
  } else if (exchange_paths(tmp_dir, final_dir)) {
    // Replacing step-N: swapped atomically, so a crash leaves one of the two complete versions
    // under the name; the old one is now under the .tmp name.
    fsync_path(root, true);
    remove_quietly(tmp_dir);
  } else {
    const std::string old_dir = tmp_dir + "-old";
    rename_path(final_dir, old_dir);
    try {
      rename_path(tmp_dir, final_dir);
    } catch (const Error&) {
      if (::rename(old_dir.c_str(), final_dir.c_str()) != 0)
        std::cerr << fmt::format("flux8: warning: the previous {} is now '{}': rename it back\n", final_dir, old_dir);
      throw;
    }
    fsync_path(root, true);
    remove_quietly(old_dir);
  }
  fsync_path(root, /*directory=*/true);
}

// Writes ROOT/step-N from the files' writers (the parameters' and moments' from the device or
// from a snapshot: the same bytes either way), then prunes. A save that fails removes its
// temporary directory (and whatever it holds) before it reports the error: the checkpoints
// before it stay as they were. On any thread: nothing here uses the backend except what the
// writers' fills do.
std::string write_checkpoint_dir(const std::string& root, const TrainerState& state, const SafetensorsWriter& model,
                                 const SafetensorsWriter& optimizer, const SafetensorsWriter* fp8, int keep_last) {
  if (state.step < 0) fail("save_checkpoint: step {} is negative", state.step);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail("cannot create checkpoint directory '{}': {}", root, ec.message());

  const std::string name = checkpoint_dir_name(state.step);
  const std::string final_dir = (fs::path(root) / name).string();
  const std::string tmp_dir = (fs::path(root) / fmt::format("{}{}-{}", kTmpPrefix, name, ::getpid())).string();
  fs::remove_all(tmp_dir, ec);
  fs::create_directory(tmp_dir, ec);
  if (ec) fail("cannot create '{}': {}", tmp_dir, ec.message());
  try {
    write_checkpoint_files(tmp_dir, state, model, optimizer, fp8);
    publish_checkpoint(root, tmp_dir, final_dir);
  } catch (const std::exception& e) {
    remove_quietly(tmp_dir);
    fail("saving checkpoint {} failed: {}; nothing of it is left in {}, and the checkpoints before it are intact",
         final_dir, e.what(), root);
  }
  known_checkpoints().record(final_dir, "");
  prune(root, final_dir, keep_last);
  remove_stale_tmp_dirs(root);
  return final_dir;
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) { return fmt::format("step-{:07d}", step); }

CheckpointFlats CheckpointFlats::of(const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v,
                                    Backend* moments_on) {
  return {store.flat_params(), adam_m, adam_v, &store.masters_backend(), moments_on ? moments_on : &store.backend()};
}

namespace {
void check_flats(const ParamStore& store, const CheckpointFlats& f, const char* what) {
  check_moments(store, f.adam_m, f.adam_v, what);
  if (store.masters_sharded() && f.params.data == store.flat_params().data)
    fail(
        "internal error: {}: this rank holds its shard of the master weights only; pass the whole-buffer masters "
        "gathered for the checkpoint (AdamWOptimizer::gather_moments, full_masters)",
        what);
  FLUX8_CHECK(f.params.numel() == store.layout().total() && f.params_on && f.moments_on, "{}: flats of {} for {}", what,
              f.params.str(), store.layout().total());
}
}  // namespace

std::string save_checkpoint(const std::string& root, const TrainerState& state, const FluxConfig&,
                            const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v, int keep_last,
                            const Fp8MetaRegistry* fp8, Backend* moments_backend) {
  return save_checkpoint(root, state, store, CheckpointFlats::of(store, adam_m, adam_v, moments_backend), keep_last,
                         fp8);
}

std::string save_checkpoint(const std::string& root, const TrainerState& state, const ParamStore& store,
                            const CheckpointFlats& f, int keep_last, const Fp8MetaRegistry* fp8) {
  check_flats(store, f, "save_checkpoint");
  return save_checkpoint(root, state, store.layout().params(), FlatSource::on_backend(*f.params_on, f.params),
                         FlatSource::on_backend(*f.moments_on, f.adam_m),
                         FlatSource::on_backend(*f.moments_on, f.adam_v), keep_last, fp8);
}

std::string save_checkpoint(const std::string& root, const TrainerState& state, const std::vector<ParamInfo>& params,
                            const FlatSource& values, const FlatSource& adam_m, const FlatSource& adam_v, int keep_last,
                            const Fp8MetaRegistry* fp8) {
  const SafetensorsWriter model = model_writer(state, params, values);
  const SafetensorsWriter optimizer = optimizer_writer(state, params, adam_m, adam_v);
  const std::optional<SafetensorsWriter> fp8_file = fp8 ? std::optional(fp8_state_writer(*fp8)) : std::nullopt;
  return write_checkpoint_dir(root, state, model, optimizer, fp8_file ? &*fp8_file : nullptr, keep_last);
}

uint64_t checkpoint_bytes(const std::string& dir) {
  std::error_code ec;
  uint64_t bytes = 0;
  for (const fs::directory_entry& f : fs::directory_iterator(dir, ec))
    if (f.is_regular_file(ec)) bytes += f.file_size(ec);
  return bytes;
}

uint64_t CheckpointSnapshot::bytes_for(const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v) {
  const auto n = static_cast<uint64_t>(store.layout().total());
  return n * (dtype_size(store.dtype()) + dtype_size(adam_m.dtype) + dtype_size(adam_v.dtype));
}

void CheckpointSnapshot::HostFlat::reserve(size_t n, bool touch) {
  if (bytes == n) return;  // kept from an earlier snapshot: no new pages to fault in
  data.reset();
  data.reset(new std::byte[n]);  // uninitialised: the download writes every byte
  bytes = n;
  if (!touch) return;
  // Zeroed over a few threads: the kernel maps the pages now instead of during the copy.
  const size_t parts = 8, part = (n + parts - 1) / parts;
  std::vector<std::thread> threads;
  for (size_t i = 0; i < parts && i * part < n; ++i)
    threads.emplace_back([p = data.get() + i * part, len = std::min(part, n - i * part)] { std::memset(p, 0, len); });
  for (std::thread& t : threads) t.join();
}

uint64_t CheckpointSnapshot::bytes_for(const ParamStore& store, DType moment_dtype) {
  return static_cast<uint64_t>(store.layout().total()) * (dtype_size(store.dtype()) + 2 * dtype_size(moment_dtype));
}

void CheckpointSnapshot::reserve(const ParamStore& store, const Tensor& adam_m, const Tensor& adam_v) {
  check_moments(store, adam_m, adam_v, "CheckpointSnapshot::reserve");
  FLUX8_CHECK(adam_m.dtype == adam_v.dtype, "CheckpointSnapshot::reserve: moments of two types");
  reserve(store, adam_m.dtype);
}

void CheckpointSnapshot::reserve(const ParamStore& store, DType moment_dtype) {
  const auto n = static_cast<size_t>(store.layout().total());
  params_.reserve(n * dtype_size(store.dtype()), /*touch=*/true);
  for (HostFlat* host : {&m_, &v_}) host->reserve(n * dtype_size(moment_dtype), /*touch=*/true);
}

void CheckpointSnapshot::take(const TrainerState& state, const ParamStore& store, const Tensor& adam_m,
                              const Tensor& adam_v, const Fp8MetaRegistry* fp8) {
  take(state, store, CheckpointFlats::of(store, adam_m, adam_v), fp8);
}

void CheckpointSnapshot::take(const TrainerState& state, const ParamStore& store, const CheckpointFlats& f,
                              const Fp8MetaRegistry* fp8) {
  check_flats(store, f, "CheckpointSnapshot::take");
  for (const auto& [host, t, on] :
       {std::tuple{&params_, &f.params, f.params_on}, std::tuple{&m_, &f.adam_m, f.moments_on},
        std::tuple{&v_, &f.adam_v, f.moments_on}}) {
    host->reserve(static_cast<size_t>(t->numel()) * dtype_size(t->dtype), /*touch=*/false);
    host->dtype = t->dtype;
    on->download(host->data.get(), t->data, host->bytes);
  }
  state_ = state;
  params_layout_ = store.layout().params();
  fp8_ = fp8 ? std::optional(fp8_state_writer(*fp8)) : std::nullopt;
  taken_ = true;
}

std::string CheckpointSnapshot::write(const std::string& root, int keep_last) const {
  FLUX8_CHECK(taken_, "CheckpointSnapshot::write before take");
  auto host = [](const HostFlat& h) { return FlatSource{nullptr, h.data.get(), h.dtype}; };
  const SafetensorsWriter model = model_writer(state_, params_layout_, host(params_));
  const SafetensorsWriter optimizer = optimizer_writer(state_, params_layout_, host(m_), host(v_));
  return write_checkpoint_dir(root, state_, model, optimizer, fp8_ ? &*fp8_ : nullptr, keep_last);
}

uint64_t CheckpointSnapshot::bytes() const { return params_.bytes + m_.bytes + v_.bytes; }

namespace {
void verify_checkpoint(const std::string& dir, bool hash) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("checkpoint {}: no such directory", dir);
  const std::string problem = checkpoint_problem(dir, hash);
  if (!problem.empty()) fail("checkpoint {}: {}; it cannot be used: resume from an earlier checkpoint", dir, problem);
}
}  // namespace

void verify_checkpoint(const std::string& dir) { verify_checkpoint(dir, /*hash=*/true); }

namespace {

// The newest ROOT/step-N that verifies (its digests), and each newer one's "path: problem".
// Every result is remembered for pruning.
std::optional<std::string> newest_verified(const std::string& root, std::vector<std::string>& skipped) {
  for (const StepDir& d : list_step_dirs(root)) {
    const std::string problem = known_checkpoints().record(d.path, checkpoint_problem(d.path, /*hash=*/true));
    if (problem.empty()) return d.path;
    skipped.push_back(fmt::format("{}: {}", d.path, problem));
  }
  return std::nullopt;
}

void warn_skipped(const std::vector<std::string>& skipped, const std::optional<std::string>& found,
                  std::string* report) {
  const std::string using_what =
      found ? "using " + fs::path(*found).filename().string() : "no complete checkpoint remains";
  for (const std::string& s : skipped) {
    const std::string line = fmt::format("flux8: warning: checkpoint {} — skipping it; {}\n", s, using_what);
    std::cerr << line;
    if (report) *report += line;
  }
}

}  // namespace

std::optional<std::string> find_latest_checkpoint(const std::string& root, std::string* report) {
  std::vector<std::string> skipped;
  const std::optional<std::string> found = newest_verified(root, skipped);
  warn_skipped(skipped, found, report);
  return found;
}

std::optional<std::string> checkpoint_to_resume(const std::string& root, std::string* report) {
  std::vector<std::string> skipped;
  const std::optional<std::string> found = newest_verified(root, skipped);
  if (!found && !skipped.empty())
    fail(
        "--resume: {} holds {} checkpoint{}, and none verifies:\n  {}\nNothing was changed. Restore a good copy of "
        "one of them; or, to start the run over, move them (and metrics.jsonl) away or set another save_dir, and "
        "run without --resume",
        root, skipped.size(), skipped.size() == 1 ? "" : "s", fmt::join(skipped, "\n  "));
  warn_skipped(skipped, found, report);
  return found;
}

std::string chosen_checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    fail(
        "--resume {}: no such checkpoint directory; give a checkpoint (ROOT/step-N) or a save_dir to take its "
        "newest",
        path);
  if (fs::exists(fs::path(path) / kManifestFile, ec)) {
    verify_checkpoint(path);
    return path;
  }
  if (list_step_dirs(path).empty())
    fail(
        "--resume {}: the folder holds neither a checkpoint ({}) nor checkpoints (step-N); give a checkpoint "
        "directory or a save_dir",
        path, kManifestFile);
  return *checkpoint_to_resume(path);  // a root: its newest that verifies (or it fails)
}

void load_checkpoint(const std::string& dir, TrainerState& state, const FluxConfig& cfg, ParamStore& store,
                     const Tensor& adam_m, const Tensor& adam_v, Fp8MetaRegistry* fp8, std::string* fp8_note,
                     CheckpointVerify verify, Backend* moments_backend, std::optional<FlatRange> moments_range) {
  const FlatRange range = moments_range.value_or(FlatRange{0, store.layout().total()});
  if (range.begin < 0 || range.end() > store.layout().total())
    fail("load_checkpoint: the moments' range [{}, {}) is outside the {} parameters", range.begin, range.end(),
         store.layout().total());
  check_moments(store, adam_m, adam_v, "load_checkpoint", range.count);
  verify_checkpoint(dir, verify == CheckpointVerify::digests);
  const std::string state_path = (fs::path(dir) / kStateFile).string();
  TrainerState loaded = trainer_state_from_json(read_text_or_fail(state_path, "trainer state"), state_path);
  const Manifest m = read_manifest(dir);
  if (loaded.step != m.step)
    fail("checkpoint {}: {} says step {}, {} says step {}", dir, kStateFile, loaded.step, kManifestFile, m.step);
  load_weights(store, cfg, (fs::path(dir) / kModelFile).string());
  load_optimizer((fs::path(dir) / kOptimizerFile).string(), store, adam_m, adam_v,
                 moments_backend ? *moments_backend : store.backend(), range);
  const bool has_fp8 = m.files.count(kFp8File) != 0;
  std::string note;
  if (fp8 && has_fp8)
    note = load_fp8_state(*fp8, (fs::path(dir) / kFp8File).string());
  else if (fp8)
    note = "the checkpoint has no FP8 state (a BF16 run): FP8 scales start at 1 with empty amax histories";
  else if (has_fp8)
    note = "the checkpoint's FP8 state is ignored: this run trains in BF16";
  if (fp8_note) *fp8_note = note;
  state = std::move(loaded);
}

namespace {

// Fails unless the file `name` of checkpoint `dir` matches its manifest (size and digests).
void verify_checkpoint_file(const std::string& dir, const std::string& name) {
  const Manifest m = [&] {
    try {
      return read_manifest(dir);
    } catch (const Error& e) {
      fail("checkpoint {}: {}", dir, e.what());
    }
  }();
  const auto rec = m.files.find(name);
  if (rec == m.files.end()) fail("checkpoint {}: {} does not list {}", dir, kManifestFile, name);
  std::string problem = check_file_size(dir, name, rec->second);
  if (problem.empty()) problem = check_digests(dir, m, name.c_str());
  if (!problem.empty()) fail("checkpoint {}: {}; it cannot be used", dir, problem);
}

}  // namespace

std::string resolve_weights_path(const std::string& path_or_dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(path_or_dir, ec);
  if (fs::is_regular_file(st)) {
    // A file inside a checkpoint directory (step-N/model.safetensors, or a link to it) is
    // checked against that checkpoint's manifest, as the directory would be; any other
    // weights file is taken as it is.
    const fs::path real = fs::canonical(path_or_dir, ec);
    if (!ec && fs::exists(real.parent_path() / kManifestFile))
      verify_checkpoint_file(real.parent_path().string(), real.filename().string());
    return path_or_dir;
  }
  if (!fs::is_directory(st))
    fail(
        "--init-from '{}': no such file or directory; give a .safetensors weights file or a "
        "checkpoint directory (ROOT/step-N)",
        path_or_dir);
  const fs::path dir(path_or_dir);
  if (fs::exists(dir / kManifestFile)) {
    verify_checkpoint_file(path_or_dir, kModelFile);
    return (dir / kModelFile).string();
  }
  if (fs::exists(dir / kModelFile)) return (dir / kModelFile).string();
  if (is_diffusers_folder(path_or_dir)) return path_or_dir;  // read by WeightSource
  const std::vector<StepDir> steps = list_step_dirs(path_or_dir);
  if (!steps.empty())
    fail(
        "--init-from '{}' is a checkpoint root, not a checkpoint; name one of its checkpoints, "
        "e.g. '{}'",
        path_or_dir, steps.front().path);
  fail(
      "--init-from '{}' is a directory without {} or {}, and not a diffusers folder (no "
      "diffusion_pytorch_model.safetensors[.index.json], nor in transformer/); give a .safetensors weights file, a "
      "diffusers folder or a checkpoint directory (ROOT/step-N)",
      path_or_dir, kManifestFile, kModelFile);
}

}  // namespace flux8
