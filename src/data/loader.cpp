#include "data/loader.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <utility>

#include "core/error.h"
#include "core/rng.h"
#include "data/webdataset.h"

namespace flux8 {
namespace fs = std::filesystem;
namespace {

constexpr size_t kDecodeRun = 8;  // samples read ahead and decoded side by side

// LoaderOptions::decode_threads, 0 resolved: a quarter of the cores, at most 4, at least 1.
int decode_threads(const LoaderOptions& o) {
  if (o.decode_threads > 0) return o.decode_threads;
  return static_cast<int>(std::clamp<unsigned>(std::thread::hardware_concurrency() / 4, 1u, 4u));
}

constexpr uint64_t kShardOrderPurpose = 0x7368617264736571ull;     // "shardseq"
constexpr uint64_t kShuffleBufferPurpose = 0x73687566666c6562ull;  // "shuffleb"

// Uniform integer in [0, n) from draw `index` of `stream`: one 32-bit Philox word scaled by n
// (bias below n / 2^32, irrelevant for buffer and shard counts).
uint64_t draw_below(uint64_t seed, uint64_t stream, uint64_t index, uint64_t n) {
  uint32_t w[4];
  Philox::generate(seed, stream, index >> 2, w);
  return (static_cast<uint64_t>(w[index & 3]) * n) >> 32;
}

bool is_regular(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const size_t e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

}  // namespace

std::vector<std::string> resolve_shards(const std::string& source) {
  if (source.empty()) fail("data source is empty; give a glob (data/train-*.tar), a directory or a list file");
  std::vector<std::string> out;
  std::error_code ec;
  if (fs::is_directory(source, ec)) {
    for (const auto& e : fs::directory_iterator(source, ec))
      if (e.path().extension() == ".tar" && is_regular(e.path())) out.push_back(e.path().string());
    if (ec) fail("data source {}: cannot list the directory: {}", source, ec.message());
  } else if (source.find_first_of("*?[") != std::string::npos) {
    glob_t g{};
    const int rc = ::glob(source.c_str(), 0, nullptr, &g);
    if (rc != 0 && rc != GLOB_NOMATCH) {
      ::globfree(&g);
      fail("data source {}: glob failed (code {})", source, rc);
    }
    for (size_t i = 0; i < g.gl_pathc; ++i)
      if (is_regular(g.gl_pathv[i])) out.push_back(g.gl_pathv[i]);
    ::globfree(&g);
  } else if (is_regular(source) && fs::path(source).extension() == ".tar") {
    out.push_back(source);
  } else if (is_regular(source)) {
    std::ifstream in(source);
    if (!in) fail("data source {}: cannot read the list file", source);
    const fs::path base = fs::path(source).parent_path();
    std::string line;
    for (int n = 1; std::getline(in, line); ++n) {
      line = trim(line);
      if (line.empty() || line[0] == '#') continue;
      const fs::path p = fs::path(line).is_absolute() ? fs::path(line) : base / line;
      if (!is_regular(p))
        fail(
            "data source {}, line {}: shard {} does not exist (paths are relative to the list "
            "file)",
            source, n, p.string());
      out.push_back(p.string());
    }
  } else {
    fail(
        "data source {} does not exist (expected a glob pattern, a directory of .tar shards, a "
        ".tar file or a list file)",
        source);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.empty()) fail("data source {} names no .tar shards", source);
  return out;
}

std::vector<std::string> epoch_shards(const std::vector<std::string>& sorted_shards, uint64_t seed, uint64_t epoch,
                                      int rank, int world, bool shuffle) {
  if (world < 1 || rank < 0 || rank >= world)
    fail("data loader: rank {} of world {} is not a valid data-parallel position", rank, world);
  if (sorted_shards.size() < static_cast<size_t>(world))
    fail(
        "data loader: {} shards for {} data-parallel ranks; every rank needs at least one shard "
        "(split the data into more shards or use fewer ranks)",
        sorted_shards.size(), world);
  std::vector<size_t> order(sorted_shards.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  if (shuffle) {
    const uint64_t stream = rng_stream(kShardOrderPurpose, epoch);
    uint64_t d = 0;
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[draw_below(seed, stream, d++, i)]);
  }
  std::vector<std::string> out;
  for (size_t i = static_cast<size_t>(rank); i < order.size(); i += static_cast<size_t>(world))
    out.push_back(sorted_shards[order[i]]);
  return out;
}

// ---------------------------------------------------------------------------------------------

DataLoader::DataLoader(const LoaderOptions& options, const LoaderState& start_state) : options_(options) {
  if (options_.prefetch < 1) options_.prefetch = 1;
  shards_ = resolve_shards(options_.source);
  epoch_shards(shards_, options_.seed, 0, options_.rank, options_.world, false);  // validates
  if (options_.single_pass && start_state.epoch != 0)
    fail("data loader: single-pass loader cannot start at epoch {}", start_state.epoch);
  start(start_state);
}

DataLoader::~DataLoader() { stop(); }

void DataLoader::start(const LoaderState& s) {
  state_ = s;
  stop_ = done_ = false;
  error_ = nullptr;
  queue_.clear();
  thread_ = std::thread([this, s] { produce(s); });
}

void DataLoader::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  not_full_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DataLoader::reset(const LoaderState& s) {
  if (options_.single_pass && s.epoch != 0) fail("data loader: single-pass loader cannot start at epoch {}", s.epoch);
  stop();
  start(s);
}

bool DataLoader::push(Item item) {
  std::unique_lock<std::mutex> lk(mu_);
  not_full_.wait(lk, [&] { return stop_ || queue_.size() < options_.prefetch; });
  if (stop_) return false;
  queue_.push_back(std::move(item));
  lk.unlock();
  not_empty_.notify_one();
  return true;
}

bool DataLoader::next(Sample& out) {
  std::unique_lock<std::mutex> lk(mu_);
  not_empty_.wait(lk, [&] { return !queue_.empty() || done_ || error_; });
  if (queue_.empty()) {
    if (error_) std::rethrow_exception(error_);
    return false;  // end of a single pass
  }
  Item item = std::move(queue_.front());
  queue_.pop_front();
  lk.unlock();
  not_full_.notify_one();
  state_ = {item.epoch, item.index + 1};
  out = std::move(item.sample);
  return true;
}

Sample DataLoader::next() {
  Sample s;
  if (!next(s))
    fail(
        "data loader: the single pass over {} is complete ({} samples); check next(Sample&) "
        "for the end",
        options_.source, state_.consumed);
  return s;
}

void DataLoader::skip_corrupt_warning(const std::string& what, const std::string& skipped) {
  corrupt_skipped_.fetch_add(1);
  fmt::print(stderr, "flux8: warning: {} -- skipping {} (data_skip_corrupt)\n", what, skipped);
}

void DataLoader::produce(LoaderState s) {
  try {
    uint64_t epoch = s.epoch, skip = s.consumed;
    for (;;) {
      if (!run_epoch(epoch, skip)) return;  // stopped
      if (options_.single_pass) break;
      ++epoch;
      skip = 0;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_ = true;
    }
  } catch (const Error& e) {  // a shard or sample that cannot be read: a data error (its exit status)
    std::lock_guard<std::mutex> lk(mu_);
    error_ = e.kind() == ErrorKind::general ? std::make_exception_ptr(Error(e.what(), ErrorKind::data))
                                            : std::current_exception();
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    error_ = std::current_exception();
  }
  not_empty_.notify_all();
}

// A buffered sample: decoded, or (while replaying up to a resume point) only located, or (with
// skip_corrupt) one that failed to decode, which keeps its place in the order and is skipped
// when it leaves the buffer. So the emit indices, and with them a resume point, are the same
// whether a sample was decoded or replayed unread.
struct DataLoader::Entry {
  Sample sample;
  RawSample located;
  bool lazy = false;
  std::string corrupt;       // the decode error skip_corrupt skips
  std::exception_ptr error;  // the decode error that stops the stream where the sample is
};

Sample DataLoader::decode(const RawSample& raw) const {
  const bool lazy = std::any_of(raw.members.begin(), raw.members.end(),
                                [](const SampleMember& m) { return m.fault.empty() && m.data.size() != m.size; });
  Sample s = lazy ? load_sample(raw) : decode_sample(raw);
  if (!options_.check) return s;
  try {
    options_.check(s);
  } catch (const Error& err) {
    std::vector<std::string> names;
    for (const SampleMember& m : raw.members) names.push_back(m.name);
    fail("shard {}, member {}: {}", raw.shard, fmt::join(names, " / "), err.what());
  }
  return s;
}

// Reads a run of samples of `reader` in order (up to `want`; all lazy while the resume point is
// ahead) and decodes them side by side. A read error after some samples is returned in
// `read_error`, and decode errors in their entries, to be raised where one at a time would
// have: after the samples before them are buffered. False at the end of the shard.
bool DataLoader::read_run(WebDatasetReader& reader, size_t want, bool lazy, std::vector<Entry>& run,
                          std::exception_ptr& read_error) {
  const int threads = decode_threads(options_);
  bool more = true;
  run.clear();
  while (run.size() < want) {
    Entry e;
    e.lazy = lazy;  // may still be dropped: read headers only
    try {
      if (!reader.next_raw(e.located, !e.lazy)) {
        more = false;
        break;
      }
    } catch (...) {
      read_error = std::current_exception();
      more = false;
      break;
    }
    run.push_back(std::move(e));
  }
  std::vector<std::exception_ptr> errors(run.size());
  const int64_t n = static_cast<int64_t>(run.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (n > 1)
  for (int64_t i = 0; i < n; ++i) {
    Entry& e = run[static_cast<size_t>(i)];
    if (e.lazy) continue;
    try {
      e.sample = decode(e.located);
      e.located = RawSample();
    } catch (...) {
      errors[static_cast<size_t>(i)] = std::current_exception();
    }
  }
  for (size_t i = 0; i < run.size(); ++i) {
    if (!errors[i]) continue;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const Error& err) {
      if (!options_.skip_corrupt) {
        run[i].error = errors[i];
        continue;
      }
      run[i].corrupt = err.what();
      run[i].located.members.clear();  // only its key and shard are needed now
    } catch (...) {
      run[i].error = errors[i];
    }
  }
  return more;
}

bool DataLoader::run_epoch(uint64_t epoch, uint64_t skip) {
  const bool shuffle = !options_.single_pass;
  const std::vector<std::string> shards =
      epoch_shards(shards_, options_.seed, epoch, options_.rank, options_.world, shuffle);
  const size_t slots = shuffle ? options_.shuffle_buffer : 0;
  const uint64_t stream = rng_stream(kShuffleBufferPurpose, epoch, static_cast<uint64_t>(options_.rank));

  std::vector<Entry> buffer;
  uint64_t draws = 0, emitted = 0, delivered = 0;

  const auto take_random = [&]() {
    const uint64_t j = draw_below(options_.seed, stream, draws++, buffer.size());
    std::swap(buffer[j], buffer.back());
    Entry e = std::move(buffer.back());
    buffer.pop_back();
    return e;
  };
  // Samples before the resume point were returned (or skipped) by the earlier run: drop them
  // unread.
  const auto emit = [&](Entry e) -> bool {
    const uint64_t index = emitted++;
    if (index < skip) return true;
    if (e.lazy) {
      try {
        e.sample = decode(e.located);
      } catch (const Error& err) {
        if (!options_.skip_corrupt) throw;
        e.corrupt = err.what();
      }
    }
    if (!e.corrupt.empty()) {
      skip_corrupt_warning(e.corrupt, fmt::format("sample '{}' of shard {}", e.located.key, e.located.shard));
      return true;
    }
    ++delivered;
    return push(Item{std::move(e.sample), epoch, index});
  };

  // Runs of samples read in order, decoded side by side, then buffered in order: the same
  // entries, emits and errors as one at a time. While the resume point is ahead (entries may be
  // lazy), one at a time.
  const size_t run_size = decode_threads(options_) > 1 ? kDecodeRun : 1;
  std::vector<Entry> run;
  for (const std::string& shard : shards) {
    try {
      WebDatasetReader reader(shard);
      for (bool more = true; more;) {
        {
          std::lock_guard<std::mutex> lk(mu_);
          if (stop_) return false;
        }
        std::exception_ptr read_error;  // raised after the samples read before it are buffered
        const bool lazy = emitted < skip;
        more = read_run(reader, lazy ? 1 : run_size, lazy, run, read_error);
        for (Entry& e : run) {
          if (e.error) std::rethrow_exception(e.error);  // the rest of the run is this shard's
          buffer.push_back(std::move(e));
          if (buffer.size() > slots && !emit(take_random())) return false;
        }
        if (read_error) std::rethrow_exception(read_error);
      }
    } catch (const Error& err) {
      // The tar framing is broken (or the shard cannot be opened): nothing after the fault can
      // be located, so the rest of the shard goes.
      if (!options_.skip_corrupt) throw;
      skip_corrupt_warning(err.what(), "the rest of shard " + shard);
    }
  }
  while (!buffer.empty())
    if (!emit(take_random())) return false;

  if (emitted < skip)
    fail(
        "data loader: resume state says {} samples were consumed in epoch {}, but rank {} of {} "
        "has only {} in that epoch (were the shards or the data-parallel size changed?)",
        skip, epoch, options_.rank, options_.world, emitted);
  if (delivered == 0 && skip == 0)
    fail("data loader: epoch {} has no samples for rank {} of {} (shards: {}){}", epoch, options_.rank, options_.world,
         fmt::join(shards, ", "), corrupt_skipped() > 0 ? "; every sample was skipped as corrupt" : "");
  return true;
}

}  // namespace flux8
