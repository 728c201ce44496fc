// The rectified-flow objective's noise, the MSE loss, the gradient norm and AdamW on the device.
// The noise comes from the same counter-based Philox generator as the CPU backend
// (core/rng.h), keyed by (seed, stream, element). The device's logf/cosf/sqrtf may differ
// from the host's libm in the last bit, so the noise agrees with the CPU's to f32 rounding
// (~1e-7 relative), not bit for bit. Loss and norm sums are in double with a fixed order.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backend/cuda/common.cuh"
#include "backend/cuda/fp8_encode.cuh"
#include "core/rng.h"
#include "core/stochastic_rounding.h"

namespace flux8 {
using namespace cuda;

namespace {
struct FlowMatchStreams {
  static constexpr int64_t kCount = 256;
  uint64_t v[kCount];
};

// Element i of sample b = i / per: ε from (seed, stream, i mod per), then x_t and the target.
__device__ inline void flow_match_element(int64_t i, int64_t per, uint64_t seed, uint64_t stream, const float* x,
                                          const float* t, float* xt, float* target) {
  const int64_t b = i / per, e = i % per;
  const double tb = t[b];
  const double eps = rng_normal(seed, stream, static_cast<uint64_t>(e));
  xt[i] = static_cast<float>((1.0 - tb) * static_cast<double>(x[i]) + tb * eps);
  target[i] = static_cast<float>(eps - static_cast<double>(x[i]));
}
}  // namespace

void CudaBackend::execute(const op::FlowMatchInputs& args) {
  constexpr std::string_view op = "flow_match_inputs";
  require_f32(args);
  const int64_t B = ops::check(op, args), per = args.x0.numel() / B;
  const float *x = args.x0.ptr<float>(), *tv = args.t.ptr<float>();
  float *xo = args.xt.ptr<float>(), *tg = args.target.ptr<float>();
  // The per-sample stream ids travel in the kernel's arguments (2 KiB): nothing waits, so the
  // trainer's next micro-batch is queued while the device still computes. A larger batch sends
  // them through the scratch buffer and waits for that copy (streams is the caller's span).
  if (B <= FlowMatchStreams::kCount) {
    FlowMatchStreams ids{};
    for (int64_t b = 0; b < B; ++b) ids.v[b] = args.streams[static_cast<size_t>(b)];
    for_each(*this, B * per,
             [=] __device__(int64_t i) { flow_match_element(i, per, args.seed, ids.v[i / per], x, tv, xo, tg); });
    return;
  }
  uint64_t* dev_streams = static_cast<uint64_t*>(scratch(static_cast<size_t>(B) * sizeof(uint64_t)));
  FLUX8_CUDA_CHECK(
      cudaMemcpyAsync(dev_streams, args.streams.data(), B * sizeof(uint64_t), cudaMemcpyHostToDevice, stream_));
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for_each(*this, B * per,
           [=] __device__(int64_t i) { flow_match_element(i, per, args.seed, dev_streams[i / per], x, tv, xo, tg); });
}

namespace {
// mse_loss's queued work: dpred, then the per-chunk partial sums of (pred − target)² in the
// reduction scratch; returns the partials (count + 1 doubles, the total goes last) and count.
std::pair<double*, int64_t> queue_mse_loss(CudaBackend& be, std::string_view op, Tensor dpred, Tensor pred,
                                           Tensor target, double grad_scale) {
  require_f32(op, {{"dpred", dpred}, {"pred", pred}, {"target", target}});
  for (Named n : {Named{"dpred", dpred}, Named{"pred", pred}, Named{"target", target}}) require_contiguous(op, n);
  require_shape(op, {"target", target}, pred.shape);
  if (dpred.defined()) require_shape(op, {"dpred", dpred}, pred.shape);
  const int64_t n = pred.numel();
  const float *p = pred.ptr<float>(), *y = target.ptr<float>();
  if (dpred.defined()) {
    float* g = dpred.ptr<float>();
    const double k = 2.0 * grad_scale / static_cast<double>(n);
    for_each(be, n, [=] __device__(int64_t i) {
      g[i] = static_cast<float>(k * (static_cast<double>(p[i]) - static_cast<double>(y[i])));
    });
  }
  return queue_partial_sums(be, n, [=] __device__(int64_t i) {
    const double d = static_cast<double>(p[i]) - static_cast<double>(y[i]);
    return d * d;
  });
}
}  // namespace

double CudaBackend::execute(const op::MseLoss& args) {
  const auto [partial, chunks] = queue_mse_loss(*this, "mse_loss", args.dpred, args.pred, args.target, args.grad_scale);
  return total_of_partials(*this, partial, chunks) / static_cast<double>(args.pred.numel());
}

void CudaBackend::execute(const op::MseLossInto& args) {
  constexpr std::string_view op = "mse_loss_into";
  if (args.loss.dtype != DType::f64 || args.loss.numel() != 1 || !args.loss.contiguous())
    fail("{}: loss must be one contiguous f64 element, got {} {}", op, dtype_name(args.loss.dtype),
         args.loss.shape.str());
  const auto [partial, chunks] = queue_mse_loss(*this, op, args.dpred, args.pred, args.target, args.grad_scale);
  // The same fixed-order total as mse_loss, then the same division (IEEE, in double): its value.
  sum_partials_kernel<<<1, kThreads, 0, stream_>>>(partial, chunks, partial + chunks);
  FLUX8_LAUNCH_CHECK(sum_partials_kernel);
  const double* total = partial + chunks;
  double* out = args.loss.ptr<double>();
  const double count = static_cast<double>(args.pred.numel());
  for_each(*this, 1, [=] __device__(int64_t) { *out = *total / count; });
}

namespace {
// sum_squares over a 16-byte aligned x (the flat gradients: the gradient norm of every step):
// block b takes the kSquaresChunk elements from b·kSquaresChunk as 4-element quads, thread t
// the quads t, t + kThreads, ... in batches of kSquaresBatch loads issued together, each element
// squared and added in double in that order; the n % 4 elements after the last quad go to the
// last block's first threads. Then the fixed tree, and total_of_partials over the blocks. An
// order that depends on n only. ordered_sum's element-by-element loads of 8192 elements a block
// run below this kernel's bandwidth and leave its second pass 160k partials.
constexpr int kSquaresBatch = 8;
constexpr int64_t kSquaresChunk = int64_t(4) * kThreads * kSquaresBatch * 8;

__device__ __forceinline__ double add_squares(double s, float4 q) {
  const double a = q.x, b = q.y, c = q.z, d = q.w;
  s += a * a;
  s += b * b;
  s += c * c;
  s += d * d;
  return s;
}
// Eight bf16 gradients (grad_precision: bf16) in one 16-byte load, in element order: element
// 2k is the low half of word k.
__device__ __forceinline__ double add_squares(double s, uint4 q) {
  for (const uint32_t w : {q.x, q.y, q.z, q.w}) {
    const float2 f = widen_bf16x2(w);
    const double lo = f.x, hi = f.y;
    s += lo * lo;
    s += hi * hi;
  }
  return s;
}

// What one 16-byte load of the flat buffer holds: four f32 or eight bf16 elements.
template <typename G>
struct Vec16;
template <>
struct Vec16<float> {
  using type = float4;
  static constexpr int kElements = 4;
  __device__ static type zero() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
};
template <>
struct Vec16<__nv_bfloat16> {
  using type = uint4;
  static constexpr int kElements = 8;
  __device__ static type zero() { return make_uint4(0u, 0u, 0u, 0u); }
};

// A block's share of Σ x² over [begin, end) of a 16-byte aligned x (f32, or bf16 gradients): the
// 16-byte vectors in batches of kSquaresBatch loads issued together (thread t the vectors t,
// t + kThreads, ...), the elements before the first 16-byte boundary and after the last one by
// the first threads, each square added in double in an order that depends on begin and end only;
// the block's tree follows.
template <typename G>
__device__ __forceinline__ double flat_squares(const G* __restrict__ x, int64_t begin, int64_t end) {
  using V = Vec16<G>;
  constexpr int64_t kE = V::kElements;
  const int64_t q0 = (begin + kE - 1) / kE, q1 = end / kE;
  const int64_t head_end = kE * q0 < end ? kE * q0 : end, tail_begin = q1 > q0 ? kE * q1 : head_end;
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < head_end; i += kThreads) {
    const double t = load(x[i]);
    s += t * t;
  }
  const auto* xv = reinterpret_cast<const typename V::type*>(x);
  for (int64_t base = q0 + threadIdx.x; base < q1; base += int64_t(kSquaresBatch) * kThreads) {
    typename V::type q[kSquaresBatch];
#pragma unroll
    for (int u = 0; u < kSquaresBatch; ++u) {
      const int64_t i = base + int64_t(u) * kThreads;
      q[u] = i < q1 ? xv[i] : V::zero();
    }
#pragma unroll
    for (int u = 0; u < kSquaresBatch; ++u) s = add_squares(s, q[u]);
  }
  for (int64_t i = tail_begin + threadIdx.x; i < end; i += kThreads) {
    const double t = load(x[i]);
    s += t * t;
  }
  return s;
}

template <typename G>
__global__ void __launch_bounds__(kThreads) sum_squares4_kernel(const G* x, int64_t n, double* partial) {
  __shared__ double sh[kThreads];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kSquaresChunk;
  double s = flat_squares(x, begin, begin + kSquaresChunk < n ? begin + kSquaresChunk : n);
  s = block_sum(s, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

template <typename G>
double sum_squares_of(CudaBackend& be, const G* p, int64_t n) {
  if (n == 0 || !aligned16(p))
    return ordered_sum(be, n, [=] __device__(int64_t i) {
      const double v = load(p[i]);
      return v * v;
    });
  const int64_t blocks = (n + kSquaresChunk - 1) / kSquaresChunk;
  FLUX8_CHECK(blocks < (int64_t(1) << 31), "sum_squares: {} elements exceed one launch", n);
  double* partial = static_cast<double*>(be.reduction_scratch(static_cast<size_t>(blocks + 1) * sizeof(double)));
  sum_squares4_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, be.stream()>>>(p, n, partial);
  FLUX8_LAUNCH_CHECK(sum_squares4_kernel);
  return total_of_partials(be, partial, blocks);
}
}  // namespace

// x: f32, or a bf16 gradient (grad_precision: bf16; the trainer's search for a non-finite one).
double CudaBackend::execute(const op::SumSquares& args) {
  grads_in_bf16(args);
  require_contiguous("sum_squares", {"x", args.x});
  if (args.x.dtype == DType::bf16) return sum_squares_of(*this, args.x.ptr<__nv_bfloat16>(), args.x.numel());
  return sum_squares_of(*this, args.x.ptr<float>(), args.x.numel());
}

namespace {

// ---- low-rank gradients (Backend::LowRankGrad) and the chunk tables of the flat buffers ------

// A chunk's low-rank gradient: its factors a [rank, rows], b [rank, cols], and the index of the
// chunk's first element in the gradient's [rows, cols] (a null: the chunk reads the flat buffer).
struct LowRankChunk {
  const float* a;
  const float* b;
  uint32_t first, rows, cols, rank;
};

// g[m, k] = Σ_r a[r, m]·b[r, k], each product and sum rounded on its own, r in order: the CPU
// twin's GradientReader, bit for bit.
__device__ __forceinline__ float low_rank_at(const LowRankChunk& L, uint32_t m, uint32_t k) {
  float s = __fmul_rn(L.a[m], L.b[k]);
  for (uint32_t r = 1; r < L.rank; ++r) s = __fadd_rn(s, __fmul_rn(L.a[r * L.rows + m], L.b[r * L.cols + k]));
  return s;
}

// g[m, k .. k + 3] (k and cols multiples of 4, b 16-byte aligned): one a value and one 16-byte
// load of b a factor row.
__device__ __forceinline__ float4 low_rank_quad(const LowRankChunk& L, uint32_t m, uint32_t k) {
  float a = L.a[m];
  float4 b = *reinterpret_cast<const float4*>(L.b + k);
  float4 s = make_float4(__fmul_rn(a, b.x), __fmul_rn(a, b.y), __fmul_rn(a, b.z), __fmul_rn(a, b.w));
  for (uint32_t r = 1; r < L.rank; ++r) {
    a = L.a[r * L.rows + m];
    b = *reinterpret_cast<const float4*>(L.b + r * L.cols + k);
    s.x = __fadd_rn(s.x, __fmul_rn(a, b.x));
    s.y = __fadd_rn(s.y, __fmul_rn(a, b.y));
    s.z = __fadd_rn(s.z, __fmul_rn(a, b.z));
    s.w = __fadd_rn(s.w, __fmul_rn(a, b.w));
  }
  return s;
}

// Element (or quad) e, e + stride, ... of a row-major matrix with `cols` columns (or quads) as
// (row m, column k), one division at the start instead of one per step: a 32-bit division per
// quad makes the low-rank kernels issue-bound (an elementwise low-rank norm runs slower than
// reading the dense gradient would). advance() subtracts stride / cols times: once or less for Flux's widths (cols
// of 768 quads and more), up to 256 times only for toy widths.
struct RowWalk {
  uint32_t m, k;
  __device__ RowWalk(uint32_t e, uint32_t cols) : m(e / cols), k(e - (e / cols) * cols) {}
  __device__ void advance(uint32_t stride, uint32_t cols) {
    k += stride;
    while (k >= cols) k -= cols, ++m;
  }
};

// Whether chunk [begin, ...) of a low-rank gradient can take its quads from low_rank_quad: the
// chunk starts a quad of the flat buffer and of a factor row.
__device__ __forceinline__ bool low_rank_quads(const LowRankChunk& L, int64_t begin) {
  return begin % 4 == 0 && L.first % 4 == 0 && L.cols % 4 == 0 && reinterpret_cast<uintptr_t>(L.b) % 16 == 0;
}

// The chunk of low-rank gradient g that starts at its element `first`.
LowRankChunk low_rank_chunk(const Backend::LowRankGrad& g, int64_t first) {
  return LowRankChunk{g.a.ptr<float>(),
                      g.b.ptr<float>(),
                      static_cast<uint32_t>(first),
                      static_cast<uint32_t>(g.a.shape[1]),
                      static_cast<uint32_t>(g.b.shape[1]),
                      static_cast<uint32_t>(g.rank())};
}

// Something that covers a range of the flat buffer: an output of adamw (its chunk with the
// pointers of the range's first element) or a low-rank gradient.
template <typename Payload>
struct Covered {
  int64_t offset, count;
  Payload first;
};

// Cuts [0, n) into chunks of at most `size` elements, each inside one range of `outputs` (or
// none) and one range of `low_rank` (or none), every range cut from its own start: `emit(begin,
// end, output or null, low-rank chunk)` in order. Both lists are sorted by offset, no two
// ranges of one list overlapping (op_checks).
template <typename Payload, typename Emit>
void cut_chunks(int64_t n, int64_t size, const std::vector<Covered<Payload>>& outputs,
                const std::vector<Backend::LowRankGrad>& low_rank, Emit emit) {
  std::vector<int64_t> cuts{0, n};
  for (const auto& o : outputs) cuts.insert(cuts.end(), {o.offset, o.offset + o.count});
  for (const auto& g : low_rank) cuts.insert(cuts.end(), {g.offset, g.end()});
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  size_t oi = 0, li = 0;
  for (size_t c = 0; c + 1 < cuts.size(); ++c) {
    const int64_t begin = cuts[c], end = cuts[c + 1];
    while (oi < outputs.size() && outputs[oi].offset + outputs[oi].count <= begin) ++oi;
    while (li < low_rank.size() && low_rank[li].end() <= begin) ++li;
    const Covered<Payload>* out = oi < outputs.size() && outputs[oi].offset <= begin ? &outputs[oi] : nullptr;
    const Backend::LowRankGrad* g = li < low_rank.size() && low_rank[li].offset <= begin ? &low_rank[li] : nullptr;
    for (int64_t at = begin; at < end; at += size)
      emit(at, std::min(end, at + size), out, g ? low_rank_chunk(*g, at - g->offset) : LowRankChunk{});
  }
}

// The low-rank gradients' part of a table's layout key (`sorted` as ops::check_low_rank_grads
// returns them); fails for a gradient too large for the kernels' 32-bit element index.
void add_low_rank_layout(std::string_view op, const std::vector<Backend::LowRankGrad>& sorted,
                         std::vector<int64_t>& layout) {
  for (const Backend::LowRankGrad& g : sorted) {
    if (g.size() >= (int64_t(1) << 32) || g.rank() >= (int64_t(1) << 32))
      fail("{}: low-rank gradient [{}, {}] of rank {} is too large for this backend's 32-bit indices", op, g.a.shape[1],
           g.b.shape[1], g.rank());
    layout.insert(layout.end(),
                  {g.offset, static_cast<int64_t>(reinterpret_cast<uintptr_t>(g.a.data)),
                   static_cast<int64_t>(reinterpret_cast<uintptr_t>(g.b.data)), g.rank(), g.a.shape[1], g.b.shape[1]});
  }
}

// kernel<<<chunks, kThreads>>>(args...) on `stream`: a block for each of `chunks` entries of a
// chunk table (none for 0). The flat and the low-rank chunks each get a launch of their own kernel.
template <typename... Params>
void launch_chunks(void (*kernel)(Params...), int64_t chunks, cudaStream_t stream,
                   std::type_identity_t<Params>... args) {
  if (chunks == 0) return;
  kernel<<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(args...);
  FLUX8_LAUNCH_CHECK(kernel);
}

}  // namespace

void CudaBackend::upload_chunk_table(ChunkTable& t, size_t chunk_bytes, const void* flat, int64_t flat_count,
                                     const void* low_rank, int64_t low_rank_count, std::vector<int64_t> layout) {
  const int64_t count = flat_count + low_rank_count;
  FLUX8_CHECK(count < (int64_t(1) << 31), "{} chunks exceed one launch", count);
  const size_t flat_bytes = static_cast<size_t>(flat_count) * chunk_bytes;
  const size_t bytes = flat_bytes + static_cast<size_t>(low_rank_count) * chunk_bytes;
  FLUX8_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old table may still be in use
  if (bytes > t.bytes) {
    if (t.data) FLUX8_CUDA_CHECK(cudaFree(t.data));
    t.data = nullptr;
    t.bytes = 0;
    FLUX8_CUDA_CHECK(cudaMalloc(&t.data, bytes));
    t.bytes = bytes;
  }
  // By upload(): on the backend's stream, then synchronised (the chunks are the caller's, freed
  // after this). A plain cudaMemcpy runs on the legacy default stream, which the non-blocking
  // stream_ is not ordered after, and from pageable memory it may return before the DMA has
  // landed — a kernel could read a stale or half-written table (the likely cause of a rare
  // wholesale corruption of the second model trained by one backend, whose smaller AdamW table
  // reused the buffer).
  upload(t.data, flat, flat_bytes);
  upload(static_cast<char*>(t.data) + flat_bytes, low_rank, bytes - flat_bytes);
  t.layout = std::move(layout);
  t.count = count;
  t.first_low_rank = flat_count;
}

namespace {

// ---- the gradient norm over a flat buffer with low-rank ranges -------------------------------

struct SquaresChunk {
  int64_t begin, end;
  LowRankChunk lr;
  uint32_t r, q;  // a low-rank entry's pair of factor rows
};

// One term of a low-rank gradient's ‖Σ_r a_r ⊗ b_r‖² = Σ_{r ≤ q} (2 − [r = q])·(a_r·a_q)(b_r·b_q),
// each dot product in double over the block (strided, then the fixed tree): one block per pair
// (r, q), so the pairs run side by side (one block walking a gradient's pairs in turn does two
// block-wide sums a pair, one after the other).
__device__ double low_rank_pair_term(const LowRankChunk& L, uint32_t r, uint32_t q, double* sh) {
  double da = 0, db = 0;
  for (uint32_t i = threadIdx.x; i < L.rows; i += kThreads)
    da += static_cast<double>(L.a[r * L.rows + i]) * static_cast<double>(L.a[q * L.rows + i]);
  for (uint32_t i = threadIdx.x; i < L.cols; i += kThreads)
    db += static_cast<double>(L.b[r * L.cols + i]) * static_cast<double>(L.b[q * L.cols + i]);
  da = block_sum(da, sh);
  db = block_sum(db, sh);
  return (r == q ? 1.0 : 2.0) * da * db;
}

// Flat chunks (sums of squares), then one entry per pair of a low-rank gradient's factor rows
// (a term of its Gram norm), in launches of their own; `partial` is the first of this launch's
// blocks' partials.
template <bool kLowRank, typename G>
__global__ void __launch_bounds__(kThreads)
    gradient_squares_kernel(const SquaresChunk* __restrict__ chunks, const G* __restrict__ x,
                            double* __restrict__ partial) {
  __shared__ double sh[kThreads];
  const SquaresChunk c = chunks[blockIdx.x];
  double s;
  if constexpr (kLowRank) {
    s = low_rank_pair_term(c.lr, c.r, c.q, sh);
  } else {
    s = flat_squares(x, c.begin, c.end);
    s = block_sum(s, sh);
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

}  // namespace

double CudaBackend::execute(const op::GradientSumSquares& args) {
  constexpr std::string_view op = "gradient_sum_squares";
  grads_in_bf16(args);  // f32, or bf16 (grad_precision: bf16)
  require_contiguous(op, {"grads", args.grads});
  const std::vector<LowRankGrad> sorted = ops::check(op, args);
  if (sorted.empty()) return sum_squares(args.grads);
  // The flat buffer's quads are read as float4: its base must be 16-byte aligned (the backend's
  // allocations are, and so ParamStore's gradient buffer).
  if (!aligned16(args.grads.data)) fail("{}: the gradient buffer {} must be 16-byte aligned", op, args.grads.str());
  const int64_t n = args.grads.numel();
  std::vector<int64_t> layout{n};
  add_low_rank_layout(op, sorted, layout);
  if (layout != squares_table_.layout) {
    // The flat elements between the low-rank gradients in chunks, then one entry per pair of
    // factor rows of each gradient.
    std::vector<SquaresChunk> flat, factors;
    cut_chunks<int>(n, kSquaresChunk, {}, sorted,
                    [&](int64_t begin, int64_t end, const Covered<int>*, LowRankChunk lr) {
                      if (!lr.a) flat.push_back(SquaresChunk{begin, end, lr, 0, 0});
                    });
    for (const LowRankGrad& g : sorted)
      for (uint32_t r = 0; r < g.rank(); ++r)
        for (uint32_t q = r; q < g.rank(); ++q)
          factors.push_back(SquaresChunk{g.offset, g.end(), low_rank_chunk(g, 0), r, q});
    upload_chunk_table(squares_table_, sizeof(SquaresChunk), flat.data(), static_cast<int64_t>(flat.size()),
                       factors.data(), static_cast<int64_t>(factors.size()), std::move(layout));
  }
  const int64_t blocks = squares_table_.count, split = squares_table_.first_low_rank;
  double* partial = static_cast<double*>(reduction_scratch(static_cast<size_t>(blocks + 1) * sizeof(double)));
  const auto* table = static_cast<const SquaresChunk*>(squares_table_.data);
  const auto launch = [&](const auto* g) {
    using G = std::remove_cvref_t<decltype(*g)>;
    launch_chunks(gradient_squares_kernel<false, G>, split, stream_, table, g, partial);
    launch_chunks(gradient_squares_kernel<true, G>, blocks - split, stream_, table + split, g, partial + split);
  };
  if (args.grads.dtype == DType::bf16)
    launch(args.grads.ptr<__nv_bfloat16>());
  else
    launch(args.grads.ptr<float>());
  return total_of_partials(*this, partial, blocks);
}

// The ranges cut into chunks of kSquaresChunk elements, each a block of gradient_squares_kernel
// (the flat path: 16-byte loads from the buffer's base, aligned however the ranges fall), then
// the fixed-order total of their partials: one read-back for every range.
double CudaBackend::execute(const op::RangesSumSquares& args) {
  constexpr std::string_view op = "ranges_sum_squares";
  grads_in_bf16(args);  // f32, or bf16 (grad_precision: bf16)
  ops::check(op, args);
  if (!aligned16(args.x.data)) fail("{}: the buffer {} must be 16-byte aligned", op, args.x.str());
  std::vector<int64_t> layout{args.x.numel()};
  for (const ElementRange& r : args.ranges) layout.insert(layout.end(), {r.begin, r.count});
  if (layout != ranges_table_.layout) {
    std::vector<SquaresChunk> chunks;  // none: no elements, and no table to upload
    for (const ElementRange& r : args.ranges)
      for (int64_t at = r.begin; at < r.end(); at += kSquaresChunk)
        chunks.push_back(SquaresChunk{at, std::min(r.end(), at + kSquaresChunk), LowRankChunk{}, 0, 0});
    upload_chunk_table(ranges_table_, sizeof(SquaresChunk), chunks.data(), static_cast<int64_t>(chunks.size()), nullptr,
                       0, std::move(layout));
  }
  const int64_t blocks = ranges_table_.count;
  if (blocks == 0) return 0.0;  // no elements
  double* partial = static_cast<double*>(reduction_scratch(static_cast<size_t>(blocks + 1) * sizeof(double)));
  const auto* table = static_cast<const SquaresChunk*>(ranges_table_.data);
  if (args.x.dtype == DType::bf16)
    launch_chunks(gradient_squares_kernel<false, __nv_bfloat16>, blocks, stream_, table, args.x.ptr<__nv_bfloat16>(),
                  partial);
  else
    launch_chunks(gradient_squares_kernel<false, float>, blocks, stream_, table, args.x.ptr<float>(), partial);
  return total_of_partials(*this, partial, blocks);
}

namespace {

// ---- AdamW ----------------------------------------------------------------------------------

// AdamW's fp32 arithmetic: the CPU backend's operations in its order, each rounded on its own
// (the _rn intrinsics are never contracted into FMAs), so the two backends agree bit for bit.
// fp32, not fp64: in double precision the kernel is partly bound by the FP64 units (divisions,
// square root, conversions) instead of by its memory traffic.
// The bias corrections folded into the constants (AdamWConstants::of): one IEEE division
// and a square root an element. An IEEE division is a ~10-instruction sequence and the kernel is
// partly bound by instructions, so every division saved moves it towards its bandwidth.
struct AdamwStep {
  float gs, b1, b2, ob1, ob2, eps_hat, dec, step_size;
  uint32_t noise_key;  // adamw_step_key: bf16 moments' stochastic rounding
  int64_t index_base;  // the flat index of p[0] (AdamWHyper::index_base), even
  __device__ void operator()(float& p, float g, float& m, float& v) const {
    const float gi = __fmul_rn(gs, g);
    const float mi = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(ob1, gi));
    const float vi = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(ob2, gi), gi));
    m = mi;
    v = vi;
    const float denom = __fadd_rn(__fsqrt_rn(vi), eps_hat);
    p = __fsub_rn(__fmul_rn(p, dec), __fdiv_rn(__fmul_rn(step_size, mi), denom));
  }
};

// One block's share of the flat buffers, [begin, end), what else it writes of its elements —
// their bf16 copy and/or FP8 codes, from the pointers of element `begin` (nullptr: none) — and
// where its gradient comes from (lr.a null: the flat buffer). The table splits every output's
// and low-rank gradient's range and every gap between them into chunks, so a block never looks
// up which output or gradient an element has.
struct AdamwChunk {
  int64_t begin, end;
  __nv_bfloat16* copy;
  uint8_t* codes;
  const float* scale;  // the cast's scale (codes of x·scale)
  float* amax;         // the cast's amax target (max-accumulated)
  float* scale_inv;    // the cast's first chunk only: gets 1/scale
  Fp8Format format;
  LowRankChunk lr;
};
// 32 quads a thread: a block first waits for its chunk's entry (a dependent load), which chunks
// of 4 quads a thread do not hide; a thread's quads issued all at once (86 registers) are slower
// still (docs/PERFORMANCE.md, Measurements behind the kernels).
constexpr int64_t kAdamwChunk = 32 * 4 * kThreads;

// Stores one element's new moments: f32 as they are; bf16 rounded stochastically with the
// element's noise (core/stochastic_rounding.h: the CPU backend's bits).
__device__ __forceinline__ void store_moments(float& m, float& v, float mi, float vi, uint32_t) { m = mi, v = vi; }
__device__ __forceinline__ void store_moments(__nv_bfloat16& m, __nv_bfloat16& v, float mi, float vi, uint32_t noise) {
  m = __ushort_as_bfloat16(f32_to_bf16_bits_stochastic(mi, noise));
  v = __ushort_as_bfloat16(f32_to_bf16_bits_stochastic(vi, noise >> 16));
}
// Four elements' moments from element i (a multiple of 4) in one access each: a float4, or
// four bf16 in a uint2 (8-byte aligned) with the noise of the quad's two pairs. The bf16 path
// is written for instructions, as AdamW with bf16 moments is bound by them rather than by its
// 18 bytes an element (a branchy version keeps the SM busy and DRAM half idle): the
// random byte is placed with one byte permute, the rounding is one add, two results pack with
// one more.
__device__ __forceinline__ void store_moments4(float* m, float* v, float4 mq, float4 vq, uint32_t, int64_t) {
  store4(m, mq), store4(v, vq);
}
__device__ __forceinline__ void store_moments4(__nv_bfloat16* m, __nv_bfloat16* v, float4 mq, float4 vq,
                                               uint32_t step_key, int64_t i) {
  const uint32_t n0 = adamw_pair_noise(step_key, i >> 1), n1 = adamw_pair_noise(step_key, (i >> 1) + 1);
  // Byte k of n at bits 8..15, zeros elsewhere: __byte_perm(n, 0, 0x44k4).
  const auto r8 = [](uint32_t n, uint32_t k) { return __byte_perm(n, 0u, 0x4404u | (k << 4)); };
  const auto w = [](float x, uint32_t r) { return bf16_stochastic_word(x, r); };
  // The high halves of two words (their bf16 bits), lo in the low half: __byte_perm(lo, hi, 0x7632).
  const auto pack = [](uint32_t lo, uint32_t hi) { return __byte_perm(lo, hi, 0x7632u); };
  *reinterpret_cast<uint2*>(m) =
      make_uint2(pack(w(mq.x, r8(n0, 0)), w(mq.y, r8(n0, 1))), pack(w(mq.z, r8(n1, 0)), w(mq.w, r8(n1, 1))));
  *reinterpret_cast<uint2*>(v) =
      make_uint2(pack(w(vq.x, r8(n0, 2)), w(vq.y, r8(n0, 3))), pack(w(vq.z, r8(n1, 2)), w(vq.w, r8(n1, 3))));
}

// AdamW over the chunks, four elements an access where the buffers allow (`quads`: all four
// aligned for their four elements — 16 bytes of f32, 8 of bf16; the chunk's start a multiple
// of 4, its copy 8-byte and its codes 4-byte aligned, its factors in quads of a row): AdamW is
// pure HBM traffic, 28 bytes a parameter with f32 gradients and moments (26 with bf16
// gradients, 18 with bf16 moments too), 2 more with a copy, 1 with a cast, the gradient's
// bytes fewer with a low-rank gradient (whose factors stay in cache).
// The codes and the amax are the per-tensor cast kernel's (fp8.cu): encode_pair of x·scale, the
// amax the largest |x| bit pattern of the non-NaN values.
// adamw_kernel's body for one chunk; kLowRank: its gradient comes from the factors; G and Mo:
// the gradients' and the moments' storage (float or bf16).
template <bool kLowRank, typename G, typename Mo>
__device__ __forceinline__ void adamw_chunk(const AdamwChunk& c, float* __restrict__ p, const G* __restrict__ g,
                                            Mo* __restrict__ m, Mo* __restrict__ v, const AdamwStep& step, bool quads,
                                            uint32_t* warp_amax) {
  const int64_t n = c.end - c.begin;
  float* __restrict__ pc = p + c.begin;
  const G* __restrict__ gc = kLowRank ? nullptr : g + c.begin;
  Mo* __restrict__ mc = m + c.begin;
  Mo* __restrict__ vc = v + c.begin;
  __nv_bfloat16* __restrict__ out = c.copy;
  uint8_t* __restrict__ codes = c.codes;
  const float s = codes ? *c.scale : 0.0f;
  uint32_t amax_bits = 0;
  const auto take_amax = [&](float x) {
    if (!f32_is_nan(x)) amax_bits = max(amax_bits, __float_as_uint(x) & 0x7FFFFFFFu);
  };
  const bool vec = quads && c.begin % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(codes) % 4 == 0 && (!kLowRank || low_rank_quads(c.lr, c.begin));
  const int64_t n4 = vec ? n / 4 : 0;
  const uint32_t cols4 = kLowRank ? c.lr.cols / 4 : 1;
  RowWalk w4(kLowRank && n4 > 0 ? c.lr.first / 4 + threadIdx.x : 0, cols4);
  for (int64_t q = threadIdx.x; q < n4; q += blockDim.x) {
    float4 pq = reinterpret_cast<float4*>(pc)[q], mq = load4(mc + 4 * q), vq = load4(vc + 4 * q);
    float4 gq;
    if constexpr (kLowRank) {
      gq = low_rank_quad(c.lr, w4.m, 4 * w4.k);
      w4.advance(blockDim.x, cols4);
    } else {
      gq = load4(gc + 4 * q);  // f32, or four bf16 gradients widened
    }
    step(pq.x, gq.x, mq.x, vq.x);
    step(pq.y, gq.y, mq.y, vq.y);
    step(pq.z, gq.z, mq.z, vq.z);
    step(pq.w, gq.w, mq.w, vq.w);
    reinterpret_cast<float4*>(pc)[q] = pq;
    store_moments4(mc + 4 * q, vc + 4 * q, mq, vq, step.noise_key, step.index_base + c.begin + 4 * q);
    if (out) {
      const __nv_bfloat162 lo = __floats2bfloat162_rn(pq.x, pq.y), hi = __floats2bfloat162_rn(pq.z, pq.w);
      uint2 bits;
      bits.x = *reinterpret_cast<const uint32_t*>(&lo);
      bits.y = *reinterpret_cast<const uint32_t*>(&hi);
      reinterpret_cast<uint2*>(out)[q] = bits;
    }
    if (codes) {
      reinterpret_cast<uint32_t*>(codes)[q] =
          encode_pair(pq.x, pq.y, s, c.format) | (encode_pair(pq.z, pq.w, s, c.format) << 16);
      take_amax(pq.x), take_amax(pq.y), take_amax(pq.z), take_amax(pq.w);
    }
  }
  RowWalk w1(kLowRank ? c.lr.first + static_cast<uint32_t>(4 * n4 + threadIdx.x) : 0, kLowRank ? c.lr.cols : 1);
  for (int64_t i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) {
    float gi;
    if constexpr (kLowRank) {
      gi = low_rank_at(c.lr, w1.m, w1.k);
      w1.advance(blockDim.x, c.lr.cols);
    } else {
      gi = load(gc[i]);
    }
    float mi = load(mc[i]), vi = load(vc[i]);
    step(pc[i], gi, mi, vi);
    const int64_t e = step.index_base + c.begin + i;
    store_moments(mc[i], vc[i], mi, vi, adamw_moment_bits(adamw_pair_noise(step.noise_key, e >> 1), e));
    if (out) out[i] = __float2bfloat16_rn(pc[i]);
    if (codes) {
      codes[i] = static_cast<uint8_t>(encode_pair(pc[i], 0.0f, s, c.format));
      take_amax(pc[i]);
    }
  }
  if (codes) {  // block-uniform: the chunk's amax, max-accumulated into the target
    amax_bits = __reduce_max_sync(0xffffffffu, amax_bits);
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax_bits;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kThreads / 32; ++w) amax_bits = max(amax_bits, warp_amax[w]);
      atomicMax(reinterpret_cast<unsigned*>(c.amax), amax_bits);
      if (c.scale_inv) *c.scale_inv = scale_inverse(s);
    }
  }
}

// One kernel per gradient source: the chunk table holds the flat chunks first, then the
// low-rank ones, and each kind gets its own launch. One kernel for both is slower even where no
// chunk is low-rank: with the two bodies it takes 76 registers, 3 blocks an SM, where the flat
// body alone takes 46. The low-rank body alone takes
// 80; it is held to 64 (4 blocks an SM, 12 bytes spilled).
template <typename G, typename Mo>
__global__ void __launch_bounds__(kThreads)
    adamw_flat_kernel(const AdamwChunk* __restrict__ chunks, float* __restrict__ p, const G* __restrict__ g,
                      Mo* __restrict__ m, Mo* __restrict__ v, AdamwStep step, bool quads) {
  __shared__ uint32_t warp_amax[kThreads / 32];
  const AdamwChunk c = chunks[blockIdx.x];
  adamw_chunk<false>(c, p, g, m, v, step, quads, warp_amax);
}

template <typename Mo>
__global__ void __launch_bounds__(kThreads, 4)
    adamw_low_rank_kernel(const AdamwChunk* __restrict__ chunks, float* __restrict__ p, Mo* __restrict__ m,
                          Mo* __restrict__ v, AdamwStep step, bool quads) {
  __shared__ uint32_t warp_amax[kThreads / 32];
  const AdamwChunk c = chunks[blockIdx.x];
  adamw_chunk<true>(c, p, static_cast<const float*>(nullptr), m, v, step, quads, warp_amax);
}

}  // namespace

void CudaBackend::execute(const op::Adamw& args) {
  constexpr std::string_view op = "adamw";
  require_f32(op, tensor_fields(args, {"param"}));
  grads_in_bf16(op, tensor_fields(args, {"grad"}));  // f32, or bf16 (grad_precision: bf16)
  // m and v: f32, or both bf16 (adam_moment_precision: bf16), as check_adamw checks.
  const std::vector<LowRankGrad> sorted = ops::check(op, args);
  const int64_t n = args.param.numel();
  if (n == 0) return;

  // The chunk table depends only on n, the outputs and the low-rank gradients; it is made once
  // for each such layout (a trainer passes the same every step) and kept on the device.
  using Output = Covered<AdamwChunk>;
  std::vector<Output> outputs;
  for (const ParamCopy& c : args.copies)
    outputs.push_back({c.offset, c.copy.numel(),
                       AdamwChunk{0, 0, static_cast<__nv_bfloat16*>(c.copy.data), nullptr, nullptr, nullptr, nullptr,
                                  Fp8Format::e4m3, LowRankChunk{}}});
  for (const ParamCast& c : args.casts)
    outputs.push_back(
        {c.offset, c.codes.numel(),
         AdamwChunk{0, 0, nullptr, c.codes.codes, c.scale, c.amax, c.codes.scale_inv, c.codes.format, LowRankChunk{}}});
  std::sort(outputs.begin(), outputs.end(), [](const Output& a, const Output& b) { return a.offset < b.offset; });
  std::vector<int64_t> layout{n};
  for (const Output& o : outputs) {
    const AdamwChunk& f = o.first;
    for (const void* ptr :
         {static_cast<const void*>(f.copy), static_cast<const void*>(f.codes), static_cast<const void*>(f.scale),
          static_cast<const void*>(f.amax), static_cast<const void*>(f.scale_inv)})
      layout.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)));
    layout.push_back(o.offset);
    layout.push_back(o.count);
    layout.push_back(static_cast<int64_t>(f.format));
  }
  add_low_rank_layout(op, sorted, layout);
  if (layout != adamw_table_.layout) {
    std::vector<AdamwChunk> flat, factors;
    cut_chunks<AdamwChunk>(n, kAdamwChunk, outputs, sorted,
                           [&](int64_t begin, int64_t end, const Output* o, LowRankChunk lr) {
                             AdamwChunk k = o ? o->first : AdamwChunk{};
                             k.begin = begin;
                             k.end = end;
                             if (o) {
                               if (k.copy) k.copy += begin - o->offset;
                               if (k.codes) k.codes += begin - o->offset;
                               if (begin != o->offset) k.scale_inv = nullptr;
                             }
                             k.lr = lr;
                             (lr.a ? factors : flat).push_back(k);
                           });
    upload_chunk_table(adamw_table_, sizeof(AdamwChunk), flat.data(), static_cast<int64_t>(flat.size()), factors.data(),
                       static_cast<int64_t>(factors.size()), std::move(layout));
  }

  const AdamWConstants k = AdamWConstants::of(args.h);
  const AdamwStep step{static_cast<float>(args.h.grad_scale),
                       static_cast<float>(args.h.beta1),
                       static_cast<float>(args.h.beta2),
                       static_cast<float>(1.0 - args.h.beta1),
                       static_cast<float>(1.0 - args.h.beta2),
                       static_cast<float>(k.eps_hat),
                       static_cast<float>(k.decay),
                       static_cast<float>(k.step_size),
                       adamw_step_key(args.h.step),
                       args.h.index_base};
  if (args.h.index_base % 2 != 0) fail("adamw: index_base {} is odd (the moments' noise comes in pairs)", args.h.index_base);
  float* p = args.param.ptr<float>();
  const auto* table = static_cast<const AdamwChunk*>(adamw_table_.data);
  const int64_t split = adamw_table_.first_low_rank, count = adamw_table_.count;
  // The flat chunks and the low-rank ones, each kind its own launch, for the gradients' and the
  // moments' storage types; the vector path loads four of each at once (16 bytes of f32, 8 of bf16).
  const auto launch = [&](const auto* g, auto* mm, auto* vv) {
    using G = std::remove_cvref_t<decltype(*g)>;
    using Mo = std::remove_cvref_t<decltype(*mm)>;
    const bool quads = vec4_aligned(p) && vec4_aligned(g) && vec4_aligned(mm) && vec4_aligned(vv);
    launch_chunks(adamw_flat_kernel<G, Mo>, split, stream_, table, p, g, mm, vv, step, quads);
    launch_chunks(adamw_low_rank_kernel<Mo>, count - split, stream_, table + split, p, mm, vv, step, quads);
  };
  with_grad_storage(args.grad, [&](const auto* g) {
    if (args.m.dtype == DType::bf16)
      launch(g, args.m.ptr<__nv_bfloat16>(), args.v.ptr<__nv_bfloat16>());
    else
      launch(g, args.m.ptr<float>(), args.v.ptr<float>());
  });
}

}  // namespace flux8
