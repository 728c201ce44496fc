#pragma once
// Parameters live in one flat buffer (and gradients in a second one of the same layout);
// each tensor is a view with its Black Forest Labs Flux.1 state-dict name and shape, so
// checkpoints are the reference format. The layout is a pure function of the config (and of
// the tensor-parallel rank and size: a rank holds its shard of each split tensor, under the
// reference name, model/param_shard.h), which lets `flux8 info` count a 12B model without
// allocating it.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "backend/communicator.h"
#include "core/tensor.h"
#include "model/flux_config.h"
#include "model/param_shard.h"

namespace flux8 {

enum class ParamInit : uint8_t { xavier_uniform, normal_002, zeros, ones };

struct ParamInfo {
  std::string name;    // reference name, e.g. "double_blocks.0.img_attn.qkv.weight"
  Shape shape;         // this rank's tensor (the full one unless shard.sharded())
  int64_t offset = 0;  // elements from the start of the flat buffer
  ParamInit init = ParamInit::zeros;
  std::string component;       // "img_in", "double_blocks", ... (for per-component counts)
  bool block_linear = false;   // a weight of a double/single block Linear (the FP8 candidates)
  bool linear_weight = false;  // the weight of any Linear (add_linear)
  // The weight of a Linear that sees one row per sample (the modulation Linears, the embedders'
  // MLPs): its gradient has the rank of a step's samples (ParamStore::keep_low_rank_grads).
  bool per_sample = false;
  bool linear_bias = false;  // the bias of a Linear (add_linear)
  // How this tensor maps onto the reference tensor under tensor parallelism. The split is
  // described at every size (a tensor-parallel size of 1 holds the whole tensor).
  ParamShard shard;
};

// How a Linear's weight (and bias) split over a tensor-parallel group.
//   column: the output features split (weight rows and bias), in `segments` of the output
//     (fused [q | k | v] or [q | k | v | mlp]: each segment split evenly).
//   row: the input features split (weight columns, in `segments` of the input); the bias is
//     replicated and added once: by rank 0's GEMM, before the all-reduce that sums the partial
//     outputs (LinearSite::bias_in_forward). Its gradient is the column sum of the output
//     gradient, which is replicated, so every rank computes the whole bias gradient.
enum class LinearParallel : uint8_t { replicated, column, row };

class ParamLayout {
 public:
  // The whole model: one rank, every tensor whole.
  static ParamLayout build(const FluxConfig& cfg) { return build(cfg, 0, 1); }
  // Rank tp_rank's shard of a model split over tp_size tensor-parallel ranks (model/
  // tensor_parallel.h): fails naming the model when its heads or MLP width do not split.
  static ParamLayout build(const FluxConfig& cfg, int tp_rank, int tp_size);

  const std::vector<ParamInfo>& params() const { return params_; }
  int64_t total() const { return total_; }
  const ParamInfo* find(std::string_view name) const;
  const ParamInfo& at(std::string_view name) const;  // fails naming the tensor

 private:
  // `shard` describes the full tensor (its shape `full`, the split and the segments); add()
  // places this rank's shard of it.
  void add(std::string name, ParamShard shard, ParamInit init, std::string component, bool block_linear = false,
           bool linear_weight = false, bool per_sample = false);
  void add_linear(const std::string& prefix, int64_t out, int64_t in, ParamInit init, const std::string& component,
                  bool bias, bool block_linear = false, bool per_sample = false,
                  LinearParallel parallel = LinearParallel::replicated, std::vector<int64_t> segments = {});
  ParamShard replicated(Shape full) const { return ParamShard{ShardSplit::replicated, full, {}, rank_, size_}; }
  int rank_ = 0, size_ = 1;
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, size_t> index_;
  int64_t total_ = 0;
};

// Master weights sharded over a data-parallel group (use_distributed_optimizer): rank r of
// `group` holds the masters of the flat range [begins[r], begins[r + 1]) — its optimizer's owned
// range (train/data_parallel.h FlatSharding: one contiguous range a rank).
struct MasterShards {
  Communicator* group = nullptr;  // null: every rank holds all the masters
  std::vector<int64_t> begins;    // group->size() + 1 entries, from 0 to the layout's total
};

// Owns the flat parameter and gradient buffers on a backend.
//
// Offloaded master weights (optimizer_offload: cpu): the flat parameter buffer — the f32 master
// weights — lives on `masters`, a host backend, while the gradients and everything the model reads
// stay on `backend`. The model then reads only device forms of the parameters: the operand copies
// (bf16 Linear weights and biases), f32 residents of the small parameters (norm scales, biases,
// and Linear weights where the backend has no operand type), and the FP8 sites' casts, made from
// masters staged through the device one tensor at a time (master_on_device). param() and
// flat_params() still return views of the masters, for the optimizer, checkpoints and as keys
// for operand(). refresh_device_forms() rebuilds the forms after anything but the optimizer
// wrote the masters (init, loading); the optimizer writes them with the weights.
class ParamStore {
 public:
  // tp_rank, tp_size: this rank's shard of a tensor-parallel model (ParamLayout::build).
  // masters: the backend holding the master weights (null: `backend`).
  // shards: the masters sharded over a data-parallel group (not with `masters`).
  ParamStore(const FluxConfig& cfg, Backend& backend, DType dtype, int tp_rank = 0, int tp_size = 1,
             Backend* masters = nullptr, MasterShards shards = {});
  ~ParamStore();
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  const ParamLayout& layout() const { return layout_; }
  DType dtype() const { return dtype_; }
  // The gradients' element type: dtype(), or bf16 where the backend stores them so
  // (Backend::gradient_dtype, grad_precision: bf16).
  DType grad_dtype() const { return grad_dtype_; }
  Backend& backend() const { return backend_; }
  // Where param() and flat_params() live: backend(), or the host backend of offloaded masters.
  Backend& masters_backend() const { return masters_; }
  bool masters_offloaded() const { return &masters_ != &backend_; }
  bool masters_sharded() const { return shards_.group != nullptr; }
  // Whether the model reads device forms of the parameters (offloaded or sharded masters).
  bool device_forms() const { return masters_offloaded() || masters_sharded(); }
  // The flat range [held_begin(), held_begin() + held_count()) whose masters this rank holds (all
  // of it unless sharded), and those masters on masters_backend().
  int64_t held_begin() const { return held_begin_; }
  int64_t held_count() const { return held_count_; }
  Tensor held_masters() const;
  // The elements [first, first + view.numel()) of parameter p (its flat elements) this rank
  // holds, as a 1-D view of their masters; an empty view when it holds none of p.
  struct HeldPart {
    Tensor view;
    int64_t first = 0;
  };
  HeldPart held_part(const ParamInfo& p) const;
  // Sharded: the elements of one window of refresh_device_forms' gather (a window of one
  // parameter larger than this is that parameter): a bounded backend buffer, and few
  // collectives a step.
  static constexpr int64_t kFormsWindowElements = int64_t{1} << 24;
  Tensor param(std::string_view name) const;
  Tensor grad(std::string_view name) const;
  Tensor flat_params() const;  // [total]
  Tensor flat_grads() const;

  // MLPerf-reference initialisation (docs/FLUX.md), from the counter-based RNG: the same
  // seed gives the same weights on every backend and thread count — and at every
  // tensor-parallel size: each element is drawn at its index in the full reference tensor.
  void init(uint64_t seed);

  // The gradients of one optimizer step. zero_grads() does not fill the gradient buffer (a
  // pass over 4 bytes a parameter): it marks every
  // gradient unwritten, and each gradient's first writer of the step overwrites it (a GEMM
  // with beta = 0, column sums that set) where later writers — micro-batches — add.
  //   first_write(g): true for the first writer of parameter gradient g (a whole parameter's
  //     view from grad()) since zero_grads(), which must then overwrite all of g; false after.
  //   zero_if_unwritten(g): for an op that can only add (small gradients: QK-norm scales):
  //     zero-fills g if nothing wrote it yet.
  //   finish_grads(): at the end of a backward; fails naming any parameter whose gradient no
  //     writer claimed (its values would be stale: an internal error, never a silent one).
  void zero_grads();
  bool first_write(const Tensor& grad);
  void zero_if_unwritten(const Tensor& grad);
  void finish_grads();

  // Low-rank gradients. A per-sample Linear's weight gradient (ParamInfo::per_sample) is
  // Σ_r dy_r ⊗ x_r over the few rows a step gives it: on W2 (2 samples) the per-sample Linears
  // hold 30% of the parameters, and writing their gradients, reading them for the norm and
  // again in AdamW costs bandwidth for what 2 rows of dy and x say. keep_low_rank_grads(rows),
  // `rows` a step's samples (all micro-batches), keeps those gradients as their factors — dy's
  // and x's rows in f32 (Backend::LowRankGrad) — when rows <= kLowRankMaxRows and returns
  // whether it did; 0 turns it off. (AdamW rebuilds each element from `rows` products: at 2
  // rows it breaks even with reading the gradient — the gain is the wgrad GEMM's write and the
  // norm's read — and beyond a few rows it would lose; 8 is a bound, not a measured optimum.) The flat buffer then does
  // not hold those gradients:
  //   add_low_rank_grad(dw, dy, x, first): for the backward of a Linear with weight gradient
  //     dw, input x [N, K] and output gradient dy [N, M] (any ld); `first`: this is the step's
  //     first write of dw (the caller's first_write answer, which it also uses for the bias).
  //     When dw is kept low-rank it appends the N rows to its factors (replacing them at the
  //     first write) and returns true: the caller writes no dw. Otherwise false — also when the
  //     step brings more rows than kept: the factors so far are then written into dw and the
  //     step goes on dense (at the first write, with nothing to write, dw is the caller's).
  //   low_rank_grads(): this step's, for the gradient norm and AdamW.
  //   materialize_low_rank_grads(): writes them into the flat buffer (for readers of grad(),
  //     such as the non-finite gradient search); low_rank_grads() is empty after it this step.
  //   flush_low_rank_copies(): add_low_rank_grad only queues its copies of dy's and x's rows;
  //     this issues the queue as one Backend::copy_batch (two launches a Linear cost more than
  //     their few rows). Whoever passed dy and x flushes before those rows change or their
  //     memory is reused — the blocks at the end of their backward, each embedder after its
  //     own. The store flushes before it reads the factors (low_rank_grads, materialize, a step
  //     going dense) and in finish_grads; zero_grads drops what an abandoned step left queued.
  static constexpr int64_t kLowRankMaxRows = 8;
  bool keep_low_rank_grads(int64_t rows);
  int64_t low_rank_rows() const;  // the rows kept, 0 when off
  bool add_low_rank_grad(const Tensor& dw, const Tensor& dy, const Tensor& x, bool first);
  std::vector<Backend::LowRankGrad> low_rank_grads();
  void materialize_low_rank_grads();
  void flush_low_rank_copies();

  // Weight operands. Where the backend runs a Linear's GEMMs on operands of another type than
  // the parameters (Backend::weight_operand_dtype: bf16 on the CUDA backend), the Linear would
  // round its f32 weight in every call — forward and dgrad, two passes of 6 bytes a parameter
  // a step. use_operand_copies(names) keeps a rounded copy of those
  // weights instead; operand(w) returns it, made again on first use after params_changed() —
  // which whatever else writes parameters calls (init, load_weights) — or w itself for a
  // weight without a copy (FP8 sites, the CPU backend). The optimizer writes the copies itself
  // as it writes the weights (Backend::adamw's ParamCopy list: operand_copies()) and then calls
  // params_updated(), which marks them current where params_changed() marks them stale.
  void use_operand_copies(const std::vector<std::string>& names);
  Tensor operand(const Tensor& w);
  // A Linear's bias `b` as its GEMM's epilogue takes it for the output `out`: operand(b) where
  // the store keeps a copy of b in out's type (a bf16 output's epilogue adds a bf16 bias, which
  // the GEMM would otherwise round from b on every call), else b itself.
  Tensor bias_operand(const Tensor& b, const Tensor& out);
  // The tensor an op reads for a parameter it takes as it is stored (a norm scale): param(name),
  // or with offloaded or sharded masters its f32 resident, kept current by refresh_device_forms()
  // and the optimizer (the tensor stays the same, so a block may bind it once).
  Tensor device_param(std::string_view name);
  // `w`'s current values on the backend, for an op that reads the master itself (an FP8 cast):
  // w, or with offloaded masters its resident or a copy staged in a buffer of the store's —
  // valid until the next call. Sharded masters without a resident are gathered into that buffer
  // from their holders: a collective of the group.
  Tensor master_on_device(const Tensor& w);
  // Offloaded or sharded masters: after params_changed(), rebuilds every device form from the
  // masters (a no-op when current, and without forms). Sharded, a collective of the group: the
  // optimizer refreshes them with its update, so that a forward one rank runs alone (rank 0's
  // sample previews) finds them current (device_forms_current()).
  void refresh_device_forms();
  bool device_forms_current() const { return !device_forms() || forms_version_ == params_version_; }
  // Sharded masters: forms the store does not make itself — the FP8 weights' casts — written by
  // refresh_device_forms from the gathered masters of each listed parameter (`offsets` in the
  // flat buffer) in the window that holds them, so that a master is gathered once a step.
  // `write(offset, value)`: value is the parameter's masters on the backend, valid for the call.
  struct CastForms {
    std::vector<int64_t> offsets;
    std::function<void(int64_t offset, const Tensor& value)> write;
  };
  void set_cast_forms(CastForms forms);
  // Sharded masters: the cast forms alone made again from gathered masters (a collective of the
  // group), for a step whose masters did not change but whose FP8 scales did.
  void rewrite_cast_forms();
  // Offloaded masters: the residents of the parameters inside the `count` elements of the flat
  // buffer from `begin`, as copies from `chunk_on_device` (those masters on the backend), for the
  // optimizer to issue after updating them. A parameter must lie wholly inside or outside.
  std::vector<Backend::CopyPair> resident_copies(int64_t begin, int64_t count, const Tensor& chunk_on_device) const;
  void params_changed() { ++params_version_; }
  std::vector<Backend::ParamCopy> operand_copies() const;
  void params_updated();
  // The offset in the flat buffer of `w`, a whole parameter's view from param(); fails otherwise.
  int64_t offset_of(const Tensor& w) const;
  size_t operand_copy_bytes() const { return operand_bytes_; }

 private:
  // The layout index of `view` if it is a whole parameter's view into `buffer` (params_ or
  // grads_), else kNoParam.
  static constexpr size_t kNoParam = static_cast<size_t>(-1);
  // The bytes a view of `bytes` takes in a buffer of views that each start 256-byte aligned.
  static size_t padded_bytes(size_t bytes) { return (bytes + 255) / 256 * 256; }
  size_t index_in(const void* buffer, const Tensor& view) const;

  ParamLayout layout_;
  Backend& backend_;
  Backend& masters_;
  DType dtype_, grad_dtype_;
  void* params_ = nullptr;
  void* grads_ = nullptr;
  std::unordered_map<int64_t, size_t> by_offset_;  // a parameter's offset -> its index
  std::vector<uint8_t> written_;                   // per parameter, since zero_grads()
  // Weight operand copies: per parameter, its copy (undefined: none) and the params_version_
  // it was made at.
  struct OperandCopy {
    Tensor copy;
    int64_t version = -1;
  };
  std::vector<OperandCopy> operands_;
  // The copy kept of parameter view p (null: none), and that copy made current (after
  // params_changed()) — what operand() and bias_operand() share, with one lookup a call.
  OperandCopy* operand_copy_of(const Tensor& p);
  Tensor current(OperandCopy& c, const Tensor& p);
  // Per parameter: its low-rank factors a [capacity, M] and b [capacity, K] (undefined: kept
  // dense), the rows of this step in them, and whether this step went dense after all.
  struct LowRank {
    Tensor a, b;
    int64_t rows = 0;
    bool dense = false;
  };
  std::vector<LowRank> low_rank_;
  void* low_rank_buffer_ = nullptr;
  std::vector<Backend::CopyPair> pending_copies_;  // add_low_rank_grad's, not yet issued
  // Writes parameter i's factors into its gradient (overwriting it) and marks it dense.
  void write_low_rank(size_t i);
  void* operand_buffer_ = nullptr;
  size_t operand_bytes_ = 0;
  int64_t params_version_ = 0;
  // Offloaded masters (params_offload.cpp): per parameter, its f32 resident on the backend
  // (undefined: none), their buffer, the params_version_ the device forms were made at, and the
  // staging buffer of master_on_device.
  std::vector<Tensor> residents_;
  std::vector<void*> resident_buffers_;
  bool masters_pinned_ = false;  // registered with the backend (Device::register_host_memory)
  int64_t forms_version_ = -1;
  Tensor staging_;
  // Sharded masters (params_shards.cpp): the group, this rank's range, its masters, and the
  // parameters of each window of the forms' gather with its flat range.
  MasterShards shards_;
  int64_t held_begin_ = 0, held_count_ = 0;
  void* held_ = nullptr;
  Tensor window_;  // refresh_device_forms' gather of a window of parameters
  CastForms cast_forms_;
  std::vector<uint8_t> has_cast_;  // per parameter: listed in cast_forms_
  void shard_masters(MasterShards shards);
  void release_masters();
  // The masters of the flat range [begin, begin + count) from their holders into `out` (on the
  // backend, count elements): a collective of the group.
  void gather_masters(int64_t begin, int64_t count, const Tensor& out);
  // casts_only: the cast forms alone (rewrite_cast_forms).
  void refresh_sharded_forms(bool casts_only = false);
  void allocate_residents(const std::vector<size_t>& which);
  Tensor stage(const ParamInfo& p);
  Tensor staging_for(int64_t elements);  // the staging buffer, of at least `elements`
  // operand() (out: none) and bias_operand() (out: the output's type) with offloaded masters.
  Tensor offloaded_operand(const Tensor& p, std::optional<DType> out);
};

}  // namespace flux8
