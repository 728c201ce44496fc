#pragma once
// The training/validation data loader: WebDataset shards -> a deterministic stream of decoded
// samples, read ahead on a background thread.
//
// Order (a pure function of seed, epoch, rank and world; never of timing or thread count):
//   shards      sorted; per epoch permuted with Fisher-Yates driven by the counter RNG keyed by
//               (seed, epoch), the same permutation on every rank; rank r of W takes the
//               permuted shards i with i % W == r (fewer shards than ranks is an error)
//   samples     read in shard order, then through a shuffle buffer of `shuffle_buffer` slots:
//               each sample read past a full buffer swaps out a slot chosen by draw number d of
//               stream (seed, epoch, rank); at the end of the epoch the rest leaves the same way
//   epochs      repeat forever (the epoch counter advances), or one pass in `single_pass` mode
//               (validation: sorted shards, no shuffling, then next() returns false)
// Position: LoaderState {epoch, consumed}. A loader started from a state returns exactly the
// samples an uninterrupted run returns after that point. It gets there by replaying the epoch's
// shuffle on tar headers only: samples consumed before the state are never read or decoded;
// those still in the shuffle buffer at that point are read by random access when they leave.
//
// Decoding may run over several threads (decode_threads); the order, the errors and what
// skip_corrupt skips are the same as decoding one sample after another.
//
// Faults: without skip_corrupt, a shard that cannot be read or a sample that fails to decode is
// an Error naming shard and member, raised by next() after the samples read before it; the
// stream stops there. With skip_corrupt (the config's data_skip_corrupt) each fault is a line on
// stderr naming shard and member, counted in corrupt_skipped() when the reader thread meets it
// (it reads ahead of next()), and the stream goes on:
//   - a sample that fails to decode (its json, an .npy or raw member, a safetensors member, a
//     member whose pax or long-name header is malformed) or that `check` refuses (shapes that do
//     not fit the model) is skipped alone: it keeps its place
//     in the shuffle order, so a resumed run skips the same sample at the same position;
//   - a fault in the tar framing (a header failing its checksum, a size that is not a number or
//     runs past the end of the file, a truncated file) leaves no position to read on from: the
//     rest of that shard is skipped, with the sample whose members were being gathered. The
//     number of samples lost is not known; it counts as one skip.
// An epoch in which every sample was skipped is an error: the run would otherwise train on nothing.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "data/sample.h"

namespace flux8 {

class WebDatasetReader;
struct RawSample;

struct LoaderOptions {
  std::string source;  // glob ("data/train-*.tar"), directory of .tar, a .tar, or a list
                       // file (one shard per line, relative to the list file; '#' comments)
  uint64_t seed = 0;
  int rank = 0;  // data-parallel rank and world size
  int world = 1;
  size_t shuffle_buffer = 1000;  // slots; 0 keeps the read order
  size_t prefetch = 16;          // decoded samples held ready (>= 1)
  bool single_pass = false;      // validation: one pass in sorted order, no shuffling
  bool skip_corrupt = false;
  // Threads that decode samples (npy headers, the copies into f32 tensors: for a W1 sample mostly
  // page faults of fresh buffers, docs/PERFORMANCE.md): runs of up to 8 samples of a shard are
  // read in order, decoded side by side, then taken in order as if one by one. 0 = a quarter
  // of the cores, at most 4 (1 on small machines, whose cores compute the step).
  int decode_threads = 0;
  // What the consumer needs of each sample (the model's shapes): throws an Error saying what does
  // not fit. A sample it refuses counts as one that fails to decode (skip_corrupt skips it, the
  // error names shard and members). Called on the decoding threads.
  std::function<void(const Sample&)> check;
};

struct LoaderState {
  uint64_t epoch = 0;
  uint64_t consumed = 0;  // samples next() returned in this epoch
  bool operator==(const LoaderState&) const = default;
};

// Shard paths from a source as described in LoaderOptions, sorted and without duplicates;
// fails when the source names nothing or no shards.
std::vector<std::string> resolve_shards(const std::string& source);
// The shards rank `rank` of `world` reads in `epoch`, in reading order.
std::vector<std::string> epoch_shards(const std::vector<std::string>& sorted_shards, uint64_t seed, uint64_t epoch,
                                      int rank, int world, bool shuffle);

class DataLoader {
 public:
  explicit DataLoader(const LoaderOptions& options, const LoaderState& start = {});
  ~DataLoader();  // stops and joins the reader thread, also while it waits on a full queue
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // The next sample; false only at the end of a single pass. Rethrows the reader's error.
  bool next(Sample& out);
  // The same, failing at the end of a single pass.
  Sample next();

  LoaderState state() const { return state_; }
  // Restarts the stream at `state` (stops the reader, drops what it read ahead).
  void reset(const LoaderState& state);

  uint64_t corrupt_skipped() const { return corrupt_skipped_.load(); }
  const std::vector<std::string>& shards() const { return shards_; }
  const LoaderOptions& options() const { return options_; }

 private:
  struct Item {
    Sample sample;
    uint64_t epoch = 0, index = 0;
  };
  struct Entry;  // a sample in the shuffle buffer
  void start(const LoaderState& state);
  void stop();
  void produce(LoaderState start);
  bool run_epoch(uint64_t epoch, uint64_t skip);  // false when stopped
  bool read_run(WebDatasetReader& reader, size_t want, bool lazy, std::vector<Entry>& run,
                std::exception_ptr& read_error);
  Sample decode(const RawSample& raw) const;  // decoded (or loaded, if header-only) and checked
  bool push(Item item);                       // false when stopped
  // Counts a skip and says on stderr what was wrong (naming shard and member) and what goes.
  void skip_corrupt_warning(const std::string& what, const std::string& skipped);

  LoaderOptions options_;
  std::vector<std::string> shards_;
  LoaderState state_;  // consumer side: position after the last sample returned

  std::mutex mu_;
  std::condition_variable not_full_, not_empty_;
  std::deque<Item> queue_;
  bool stop_ = false, done_ = false;
  std::exception_ptr error_;
  std::atomic<uint64_t> corrupt_skipped_{0};
  std::thread thread_;
};

}  // namespace flux8
