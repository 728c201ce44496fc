#pragma once
// Runs a training step's forward and backward as CUDA graphs (`cuda_graph: true`): an op
// interceptor (backend/ops.h) installed on the backend the model runs on.
//
// Why: a forward and backward is a few hundred op calls, many of them small (the per-sample
// Linears, the modulation chain, the norms of short sequences), and issuing one costs the host
// microseconds (a cuBLASLt call most), so the GPU waits for launches (`flux8 bench --profile`'s
// idle row; docs/PERFORMANCE.md). A graph launch issues tens of ops.
//
// How, without trusting the model code to repeat itself: between begin_region() and end_region()
// every op call is *recorded* — the op's struct kept (it owns its arguments) and written into a
// signature field by field, as the op declares them: every pointer, shape, stride, scalar and flag. Every `segment_ops`
// calls (and at the region's end, or where something must wait for the device) the segment is
// closed: a signature seen before with a graph is launched as that graph and the fresh record
// dropped; one seen once before is captured (run through the wrapped backend under stream
// capture), instantiated and launched; a new one runs eagerly. Nothing is assumed about the step
// but what its signature shows, so any divergence — a report step's statistics, another shape, a
// checkpoint restore — costs a capture, never a wrong result, and the host state the model code
// keeps (FP8 flags, gradient first-writes, low-rank rows) is what running that code left, as
// without graphs. Segments pipeline: the host records segment k + 1 while the device runs k.
//
// What a graph cannot hold, so the segment runs eagerly: an FP8 cast that counts telemetry
// (Quantize::stats: the counts reach the host through the backend's bookkeeping at issue time),
// a capture that fails (an op that synchronises or allocates: scratch that grows), and any call
// that needs the device's results or memory (download, synchronize, upload, release, the sums
// that return a value) — those close the segment first. A graph is dropped when the wrapped
// backend's capture_generation() moves (its scratch was reallocated).
//
// On a backend without graphs (the CPU) a segment's "graph" is its first record replayed: the
// recorded calls of an earlier step run instead of the fresh ones. That is the CPU twin the tests
// use: a replayed step that differed from an eager one would mean an argument the signature misses.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace flux8 {

class StepGraph final : public OpInterceptor {
 public:
  struct Options {
    int segment_ops = 48;        // op calls a segment (a graph) holds at most
    size_t max_segments = 4096;  // distinct signatures kept; beyond, all are dropped and relearnt
    // The defaults, segment_ops from FLUX8_GRAPH_SEGMENT_OPS where set (an empty value counts as
    // unset; anything but a count from 1 to 100000 is an error naming it).
    static Options from_environment();
  };
  // Installs itself as `be`'s op interceptor until destroyed.
  explicit StepGraph(Backend& be) : StepGraph(be, Options{}) {}
  StepGraph(Backend& be, Options options);
  ~StepGraph() override;
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  Backend& backend() { return be_; }
  const Options& graph_options() const { return options_; }
  // Record the op calls from here to end_region() (regions do not nest).
  void begin_region();
  // Closes the last segment (launching, capturing or running it); the work is queued, not done.
  void end_region();
  bool recording() const { return recording_; }
  // Leaves a region without issuing what it recorded and not yet issued (a step that threw).
  void abandon_region();

  // A region for a scope (null graph: nothing): end() closes it; a scope left by an exception
  // abandons it.
  class Region {
   public:
    explicit Region(StepGraph* g) : g_(g) {
      if (g_) g_->begin_region();
    }
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;
    ~Region() {
      if (g_) g_->abandon_region();
    }
    void end() {
      StepGraph* g = std::exchange(g_, nullptr);
      if (g) g->end_region();
    }

   private:
    StepGraph* g_;
  };

  struct Stats {
    int64_t launched = 0;        // segments launched as a graph (or, on the CPU, replayed)
    int64_t captured = 0;        // graphs captured
    int64_t eager = 0;           // segments run op by op (first sightings, uncapturable ones)
    int64_t capture_failed = 0;  // captures that failed (their signatures then stay eager)
    int64_t ops_launched = 0;    // op calls inside launched segments
    int64_t ops_eager = 0;       // op calls run one by one inside regions
  };
  const Stats& stats() const { return stats_; }
  void reset_stats() { stats_ = Stats{}; }
  // The reason of the last failed capture ("" if none failed).
  const std::string& last_capture_failure() const { return last_failure_; }

  // OpInterceptor: inside a region an op is recorded (one with a result, or one that waits for the
  // host, closes the segment and runs at once); outside, it runs at once. Every host access closes
  // the open segment first.
  double intercept(Ops& ops, AnyOp&& op) override;
  void host_access(HostAccess what, const std::function<void()>& access) override;

 private:
  void close_segment();  // issues the segment recorded so far, as a graph or op by op
  void run_eagerly(const std::vector<AnyOp>& calls);

  struct Entry {
    int seen = 0;                          // sightings (eager runs before the capture)
    bool capturable = true;                // false: stays eager (telemetry, a failed capture)
    std::unique_ptr<Device::Graph> graph;  // the captured graph (backends with graphs)
    uint64_t generation = 0;               // be_.capture_generation() at the capture
    std::vector<AnyOp> replay;             // backends without graphs: the first record, replayed
  };

  Backend& be_;
  Options options_;
  bool recording_ = false;
  std::string signature_;     // the open segment's calls, field by field (step_graph.cpp)
  bool capturable_ = true;    // false once a call asked for host bookkeeping a graph would skip
  std::vector<AnyOp> calls_;  // the open segment's calls
  std::unordered_map<std::string, Entry> entries_;
  Stats stats_;
  std::string last_failure_;
};

}  // namespace flux8
