#pragma once
// `flux8 bench`: whole training steps (objective noise, forward, loss, backward, gradient
// clipping, AdamW and the FP8 scale update) on synthetic data of a fixed shape, timed as the
// median of N steps after warm-up, with model TFLOP/s by model/flops.h's FLOP convention,
// memory, and the time from the start of the benchmark to the end of the first step (model
// built, weights initialised, everything planned).
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/energy.h"
#include "fp8/fp8_config.h"
#include "model/block_common.h"
#include "model/flux_config.h"
#include "model/flux_model.h"
#include "train/optimizer.h"

namespace flux8 {

// The synthetic data of a bench run (see run_step_bench). prototypes: 64 fixed latents with
// their text, drawn per sample (a model memorises them: the loss falls towards 0).
// structured: fresh latents every step made from a 32-dimensional random code that the text
// and pooled vector also carry, plus noise the text does not (a distribution to learn, with
// an irreducible loss, like real data).
enum class BenchData : uint8_t { prototypes, structured };

struct StepBenchSpec {
  std::string workload;  // "W1", "W2", or a config name
  FluxConfig model;
  StepShape shape;
  Fp8Config fp8;  // enabled = false: the non-FP8 path
  int warmup = 3, steps = 10;
  // Gradient accumulation: forward and backward passes of `shape` a step, each rank (the
  // trainer's global_batch_size / (micro_batch_size x data-parallel ranks)).
  int micro_batches = 1;
  uint64_t seed = 1234;
  double lr = 1e-4;  // constant learning rate of the AdamW steps
  RecomputePolicy recompute = Recompute::none;
  bool profile = false;  // time every op (OpProfiler: device timing marks, nothing waits)
  BenchData data = BenchData::prototypes;
  AdamWConfig adam;  // the optimizer's hyper-parameters and moment storage
  // cuda_graph: forward, loss and backward through StepGraph (not with profile, whose per-op
  // timing marks need each op issued on its own).
  bool cuda_graph = false;
  // Also time the trainer's host work before each step at this shape (data_assemble_ms,
  // data_upload_ms): MLPerf-like samples assembled into a batch and uploaded.
  bool data_path = false;
  // Under a launcher (mpirun, srun) every rank runs the step on its GPU, as the trainer does: the
  // model split over tensor_parallel ranks, the gradients summed over the rest (data parallelism,
  // synthetic data the same on every rank) in buckets, started during the backward with
  // overlap_grad_reduce; distributed_optimizer shards AdamW's moments and f32 masters.
  int tensor_parallel = 1;
  bool distributed_optimizer = false;
  bool overlap_grad_reduce = true;
};

struct OpTime {
  std::string op;
  double calls_per_step = 0, ms_per_step = 0;
};

struct StepBenchResult {
  std::string workload, precision;
  std::string parallel;  // "TP=2 x DP=4 (8 ranks)" under a launcher, else ""
  // Data parallelism: the gradient buckets of a step, and of them the ones started during the
  // backward (overlap_grad_reduce), as the last step ran them.
  size_t gradient_buckets = 0, buckets_started_in_backward = 0;
  std::vector<double> step_ms;  // every timed step
  double median_ms = 0, tflops = 0, model_tflop = 0;
  double setup_s = 0;       // backend ready -> model built, parameters initialised, memory planned
  double first_step_s = 0;  // setup_s + the first step (plans, autotuning, first launches)
  // The process's first run only (else < 0): from the process's start (seconds_since_process_start:
  // the libraries' loading, the CUDA context and the backend included) to the end of its first
  // step, less the time the benchmark spends making its own synthetic data.
  double launch_to_first_step_s = -1;
  double launch_to_backend_s = -1;  // of those, until this run began (its backend made)
  double peak_allocated_gib = 0, device_used_gib = 0, activation_gib = 0;
  EnergySummary energy;  // the timed steps' energy (a device with an energy counter)
  double first_loss = 0, last_loss = 0;
  std::vector<double> losses;       // every step's loss, warm-up included (a run's loss curve)
  std::vector<OpTime> ops;          // with profile: per-op time of a timed step, largest first
  std::vector<OpTime> idle_before;  // with profile: the idle row by the op after each wait
  int non_finite_steps = 0;         // steps whose loss was not finite
  // cuda_graph: per timed step, the segments launched as graphs and the ops still issued one
  // by one inside the forward and backward (first sightings, uncapturable segments).
  bool cuda_graph = false;
  double graph_segments_per_step = 0, graph_ops_per_step = 0, eager_ops_per_step = 0;
  int64_t graph_capture_failures = 0;
  // data_path: median ms a step of make_train_batch (VAE posterior draws, patches, T5 and CLIP
  // features into the batch) and of StepBuffers::upload (the copies and the noise), or −1.
  double data_assemble_ms = -1, data_upload_ms = -1;
  // optimizer_offload: median ms a timed step of the optimizer's transfers, of its chunks'
  // updates on the device and of AdamW on the host (StepStats::transfer_s, update_s,
  // host_update_s; optimizer_offload_update: host), or −1.
  double offload_transfer_ms = -1, offload_update_ms = -1, offload_host_update_ms = -1;
  bool offload_overlapped = false;  // StepStats::overlapped: offload_update_ms holds the transfers too
};

// The benchmark's fixed workloads: W1 (flux_535m, 256 px, batch 32) and W2 (12B-width slice: 2
// double + 4 single blocks, 1024 px, batch 2). `source_dir` locates configs/models/.
StepBenchSpec workload_spec(const std::string& id, const std::string& source_dir);

StepBenchResult run_step_bench(Backend& be, const StepBenchSpec& spec);

// The FP8 linear at Flux shapes: per shape, flux8's FP8 linear forward (current-scaling casts
// of x and w included), the FP8 GEMM alone on pre-cast operands (one cuBLASLt call) in fp32
// accumulation, with fast accumulation, and with fast accumulation and a bias (the model's
// forward GEMM), and the non-FP8 linear of this backend, each as median ms per call (timed in
// batches of 10 calls) and TFLOP/s.
struct GemmBenchRow {
  int64_t m, n, k;
  double fp8_linear_ms, fp8_gemm_ms, linear_ms;
  double fp8_linear_tflops, fp8_gemm_tflops, linear_tflops;
  double fp8_gemm_fast_ms, fp8_gemm_fast_bias_ms;
  double cast_ms, cast_sums_ms, cast_gbps;  // delayed-recipe cast of x [m, k], both copies (+ column sums)
};
std::vector<GemmBenchRow> run_gemm_bench(Backend& be, int repeats);

// Attention at the workloads' shapes (W1: batch 32, L = 512; W2: batch 2, L = 4608; 24 heads of
// 128), median ms: BF16 heads (Backend::attention, _backward) against FP8
// (attention_fp8, _backward: E4M3 q, k, v, o; E5M2 dO and gradients, the hybrid format), the
// FP8 calls alone and the casts around them (q, k, v cast from bf16 heads and o dequantized;
// dO cast, dq, dk, dv dequantized). TFLOP/s count 4·B·n·L²·D forward, 2.5x that backward.
struct AttentionBenchRow {
  std::string workload;
  int64_t batch, heads, seq, head_dim;
  double bf16_fwd_ms, bf16_bwd_ms, fp8_fwd_ms, fp8_bwd_ms, fp8_fwd_casts_ms, fp8_bwd_casts_ms;
  double bf16_fwd_tflops, bf16_bwd_tflops, fp8_fwd_tflops, fp8_bwd_tflops;
};
std::vector<AttentionBenchRow> run_attention_bench(Backend& be, int repeats);

// The BF16 MLP's fused epilogues at Flux shapes (m tokens, hidden k, MLP width n), each against
// the separate ops it replaces, median ms: the first Linear with its GELU (linear + gelu_tanh vs
// linear_gelu), the second Linear's input gradient through the GELU (linear_backward's dx +
// gelu_tanh_backward vs linear_dgrad_gelu), and the first Linear's weight gradient without and
// with its bias gradient (the column sums of dy), written and accumulated.
struct EpilogueBenchRow {
  int64_t m, n, k;
  double linear_gelu_unfused_ms, linear_gelu_ms;
  double dgrad_gelu_unfused_ms, dgrad_gelu_ms;
  double wgrad_ms, wgrad_bias_ms, wgrad_acc_ms, wgrad_acc_bias_ms;
};
std::vector<EpilogueBenchRow> run_epilogue_bench(Backend& be, int repeats);

// The BF16 Linears an FP8 step keeps, of few rows or a narrow side: the per-sample modulation
// and embedder MLPs at W1's 32 and W2's 2 rows, the image and text embedders and the final
// projection over a step's tokens — the FP8 profile's `linear` and `linear_backward` rows. For
// each: the forward with its bias, the input gradient and the weight gradient with the bias
// gradient (f32, overwritten), as the model calls them (the weight as its bf16 operand copy),
// median ms of batches of 20 back-to-back calls; the forward's weight bytes per second; and the
// host's time to issue a forward and a dgrad call (µs: the batch's enqueueing, before its
// synchronisation) — where it reaches the call's time, the host path is the floor.
struct SmallLinearBenchRow {
  std::string name;
  int64_t rows, out, in;
  double fwd_ms, dgrad_ms, wgrad_ms;
  double fwd_weight_gbps;
  double fwd_host_us, dgrad_host_us;
};
std::vector<SmallLinearBenchRow> run_small_linear_bench(Backend& be, int repeats);

}  // namespace flux8
