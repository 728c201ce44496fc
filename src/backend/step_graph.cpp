#include "backend/step_graph.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <tuple>
#include <type_traits>
#include <utility>

#include "core/error.h"

namespace flux8 {

namespace {

// ---- what goes into a signature: every field a recorded op could read, one by one, as the op and
// its argument structs declare them (never a struct's raw bytes, whose padding is not ours to
// compare) ----------------------------------------------------------------------------------------
class Signature {
 public:
  explicit Signature(std::string& bytes) : bytes_(bytes) {}
  // False once an argument asked for host-side bookkeeping a graph would skip.
  bool capturable = true;

  template <typename T>
  void raw(const T& v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  template <typename T>
  requires std::is_arithmetic_v<T> || std::is_enum_v<T> || std::is_pointer_v<T>
  void put(T v) { raw(v); }
  void put(const Shape& sh) {
    raw(sh.rank);
    for (int i = 0; i < sh.rank; ++i) raw(sh.d[static_cast<size_t>(i)]);
  }
  void put(const Tensor& t) {
    raw(t.data);
    raw(t.dtype);
    put(t.shape);
    raw(t.ld);
  }
  void put(const QTensor& q) {
    raw(q.codes);
    raw(q.rows);
    raw(q.cols);
    raw(q.format);
    raw(q.scaling);
    raw(q.scale_inv);
    raw(q.scale_e8m0);
  }
  void put(const QuantizeSpec& q) {
    put_fields(q);
    // The counts reach the host through the backend's bookkeeping when the cast is issued, which a
    // graph launch would skip.
    if (q.stats) capturable = false;
  }
  template <typename T>
  void put(const List<T>& items) {
    raw(items.size());
    for (const T& t : items) put(t);
  }
  // An argument struct or an op: field by field.
  template <typename S>
  requires requires(const S& s) { s.fields(); }
  void put(const S& s) { put_fields(s); }

 private:
  template <typename S>
  void put_fields(const S& s) {
    for_each_field(s, [&](std::string_view, const auto& field) { put(field); });
  }
  std::string& bytes_;
};

}  // namespace

StepGraph::Options StepGraph::Options::from_environment() {
  Options o;
  if (const char* e = std::getenv("FLUX8_GRAPH_SEGMENT_OPS"); e && *e) {
    char* end = nullptr;
    const long v = std::strtol(e, &end, 10);
    if (*end || v < 1 || v > 100000)
      fail("FLUX8_GRAPH_SEGMENT_OPS={}: expected the op calls a graph holds, 1 to 100000 (unset: {})", e,
           o.segment_ops);
    o.segment_ops = static_cast<int>(v);
  }
  return o;
}

StepGraph::StepGraph(Backend& be, Options options) : be_(be), options_(options) {
  if (options_.segment_ops < 1) fail("StepGraph: segment_ops must be at least 1, got {}", options_.segment_ops);
  be_.set_interceptor(this);
}

StepGraph::~StepGraph() {
  be_.set_interceptor(nullptr);
  try {
    be_.synchronize();  // no launched graph may still run when its executable is destroyed
  } catch (const std::exception&) {
    // A failing device is reported by whatever runs next; a destructor must not throw.
  }
  entries_.clear();
}

void StepGraph::begin_region() {
  if (recording_) fail("StepGraph: begin_region inside a region (regions do not nest)");
  recording_ = true;
}

void StepGraph::end_region() {
  if (!recording_) fail("StepGraph: end_region without begin_region");
  recording_ = false;  // first: should the segment throw, the wrapper is out of the region
  close_segment();
}

void StepGraph::abandon_region() {
  recording_ = false;
  calls_.clear();
  signature_.clear();
  capturable_ = true;
}

double StepGraph::intercept(Ops& ops, AnyOp&& op) {
  if (!recording_) return ops.execute_any(op);
  // An op whose result the host reads, or one that waits for the host itself, never sits in a graph.
  const bool at_once = std::visit(
      []<typename Op>(const Op&) {
        if constexpr (std::is_same_v<Op, std::monostate>)
          return true;
        else
          return !std::is_void_v<typename Op::result_type> || op::waits_for_host<Op>;
      },
      op);
  if (at_once) {
    close_segment();
    return ops.execute_any(op);
  }
  Signature sig(signature_);
  sig.put(static_cast<uint32_t>(op.index()));
  std::visit(
      [&]<typename Op>(const Op& o) {
        if constexpr (!std::is_same_v<Op, std::monostate>) sig.put(o);
      },
      op);
  if (!sig.capturable) capturable_ = false;
  calls_.push_back(std::move(op));
  if (static_cast<int>(calls_.size()) >= options_.segment_ops) close_segment();
  return 0.0;
}

void StepGraph::host_access(HostAccess, const std::function<void()>& access) {
  if (recording_) close_segment();
  access();
}

void StepGraph::run_eagerly(const std::vector<AnyOp>& calls) {
  for (const AnyOp& c : calls) be_.execute_any(c);
  ++stats_.eager;
  stats_.ops_eager += static_cast<int64_t>(calls.size());
}

void StepGraph::close_segment() {
  std::vector<AnyOp> calls = std::exchange(calls_, {});
  std::string key = std::exchange(signature_, {});
  const bool capturable = std::exchange(capturable_, true);
  if (calls.empty()) return;
  if (!capturable) {
    run_eagerly(calls);
    return;
  }
  if (entries_.size() >= options_.max_segments && !entries_.contains(key)) {
    be_.synchronize();  // the graphs dropped may still be running
    entries_.clear();
  }
  Entry& e = entries_[std::move(key)];
  if (!e.capturable) {
    run_eagerly(calls);
    return;
  }
  const int64_t n = static_cast<int64_t>(calls.size());
  if (!be_.can_capture()) {  // the CPU twin: the first record stands for the graph
    if (e.replay.empty()) {
      run_eagerly(calls);
      e.replay = std::move(calls);
      return;
    }
    for (const AnyOp& c : e.replay) be_.execute_any(c);
    ++stats_.launched;
    stats_.ops_launched += n;
    return;
  }
  if (e.graph && e.generation != be_.capture_generation()) {  // its scratch has moved
    be_.synchronize();                                        // an earlier launch of it may still run
    e.graph.reset();
  }
  if (!e.graph) {
    if (e.seen++ == 0) {  // first sighting: run it, which also grows any scratch it needs
      run_eagerly(calls);
      return;
    }
    be_.begin_capture();
    std::unique_ptr<Device::Graph> g;
    size_t i = 0;
    try {
      for (; i < calls.size(); ++i) be_.execute_any(calls[i]);
      g = be_.end_capture();
      if (!g) last_failure_ = "the capture was invalidated (an op synchronised or allocated)";
    } catch (const std::exception& ex) {
      be_.end_capture();  // ends the capture the op broke off
      last_failure_ = fmt::format("{}: {}", op_name(calls[i]), ex.what());
    }
    if (!g) {
      if (stats_.capture_failed++ == 0)
        fmt::print(stderr, "flux8: cuda_graph: a segment of {} ops could not be captured ({}); it runs op by op\n", n,
                   last_failure_);
      e.capturable = false;
      run_eagerly(calls);  // nothing of the failed capture ran
      return;
    }
    e.graph = std::move(g);
    e.generation = be_.capture_generation();
    ++stats_.captured;
  }
  be_.launch_graph(*e.graph);
  ++stats_.launched;
  stats_.ops_launched += n;
}

}  // namespace flux8
