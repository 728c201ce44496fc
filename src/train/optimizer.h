#pragma once
// AdamW over the flat parameter buffer, with global-norm gradient clipping. The moments are
// two more flat buffers laid out like the parameters (on the CPU backend the f32 parameters
// are themselves the master weights), in the parameters' type or, with adam_moment_precision
// bf16, in bf16 (stochastically rounded: Backend::AdamW).
#include <array>
#include <memory>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "model/params.h"
#include "train/data_parallel.h"
#include "train/schedule.h"

namespace flux8 {

class Config;

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double clip_grad = 1.0;  // 0 = no clipping
  // Storage of the moments: the parameters' type (f32), or bf16 (f32 parameters only):
  // adam_moment_precision.
  DType moment_dtype = DType::f32;
  // optimizer_offload: moments or cpu — the moments live in host memory and stream through the
  // backend a chunk at a time for the update (AdamWOptimizer::step): the device holds one chunk of
  // each. cpu also keeps the f32 master weights in host memory (offload_masters: the model's
  // ParamStore holds them there, model/params.h), streamed with the moments.
  bool offload = false;
  bool offload_masters = false;
  // Elements of a chunk (a chunk of whole parameters is at least the largest parameter).
  int64_t offload_chunk = int64_t{1} << 26;
  // optimizer_offload_update: host (with offload_masters) — AdamW runs on the host's cores where
  // the masters and moments live: each chunk's gradients come down, its new masters go up and the
  // device writes the forms the model reads from them, instead of the moments and masters making
  // the round trip through the device.
  bool host_update = false;
  // optimizer_offload_overlap: the device update's chunks through two device slots, transfers and
  // updates at once (AdamWOptimizer::update_overlapped).
  bool overlap = false;
  static AdamWConfig from_config(const Config& cfg);
};

struct StepStats {
  double grad_norm = 0;  // before clipping
  double lr = 0;
  bool applied = false;        // false: non-finite gradient, weights unchanged
  bool casts_written = false;  // the FP8 casts passed to step() were written with the weights
  // Offload: host seconds this update spent moving state over PCIe (uploads and downloads, which
  // return when done) and running the chunks' updates (AdamW and the copies it writes, waited for).
  double transfer_s = 0, update_s = 0;
  // optimizer_offload_overlap: the chunks' transfers ran beside each other and beside the
  // updates; update_s is then all of it and transfer_s 0.
  bool overlapped = false;
  // optimizer_offload_update: host — the host seconds of AdamW on the host's cores (update_s is
  // then the device writing the forms from the new masters).
  double host_update_s = 0;
};

class AdamWOptimizer {
 public:
  AdamWOptimizer(ParamStore& store, AdamWConfig cfg);
  ~AdamWOptimizer();
  AdamWOptimizer(const AdamWOptimizer&) = delete;
  AdamWOptimizer& operator=(const AdamWOptimizer&) = delete;

  // One update from the accumulated gradients; `step` is 1-based (bias correction, schedule).
  // A non-finite gradient norm skips the update and leaves weights and moments unchanged.
  // `casts`: FP8 casts of the new weights to write with them (FluxModel::weight_casts).
  StepStats step(int64_t step, double lr, std::span<const Backend::ParamCast> casts = {});

  // Data parallelism: step() first sums the gradients over `dp`'s group. With `distributed`
  // (use_distributed_optimizer) this rank keeps the moments of its shard of the flat buffer only
  // (FlatSharding::owned): the gradients are reduce-scattered, the norm is summed over the
  // shards and AdamW updates the shard. Where the store's masters are sharded the same way
  // (ParamStore MasterShards, master_shards(): what the trainer does) this rank holds the f32
  // masters of its shard only, and the store rebuilds every rank's device forms (bf16 operand
  // copies, f32 residents) from the updated masters gathered a window at a time; the FP8 casts
  // are made afresh from gathered masters at their first use. Otherwise (whole masters) the new
  // weights are all-gathered into every rank's flat buffer. Call before the first step; the
  // moments start at zero.
  void set_data_parallel(DataParallel* dp, bool distributed);
  // The caller sums the gradients over the data-parallel group before each step()
  // (train/gradient_buckets.h, overlapped with the backward): step() then takes them as summed —
  // the whole buffer, or sharded the owned() range — and runs no reduction of its own.
  void set_gradients_reduced_by_caller(bool reduced) { caller_reduces_ = reduced; }
  // The master shards a store needs for the distributed optimizer over `dp` (no group: whole
  // masters): each rank's owned range of the flat buffer of `total` elements.
  static MasterShards master_shards(DataParallel* dp, bool distributed, int64_t total);
  // Tensor parallelism: `tp` reduces over the model's tensor-parallel group, whose ranks hold
  // the shards of the split parameters and the same replicated ones: the gradient norm counts
  // every shard once and every replicated tensor once.
  void set_tensor_parallel(DataParallel* tp);
  bool sharded() const { return sharded_; }

  // The moments (in moment_dtype(); checkpoints store them as f32): this rank's, of the whole
  // buffer or, sharded, of owned() only. They live on moments_backend(): the parameters' backend,
  // or with offload a CPU backend holding them in host memory (the masters' own when they are
  // offloaded too).
  DType moment_dtype() const { return m_.dtype; }
  Backend& moments_backend() const { return host_ ? *host_ : store_.backend(); }
  bool offloaded() const { return host_ != nullptr; }
  Tensor exp_avg() const { return m_; }
  Tensor exp_avg_sq() const { return v_; }
  FlatRange owned() const { return owned_; }
  // Whole-buffer state for checkpoints, on full_state_backend(). gather_moments(): the group's
  // shards of the moments — and of the masters where they are sharded — brought to the group's
  // rank 0 into host memory, a bounded piece at a time through one backend buffer (every rank
  // takes part; no rank holds a whole buffer on the backend), which full_exp_avg()/
  // full_exp_avg_sq()/full_masters() return there until release_full_moments() (undefined on
  // the other ranks). Without sharding they are the moments and flat_params() themselves. A load
  // reads each rank's part into exp_avg()/exp_avg_sq() (load_checkpoint's moments_range owned()).
  void gather_moments();
  void release_full_moments();
  Tensor full_exp_avg() const { return sharded_ ? full_m_ : m_; }
  Tensor full_exp_avg_sq() const { return sharded_ ? full_v_ : v_; }
  Tensor full_masters() const { return store_.masters_sharded() ? full_p_ : store_.flat_params(); }
  Backend& full_state_backend() const { return sharded_ ? *full_host_ : moments_backend(); }
  Backend& full_masters_backend() const { return store_.masters_sharded() ? *full_host_ : store_.masters_backend(); }

 private:
  StepStats sharded_step(int64_t step, double lr);
  // AdamW over the parameters `range` (inside owned()): in place, or with offload a chunk of
  // `chunks` at a time through the device buffers slots_. copies/casts/low_rank as adamw takes
  // them for the whole flat buffer.
  void update(StepStats& s, FlatRange range, const Backend::AdamW& h, std::span<const Backend::ParamCopy> copies,
              std::span<const Backend::ParamCast> casts, const std::vector<Backend::LowRankGrad>& low_rank);
  void update_chunk(StepStats& s, FlatRange chunk, Backend::AdamW h, std::span<const Backend::ParamCopy> copies,
                    std::span<const Backend::ParamCast> casts, const std::vector<Backend::LowRankGrad>& low_rank);
  // optimizer_offload_overlap: the chunks through the two device slots in turn, uploads on one
  // copy queue and downloads on another, so that chunk k + 1 comes up while chunk k is updated and
  // chunk k − 1 goes down. The same kernels on the same bytes: the same bits as update_chunk.
  void update_overlapped(StepStats& s, const std::vector<FlatRange>& chunks, const Backend::AdamW& h,
                         std::span<const Backend::ParamCopy> copies, std::span<const Backend::ParamCast> casts,
                         const std::vector<Backend::LowRankGrad>& low_rank);
  // A chunk's optimizer state in host memory and its place in device slot `slot`: the moments
  // and, offloaded, the masters.
  struct ChunkCopy {
    void* host;
    void* device;
    size_t bytes;
  };
  std::vector<ChunkCopy> chunk_copies(int slot, FlatRange chunk) const;
  // The chunk's AdamW on the device from slot `slot`, and the resident copies it writes.
  void apply_chunk(int slot, FlatRange chunk, Backend::AdamW h, std::span<const Backend::ParamCopy> copies,
                   std::span<const Backend::ParamCast> casts, const std::vector<Backend::LowRankGrad>& low_rank);
  // host_update: the chunk's AdamW on the host, then its forms written on the device from the
  // uploaded masters — the copies, casts and residents the device update writes, bit for bit.
  void update_chunk_on_host(StepStats& s, FlatRange chunk, Backend::AdamW h, std::span<const Backend::ParamCopy> copies,
                            std::span<const Backend::ParamCast> casts,
                            const std::vector<Backend::LowRankGrad>& low_rank);
  // Offload: the chunks of `range` — whole parameters, starting at even indices — and the device
  // buffers for the largest.
  std::vector<FlatRange> offload_chunks(FlatRange range, bool whole_params) const;
  void allocate_device_chunk(int64_t elements, int slots);
  // Sharded: the group's shards `mine` (this rank's, on `mine_on`) into `full` (host memory, the
  // group's rank 0 only: undefined elsewhere), a piece of each rank's shard at a time through
  // one backend buffer.
  void gather_to_lead(const Tensor& mine, Backend& mine_on, const Tensor& full);
  void allocate_full_moments();
  // This rank's masters of flat range r (inside owned() where they are sharded).
  Tensor masters(FlatRange r) const;
  // The squared norm of the whole model's gradient, from this rank's gradients in `range` (all of
  // the buffer, or its owned shard after a reduce-scatter) and `low_rank`.
  double job_sum_squares(FlatRange range, const std::vector<Backend::LowRankGrad>& low_rank);
  // On moments_backend(); offloaded and `pin`, registered with the parameters' backend for direct
  // copies (Device::register_host_memory: the moments streamed every step, not a checkpoint's
  // gathered ones). release_moment undoes both.
  Tensor allocate_moment(int64_t n, bool pin = true);
  void release_moment(Tensor& t);
  std::vector<void*> pinned_;
  ParamStore& store_;
  AdamWConfig cfg_;
  Backend* host_ = nullptr;            // offload: the moments' memory
  std::unique_ptr<Backend> own_host_;  // host_ when the masters are not offloaded
  Tensor m_, v_;
  // Offload: the device buffers of a chunk — of each moment and, with offloaded masters, of the
  // masters. Slot 1 only with optimizer_offload_overlap.
  struct DeviceSlot {
    Tensor m, v, p;
  };
  std::array<DeviceSlot, 2> slots_;
  void release_slots();
  // optimizer_offload_overlap: the upload and download queues, and per slot the points its
  // chunk's upload, update and download reach.
  std::unique_ptr<Backend::CopyQueue> up_, down_;
  std::array<std::unique_ptr<Backend::Event>, 2> uploaded_, updated_, downloaded_;
  // host_update: one chunk of the gradients in host memory, in the parameters' type, and, for
  // gradients the device keeps in another type (bf16), their bytes as downloaded.
  Tensor host_grads_, host_grads_raw_;
  DataParallel* dp_ = nullptr;
  DataParallel* tp_ = nullptr;
  // With tp_: the flat buffer's runs of split parameters (adjacent ones merged), for the norm.
  std::vector<FlatRange> split_runs_;
  bool sharded_ = false;
  bool caller_reduces_ = false;
  FlatSharding sharding_;
  FlatRange owned_;
  Tensor full_m_, full_v_, full_p_;
  std::unique_ptr<Backend> full_host_;  // sharded: the host memory of the whole-buffer state
};

}  // namespace flux8
