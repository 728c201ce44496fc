#include "model/flux_model.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <unordered_set>

#include "backend/step_graph.h"
#include "core/error.h"

namespace flux8 {

namespace {

constexpr int64_t kTimeEmbedDim = 256;  // sinusoidal features of t and guidance
constexpr double kTimeFactor = 1000.0;  // t in [0, 1] is embedded as 1000·t
constexpr double kMaxPeriod = 10000.0;

// An MLPEmbedder: out_layer(SiLU(in_layer(x))).
struct MlpEmbedder {
  LinearSite in_layer, out_layer;
  static MlpEmbedder bind(ParamStore& s, const std::string& name) {
    return {LinearSite::bind(s, name + ".in_layer"), LinearSite::bind(s, name + ".out_layer")};
  }
};

struct MlpEmbedderSaved {
  Tensor x;       // embedder input (a sinusoidal embedding, or the pooled text vector)
  Tensor hidden;  // in_layer output (SiLU input)
  Tensor act;     // SiLU output (out_layer input)
};

}  // namespace

struct ModelSaved {
  // The residual streams between blocks: txt_at[i] [B,Lt,H] and img_at[i] [B,Li,H] enter double
  // block i (entry Nd leaves the last one), z_at[j] [B,L,H] enters single block j (entry Ns
  // leaves the last). Each block writes its output into the next entry, so every block input
  // stays where it is — the block's saved input, without a copy — in every recompute mode.
  // img: the final image tokens, split from z_at[Ns] into img_at[Nd] (nothing reads that after
  // the concatenation; full recomputation's backward writes it again only after the final
  // layer's backward has used img).
  std::vector<Tensor> txt_at, img_at, z_at;
  Tensor img;
  Tensor ids, pe;  // joint positions [B,L,3], RoPE table [B,L,D/2,2]
  MlpEmbedderSaved time, guidance, vector;
  Tensor vec, silu_vec;  // [B,H]
  Tensor final_mod, final_mean, final_rstd, final_xm, pred;
  // Activations stored in another type than the model computes in (bf16 on the GPU): the
  // inputs img, txt, y converted (the first Linears' saved inputs) and pred converted back.
  // Otherwise undefined: the inputs are used as they are and pred is returned.
  Tensor img_in, txt_in, y_in, pred_out;
  // Every kept block's activations (Recompute::none, selective); a block under Recompute::full
  // has an empty entry.
  std::vector<DoubleBlockSaved> doubles;
  std::vector<SingleBlockSaved> singles;
  // Recompute::full: the arena mark where the one block region (a block's activations,
  // recomputed) starts. Block i's forward is re-run from its kept input (txt_at[i], ...) into
  // txt_at[i + 1], ..., which block i + 1's backward no longer needs.
  size_t block_region = 0;

  // io: the model's type (inputs, pred); t: the activations'; ht: the attention heads'; w: the
  // blocks' widths on this rank.
  static ModelSaved allocate(Arena& a, const FluxConfig& c, const BlockWidths& w, StepShape sh, DType io, DType t,
                             DType ht, const std::vector<DoubleBlockParams>& dp,
                             const std::vector<SingleBlockParams>& sp, const Fp8Runtime* fp8,
                             const RecomputePolicy& recompute) {
    const int64_t B = sh.batch, H = c.hidden_size, L = sh.tokens();
    const DType st = statistics_dtype(t);
    ModelSaved s;
    auto act = [&](Shape shape) { return a.alloc(t, shape, SlotKind::activation); };
    if (t != io) {
      s.img_in = act(Shape{B, sh.img_tokens, c.in_channels});
      s.txt_in = act(Shape{B, sh.txt_tokens, c.context_dim});
      s.y_in = act(Shape{B, c.vec_dim});
      s.pred_out = a.alloc(io, Shape{B, sh.img_tokens, c.out_channels}, SlotKind::activation);
    }
    for (size_t i = 0; i <= dp.size(); ++i) {
      s.txt_at.push_back(act(Shape{B, sh.txt_tokens, H}));
      s.img_at.push_back(act(Shape{B, sh.img_tokens, H}));
    }
    for (size_t j = 0; j <= sp.size(); ++j) s.z_at.push_back(act(Shape{B, L, H}));
    s.img = s.img_at.back();
    s.ids = a.alloc(st, Shape{B, L, 3}, SlotKind::statistic);
    s.pe = a.alloc(st, Shape{B, L, c.head_dim() / 2, 2}, SlotKind::statistic);
    auto embedder = [&](int64_t in_dim) {
      return MlpEmbedderSaved{act(Shape{B, in_dim}), act(Shape{B, H}), act(Shape{B, H})};
    };
    s.time = embedder(kTimeEmbedDim);
    if (c.guidance_embed) s.guidance = embedder(kTimeEmbedDim);
    s.vector = MlpEmbedderSaved{Tensor{}, act(Shape{B, H}), act(Shape{B, H})};
    s.vec = act(Shape{B, H});
    s.silu_vec = act(Shape{B, H});
    s.final_mod = act(Shape{B, 2 * H});
    s.final_mean = a.alloc(st, Shape{B * sh.img_tokens}, SlotKind::statistic);
    s.final_rstd = a.alloc(st, Shape{B * sh.img_tokens}, SlotKind::statistic);
    s.final_xm = act(Shape{B, sh.img_tokens, H});
    s.pred = act(Shape{B, sh.img_tokens, c.out_channels});
    const int64_t nd = static_cast<int64_t>(dp.size());
    auto mode = [&](int64_t block) { return recompute.of_block(block); };
    for (int64_t i = 0; i < nd; ++i)
      s.doubles.push_back(mode(i) == Recompute::full ? DoubleBlockSaved{}
                                                     : DoubleBlockSaved::allocate(a, w, sh, t, ht, dp[size_t(i)], fp8,
                                                                                  recompute.saved_by_block(i)));
    for (size_t j = 0; j < sp.size(); ++j) {
      const int64_t block = nd + static_cast<int64_t>(j);
      s.singles.push_back(mode(block) == Recompute::full ? SingleBlockSaved{}
                                                         : SingleBlockSaved::allocate(a, w, sh, t, ht, sp[j], fp8,
                                                                                      recompute.saved_by_block(block)));
    }
    // The block region holds one fully recomputed block at a time: measure the largest (blocks
    // differ when some run in FP8 and others in BF16).
    s.block_region = a.mark();
    for (int64_t i = 0; i < nd; ++i) {
      if (mode(i) != Recompute::full) continue;
      DoubleBlockSaved::allocate(a, w, sh, t, ht, dp[size_t(i)], fp8);
      a.release_to(s.block_region);
    }
    for (size_t j = 0; j < sp.size(); ++j) {
      if (mode(nd + static_cast<int64_t>(j)) != Recompute::full) continue;
      SingleBlockSaved::allocate(a, w, sh, t, ht, sp[j], fp8);
      a.release_to(s.block_region);
    }
    return s;
  }
};

namespace {

// Scratch needed besides the blocks': the model-level backward buffers.
void plan_model_scratch(Arena& a, const FluxConfig& c, const BlockWidths& w, StepShape sh, DType t,
                        const Fp8Config* fp8, const RecomputePolicy& recompute) {
  // The kept blocks' recomputation (the first's, and where the policy applies to some blocks
  // only, the last's too): the larger of the two kinds of block.
  const BlockRecompute first = recompute.saved_by_block(0);
  const BlockRecompute last = recompute.saved_by_block(c.num_blocks() - 1);
  const int64_t B = sh.batch, H = c.hidden_size;
  a.alloc(t, Shape{B, sh.img_tokens, c.out_channels}, SlotKind::workspace);  // dpred converted (if it must be)
  a.alloc(t, Shape{B, sh.txt_tokens, H}, SlotKind::workspace);               // dtxt
  a.alloc(t, Shape{B, sh.img_tokens, H}, SlotKind::workspace);               // dimg
  a.alloc(t, Shape{B, sh.tokens(), H}, SlotKind::workspace);                 // dz
  a.alloc(t, Shape{B, sh.img_tokens, H}, SlotKind::workspace);               // final dxm
  a.alloc(t, Shape{B, 2 * H}, SlotKind::workspace);                          // the final layer's dmod
  for (int i = 0; i < 4; ++i) a.alloc(t, Shape{B, H}, SlotKind::workspace);  // d_silu_vec, dvec, dact, dhidden
  // Blocks run one at a time: the largest of the blocks' plans, each kind of block under each
  // recompute setting in each precision a block runs in — FP8 blocks with their casts, and BF16
  // blocks (a BF16 run, or first_last_layers_bf16) without.
  std::vector<const Fp8Config*> precisions;
  bool bf16_blocks = fp8 == nullptr;
  if (fp8) {
    bool fp8_blocks = false;
    for (int64_t i = 0; i < c.num_blocks(); ++i)
      (fp8->block_in_fp8(i, c.num_blocks()) ? fp8_blocks : bf16_blocks) = true;
    if (fp8_blocks) precisions.push_back(fp8);
  }
  if (bf16_blocks) precisions.push_back(nullptr);
  std::vector<BlockRecompute> settings{first};
  if (last != first) settings.push_back(last);
  const size_t mark = a.mark();
  for (const BlockRecompute r : settings)
    for (const Fp8Config* f : precisions) {
      double_block_plan_scratch(a, w, sh, t, f, r);
      a.release_to(mark);
      single_block_plan_scratch(a, w, sh, t, f, r);
      a.release_to(mark);
    }
}

// FLUX8_FUSED_NORM_STATS: 0 makes every LayerNorm compute its own statistics again (the gated
// residuals before them write their outputs alone), to measure what the fusion gives. Unset or
// empty: on.
bool norm_stats_in_residual_from_environment() {
  const char* e = std::getenv("FLUX8_FUSED_NORM_STATS");
  const std::string v = e ? e : "";
  if (v.empty() || v == "1" || v == "true" || v == "on") return true;
  if (v == "0" || v == "false" || v == "off") return false;
  fail(
      "FLUX8_FUSED_NORM_STATS={}: expected 1 (gated residuals write the next LayerNorm's statistics, the "
      "default) or 0",
      v);
}

}  // namespace

BlockRecompute RecomputePolicy::saved_by_block(int64_t index) const {
  const bool all = elementwise;
  switch (of_block(index)) {
    case Recompute::none: return {all, all, all};
    case Recompute::selective: return {true, true, all};
    case Recompute::full: return {};
  }
  return {};
}

Recompute recompute_from_name(const std::string& name) {
  if (name == "none") return Recompute::none;
  if (name == "selective") return Recompute::selective;
  if (name == "full") return Recompute::full;
  fail("recompute_granularity '{}': choose none, selective or full", name);
}

FluxModel::FluxModel(const FluxConfig& cfg, Backend& backend, DType dtype, const Fp8Config* fp8,
                     RecomputePolicy recompute, TensorParallel tp, Backend* masters, MasterShards shards)
    : cfg_(cfg), be_(backend), tp_(tp), dtype_(dtype), act_dtype_(dtype), heads_dtype_(dtype), recompute_(recompute) {
  cfg_.validate("model config");
  widths_ = BlockWidths::of(cfg_, tp_.size());
  norm_stats_in_residual_ = norm_stats_in_residual_from_environment();
  act_dtype_ = be_.activation_dtype(dtype_);
  heads_dtype_ = be_.attention_heads_dtype(act_dtype_, cfg_.head_dim());
  // Refusals before the first allocation: the destructor does not run for a constructor that throws.
  if (fp8 && fp8->enabled) {
    if (dtype_ != DType::f32) fail("FP8 training runs the model in f32 (the CPU emulation's working type)");
    check_fp8_tensor_parallel(cfg_, *fp8, tp_.size());
  }
  params_ = std::make_unique<ParamStore>(cfg_, be_, dtype_, tp_.rank(), tp_.size(), masters, std::move(shards));
  for (int64_t i = 0; i < cfg_.num_double_blocks; ++i) double_params_.push_back(DoubleBlockParams::bind(*params_, i));
  for (int64_t i = 0; i < cfg_.num_single_blocks; ++i) single_params_.push_back(SingleBlockParams::bind(*params_, i));
  if (tp_.sharded()) bind_partial_grads();
  plan_final_parts();
  if (fp8 && fp8->enabled) {
    fp8_ = std::make_unique<Fp8Runtime>(*fp8, be_, tp_);
    std::vector<LinearSite*> all;
    const int64_t blocks = cfg_.num_blocks();
    int64_t index = 0;
    // The block's attention runs in FP8 where its Linears do and fp8_dot_product_attention is
    // on: `attention` gets its Fp8Runtime index.
    auto add_block = [&](std::vector<LinearSite*> sites, int& attention, const std::string& name) {
      const bool in_fp8 = fp8->block_in_fp8(index++, blocks);
      for (size_t k = 0; k < sites.size(); ++k) {
        const bool modulation = k == 0 || (sites.size() == 10 && k == 5);  // each stream's first site
        if (in_fp8 && (!modulation || fp8->modulation)) fp8_->add_site(*sites[k]);
        all.push_back(sites[k]);
      }
      if (in_fp8 && fp8->dot_product_attention) attention = fp8_->add_attention(name + ".attn");
    };
    for (size_t i = 0; i < double_params_.size(); ++i)
      add_block(double_params_[i].sites(), double_params_[i].fp8_attention, fmt::format("double_blocks.{}", i));
    for (size_t i = 0; i < single_params_.size(); ++i)
      add_block(single_params_[i].sites(), single_params_[i].fp8_attention, fmt::format("single_blocks.{}", i));
    fp8_->allocate_weight_casts(all);
    if (params_->masters_sharded()) params_->set_cast_forms(fp8_->cast_forms(*params_));
  }
  // Every Linear weight whose GEMMs run on the backend's weight operand type (all but the FP8
  // sites' weights) keeps a per-step copy in that type (ParamStore::operand). With bf16
  // activations so does every Linear bias: the GEMMs' bias epilogues add a bf16 bias to a bf16
  // output (ParamStore::bias_operand), which would otherwise be rounded per call — a conversion
  // launch before each of ~40 GEMMs a step.
  std::unordered_set<std::string> fp8_weights;
  if (fp8_)
    for (const LinearSite* s : fp8_->sites()) fp8_weights.insert(s->name + ".weight");
  const bool bf16_outputs = act_dtype_ == DType::bf16;
  std::vector<std::string> operand_copies;
  for (const ParamInfo& p : params_->layout().params())
    if ((p.linear_weight && !fp8_weights.contains(p.name)) || (p.linear_bias && bf16_outputs))
      operand_copies.push_back(p.name);
  params_->use_operand_copies(operand_copies);
}

void FluxModel::before_optimizer_step() {
  if (!fp8_) return;
  fp8_->end_step();
  fp8_->weights_changing();
}

std::vector<Backend::ParamCast> FluxModel::weight_casts() {
  return fp8_ ? fp8_->weight_casts(*params_) : std::vector<Backend::ParamCast>{};
}

void FluxModel::after_optimizer_step(bool casts_written, bool applied) {
  if (!fp8_) return;
  // Sharded masters: an update writes the casts with the forms (ParamStore::CastForms); a step
  // without one still moved the scales, so every rank casts its weights again now — a forward
  // one rank runs alone must find them current.
  if (!applied) params_->rewrite_cast_forms();
  fp8_->weights_updated(casts_written);
}

FluxModel::~FluxModel() {
  if (partial_grads_) be_.release(partial_grads_);
}

void FluxModel::bind_partial_grads() {
  std::vector<ScaleParam*> scales;
  for (DoubleBlockParams& d : double_params_)
    for (DoubleStreamParams* p : {&d.txt, &d.img}) scales.insert(scales.end(), {&p->q_norm, &p->k_norm});
  for (SingleBlockParams& p : single_params_) scales.insert(scales.end(), {&p.q_norm, &p.k_norm});
  // The scales are every tensor whose gradient is partial per rank: a layout that marks another
  // would leave it unreduced.
  size_t marked = 0;
  for (const ParamInfo& p : params_->layout().params()) marked += p.shard.reduce_grad ? 1 : 0;
  FLUX8_CHECK(marked == scales.size(), "{} tensors with partial gradients, {} QK-norm scales", marked, scales.size());
  const DType t = params_->grad_dtype();
  const int64_t D = cfg_.head_dim(), n = static_cast<int64_t>(scales.size()) * D;
  partial_grads_ = be_.allocate(static_cast<size_t>(n) * dtype_size(t));
  partial_flat_ = Tensor(partial_grads_, t, Shape{n});
  for (size_t i = 0; i < scales.size(); ++i) {
    ScaleParam& s = *scales[i];
    const Tensor part(static_cast<char*>(partial_grads_) + i * static_cast<size_t>(D) * dtype_size(t), t, Shape{D});
    partial_.push_back({s.ds, part});
    s.ds = part;
    s.store = nullptr;  // the part is zeroed at the start of every backward: prepare_grad has nothing to do
  }
}

void FluxModel::reduce_partial_grads(size_t first, size_t count) {
  if (count == 0) return;
  const int64_t D = cfg_.head_dim();
  const size_t es = dtype_size(partial_flat_.dtype);
  tp_.all_reduce(Tensor(static_cast<char*>(partial_flat_.data) + first * static_cast<size_t>(D) * es,
                        partial_flat_.dtype, Shape{static_cast<int64_t>(count) * D}));
  for (size_t i = first; i < first + count; ++i) {
    const PartialGrad& g = partial_[i];
    if (params_->first_write(g.grad))
      be_.copy(g.grad, g.part);
    else
      be_.accumulate(g.grad, g.part);
  }
}

void FluxModel::plan_final_parts() {
  // A parameter's part: its block ("double_blocks.3"), the final layer, the input Linears, or its
  // embedder ("time_in").
  const auto part_of = [](const std::string& name) {
    for (const char* blocks : {"double_blocks.", "single_blocks."})
      if (name.starts_with(blocks)) return name.substr(0, name.find('.', std::string_view(blocks).size()));
    if (name.starts_with("img_in.") || name.starts_with("txt_in.")) return std::string("inputs");
    return name.substr(0, name.find('.'));
  };
  const std::vector<ParamInfo>& params = params_->layout().params();
  for (size_t i = 0; i < params.size(); ++i) final_parts_[part_of(params[i].name)].params.push_back(i);
  // The blocks' parts by index, with their QK-norm scales in partial_ (bind_partial_grads's order:
  // each double block's txt and img q and k, then each single block's q and k).
  const auto take_block = [&](const char* blocks, size_t i, size_t first, size_t count) {
    const auto at = final_parts_.find(fmt::format("{}.{}", blocks, i));
    FLUX8_CHECK(at != final_parts_.end(), "no parameters of {}.{}", blocks, i);
    FinalPart p = std::move(at->second);
    final_parts_.erase(at);
    if (!partial_.empty()) p.partial_first = first, p.partial_count = count;
    return p;
  };
  const size_t nd = double_params_.size();
  for (size_t i = 0; i < nd; ++i) double_parts_.push_back(take_block("double_blocks", i, 4 * i, 4));
  for (size_t i = 0; i < single_params_.size(); ++i)
    single_parts_.push_back(take_block("single_blocks", i, 4 * nd + 2 * i, 2));
}

void FluxModel::report_final(FinalGradients* final, const FinalPart& part) {
  if (!final) return;
  reduce_partial_grads(part.partial_first, part.partial_count);
  final->gradients_final(part.params);
}

void FluxModel::check_no_step_graph() const {
  if (tp_.sharded() && dynamic_cast<const StepGraph*>(be_.interceptor()))
    fail(
        "cuda_graph with tensor_model_parallel_size {}: a step graph cannot hold the tensor-parallel collectives "
        "between the blocks' ops; set cuda_graph: false",
        tp_.size());
}

BlockContext FluxModel::block_context(const Tensor& d_silu_vec) {
  const ModelSaved& s = *saved_;
  return BlockContext{be_,        cfg_,       shape_,     act_dtype_,   scratch_arena_,          s.pe,
                      s.silu_vec, d_silu_vec, fp8_.get(), heads_dtype_, norm_stats_in_residual_, widths_,
                      tp_};
}

ActivationEstimate FluxModel::estimate_activations(const FluxConfig& cfg, StepShape shape, RecomputePolicy recompute,
                                                   int tp_size, const Fp8Config* fp8) {
  const BlockWidths w = BlockWidths::of(cfg, tp_size);
  Arena saved;  // measuring arenas
  // BF16 plan: default sites are not FP8.
  const std::vector<DoubleBlockParams> dp(static_cast<size_t>(cfg.num_double_blocks));
  const std::vector<SingleBlockParams> sp(static_cast<size_t>(cfg.num_single_blocks));
  ModelSaved::allocate(saved, cfg, w, shape, DType::f32, DType::f32, DType::f32, dp, sp, nullptr, recompute);
  // The same with every block's attention in FP8 (its q, k, v, o kept as FP8 codes).
  Arena saved_fp8_attention;
  std::vector<DoubleBlockParams> dp8 = dp;
  std::vector<SingleBlockParams> sp8 = sp;
  for (DoubleBlockParams& p : dp8) p.fp8_attention = 0;
  for (SingleBlockParams& p : sp8) p.fp8_attention = 0;
  ModelSaved::allocate(saved_fp8_attention, cfg, w, shape, DType::f32, DType::f32, DType::f32, dp8, sp8, nullptr,
                       recompute);
  Fp8Config linears = fp8 ? *fp8 : Fp8Config{};
  linears.enabled = true;
  linears.dot_product_attention = false;
  Fp8Config attention = linears;
  attention.dot_product_attention = true;
  auto scratch = [&](const Fp8Config* blocks) {
    ActivationEstimate::Scratch s;
    for (const DType t : {DType::bf16, DType::f32}) {
      Arena a;
      plan_model_scratch(a, cfg, w, shape, t, blocks, recompute);
      (t == DType::bf16 ? s.bf16 : s.f32) = static_cast<double>(a.peak());
    }
    return s;
  };
  ActivationEstimate e;
  e.saved = saved.peak_usage();
  e.saved_fp8_attention = saved_fp8_attention.peak_usage();
  e.workspace = scratch(nullptr);
  e.workspace_fp8 = scratch(&linears);
  e.workspace_fp8_attention = scratch(&attention);
  return e;
}

void FluxModel::plan(StepShape s) {
  Arena saved, scratch;
  ModelSaved::allocate(saved, cfg_, widths_, s, dtype_, act_dtype_, heads_dtype_, double_params_, single_params_,
                       fp8_.get(), recompute_);
  plan_model_scratch(scratch, cfg_, widths_, s, act_dtype_, fp8_ ? &fp8_->config() : nullptr, recompute_);
  saved_arena_.reserve(be_, saved.peak());
  scratch_arena_.reserve(be_, scratch.peak());
  planned_ = s;
}

static void check_input(const Tensor& t, const char* name, Shape expected) {
  if (!t.defined()) fail("model input '{}' is missing (expected shape {})", name, expected.str());
  if (t.shape != expected) fail("model input '{}' has shape {}, expected {}", name, t.shape.str(), expected.str());
}

Tensor FluxModel::forward(const FluxInputs& in) {
  const FluxConfig& c = cfg_;
  if (!in.img.defined() || in.img.shape.rank != 3 || !in.txt.defined() || in.txt.shape.rank != 3)
    fail("model inputs 'img' and 'txt' must be rank-3 tensors [batch, tokens, features]");
  const StepShape sh{in.img.shape[0], in.txt.shape[1], in.img.shape[1]};
  const int64_t B = sh.batch, H = c.hidden_size;
  check_input(in.img, "img", Shape{B, sh.img_tokens, c.in_channels});
  check_input(in.txt, "txt", Shape{B, sh.txt_tokens, c.context_dim});
  check_input(in.img_ids, "img_ids", Shape{B, sh.img_tokens, 3});
  check_input(in.txt_ids, "txt_ids", Shape{B, sh.txt_tokens, 3});
  check_input(in.timesteps, "timesteps", Shape{B});
  check_input(in.y, "y", Shape{B, c.vec_dim});
  if (c.guidance_embed) check_input(in.guidance, "guidance", Shape{B});
  params_->refresh_device_forms();  // offloaded masters written by init or a load since

  if (sh.batch > planned_.batch || sh.txt_tokens > planned_.txt_tokens || sh.img_tokens > planned_.img_tokens ||
      sh.tokens() > planned_.tokens())
    plan(StepShape{std::max(sh.batch, planned_.batch), std::max(sh.txt_tokens, planned_.txt_tokens),
                   std::max(sh.img_tokens, planned_.img_tokens)});
  check_no_step_graph();
  shape_ = sh;
  inputs_ = in;
  saved_arena_.reset();
  scratch_arena_.reset();
  saved_ =
      std::make_unique<ModelSaved>(ModelSaved::allocate(saved_arena_, c, widths_, sh, dtype_, act_dtype_, heads_dtype_,
                                                        double_params_, single_params_, fp8_.get(), recompute_));
  ModelSaved& s = *saved_;
  ParamStore& P = *params_;
  // The inputs in the activation type (a conversion when it is not the model's).
  auto as_activation = [&](const Tensor& converted, const Tensor& input) {
    if (!converted.defined()) return input;
    be_.copy(converted, input);
    return converted;
  };
  const Tensor x_img = as_activation(s.img_in, in.img), x_txt = as_activation(s.txt_in, in.txt);
  const Tensor x_y = as_activation(s.y_in, in.y);

  embed_conditioning(in, x_y);

  const LinearSite img_in = LinearSite::bind(P, "img_in"), txt_in = LinearSite::bind(P, "txt_in");
  be_.linear(s.img_at[0], x_img, P.operand(img_in.w), P.bias_operand(img_in.b, s.img_at[0]));
  be_.linear(s.txt_at[0], x_txt, P.operand(txt_in.w), P.bias_operand(txt_in.b, s.txt_at[0]));
  be_.concat_tokens(s.ids, in.txt_ids, in.img_ids);
  be_.rope_table(s.pe, s.ids, c.axes_dim, c.rope_theta);

  run_blocks();
  be_.split_tokens(Tensor{}, s.img, s.z_at.back());  // drop the text tokens

  // Final layer: (shift, scale) = chunk(adaLN(SiLU(vec))), shift first.
  const LinearSite ada = LinearSite::bind(P, "final_layer.adaLN_modulation.1");
  const LinearSite lin = LinearSite::bind(P, "final_layer.linear");
  be_.linear(s.final_mod, s.silu_vec, P.operand(ada.w), P.bias_operand(ada.b, s.final_mod));
  be_.layernorm_modulate(s.final_xm, s.final_mean, s.final_rstd, s.img, s.final_mod.cols_slice(0, H),
                         s.final_mod.cols_slice(H, H), c.layernorm_eps);
  be_.linear(s.pred, s.final_xm, P.operand(lin.w), P.bias_operand(lin.b, s.pred));
  if (!s.pred_out.defined()) return s.pred;
  be_.copy(s.pred_out, s.pred);
  return s.pred_out;
}

// Conditioning vector: vec = time_in(emb(t)) [+ guidance_in(emb(g))] + vector_in(y).
void FluxModel::embed_conditioning(const FluxInputs& in, const Tensor& x_y) {
  ModelSaved& s = *saved_;
  ParamStore& P = *params_;
  const int64_t B = shape_.batch, H = cfg_.hidden_size;
  auto run_embedder = [&](const std::string& name, MlpEmbedderSaved& e, Tensor x, Tensor out) {
    const MlpEmbedder m = MlpEmbedder::bind(P, name);
    be_.linear(e.hidden, x, P.operand(m.in_layer.w), P.bias_operand(m.in_layer.b, e.hidden));
    be_.silu(e.act, e.hidden);
    be_.linear(out, e.act, P.operand(m.out_layer.w), P.bias_operand(m.out_layer.b, out));
  };
  const size_t mark = scratch_arena_.mark();
  Tensor tmp = scratch_arena_.alloc(act_dtype_, Shape{B, H}, SlotKind::workspace);
  be_.timestep_embedding(s.time.x, in.timesteps, kTimeFactor, kMaxPeriod);
  run_embedder("time_in", s.time, s.time.x, s.vec);
  if (cfg_.guidance_embed) {
    be_.timestep_embedding(s.guidance.x, in.guidance, kTimeFactor, kMaxPeriod);
    run_embedder("guidance_in", s.guidance, s.guidance.x, tmp);
    be_.accumulate(s.vec, tmp);
  }
  run_embedder("vector_in", s.vector, x_y, tmp);
  be_.accumulate(s.vec, tmp);
  be_.silu(s.silu_vec, s.vec);
  scratch_arena_.release_to(mark);
}

// The double blocks on the two streams, then the single blocks on the joint sequence.
void FluxModel::run_blocks() {
  const StepShape sh = shape_;
  const int64_t B = sh.batch;
  ModelSaved& s = *saved_;
  const BlockContext ctx = block_context(Tensor{});
  const int64_t nd = static_cast<int64_t>(double_params_.size());
  auto full_double = [&](size_t i) { return recompute_.of_block(static_cast<int64_t>(i)) == Recompute::full; };
  auto full_single = [&](size_t j) { return recompute_.of_block(nd + static_cast<int64_t>(j)) == Recompute::full; };
  // Each block's output residuals write the row statistics of the next block's LayerNorm where
  // it runs inside an FP8 cast (not into a fully recomputed block: its saved statistics are
  // allocated only when it runs). The last double block's two streams write theirs into the
  // first single block's, at their rows of the joint sequence (text first).
  const bool hand_over = norm_stats_in_residual_;
  const int64_t Lt = sh.txt_tokens, Li = sh.img_tokens, L = sh.tokens();
  const auto next_single = [&](size_t i) {
    SingleBlockSaved& n = s.singles[i];
    if (!layernorm_in_cast(single_params_[i].linear1, fp8_.get(), n.zm)) return NormStatsOut{};
    n.ln_ready = true;
    return NormStatsOut{stats_rows(n.ln_mean, B, L), stats_rows(n.ln_rstd, B, L)};
  };
  const auto next_stream = [&](const DoubleStreamParams& p, DoubleStreamSaved& n, int64_t Ls) {
    if (!layernorm_in_cast(p.qkv, fp8_.get(), n.xm1)) return NormStatsOut{};
    n.ln1_ready = true;
    return NormStatsOut{stats_rows(n.ln1_mean, B, Ls), stats_rows(n.ln1_rstd, B, Ls)};
  };
  for (size_t i = 0; i < double_params_.size(); ++i) {
    if (!full_double(i)) {
      DoubleBlockSaved& blk = s.doubles[i];
      NormStatsOut next_txt, next_img;
      if (hand_over && i + 1 < double_params_.size()) {
        if (!full_double(i + 1)) {
          next_txt = next_stream(double_params_[i + 1].txt, s.doubles[i + 1].txt, Lt);
          next_img = next_stream(double_params_[i + 1].img, s.doubles[i + 1].img, Li);
        }
      } else if (hand_over && !single_params_.empty() && !full_single(0)) {
        if (const NormStatsOut joint = next_single(0); joint.defined()) {  // the streams' columns of it
          next_txt = {joint.mean.cols_slice(0, Lt), joint.rstd.cols_slice(0, Lt)};
          next_img = {joint.mean.cols_slice(Lt, Li), joint.rstd.cols_slice(Lt, Li)};
        }
      }
      const size_t mark = scratch_arena_.mark();
      if (blk.recompute.heads)
        blk.place_recomputed(scratch_arena_, widths_, sh, heads_dtype_);  // q, k, v: this forward only
      double_block_forward(ctx, double_params_[i], blk, s.txt_at[i], s.img_at[i], s.txt_at[i + 1], s.img_at[i + 1],
                           next_txt, next_img);
      scratch_arena_.release_to(mark);
      if (blk.recompute.heads) blk.forget_recomputed();
      continue;
    }
    DoubleBlockSaved blk =
        DoubleBlockSaved::allocate(saved_arena_, widths_, sh, act_dtype_, heads_dtype_, double_params_[i], fp8_.get());
    double_block_forward(ctx, double_params_[i], blk, s.txt_at[i], s.img_at[i], s.txt_at[i + 1], s.img_at[i + 1]);
    saved_arena_.release_to(s.block_region);
  }
  be_.concat_tokens(s.z_at[0], s.txt_at.back(), s.img_at.back());
  for (size_t i = 0; i < single_params_.size(); ++i) {
    if (!full_single(i)) {
      SingleBlockSaved& blk = s.singles[i];
      const NormStatsOut next =
          hand_over && i + 1 < single_params_.size() && !full_single(i + 1) ? next_single(i + 1) : NormStatsOut{};
      const size_t mark = scratch_arena_.mark();
      if (blk.recompute.heads) blk.place_recomputed(scratch_arena_, widths_, sh, heads_dtype_);
      single_block_forward(ctx, single_params_[i], blk, s.z_at[i], s.z_at[i + 1], next);
      scratch_arena_.release_to(mark);
      if (blk.recompute.heads) blk.forget_recomputed();
      continue;
    }
    SingleBlockSaved blk =
        SingleBlockSaved::allocate(saved_arena_, widths_, sh, act_dtype_, heads_dtype_, single_params_[i], fp8_.get());
    single_block_forward(ctx, single_params_[i], blk, s.z_at[i], s.z_at[i + 1]);
    saved_arena_.release_to(s.block_region);
  }
}

void FluxModel::backward(const Tensor& dpred, FinalGradients* final) {
  if (!saved_) fail("FluxModel::backward called without a forward");
  check_no_step_graph();
  const FluxConfig& c = cfg_;
  const StepShape sh = shape_;
  const int64_t B = sh.batch, H = c.hidden_size;
  if (dpred.shape != saved_->pred.shape)
    fail("gradient of the prediction has shape {}, expected {}", dpred.shape.str(), saved_->pred.shape.str());
  ModelSaved& s = *saved_;
  ParamStore& P = *params_;
  Arena& a = scratch_arena_;
  a.reset();
  const DType t = act_dtype_;
  Tensor dpred_act = dpred;
  if (t != dpred.dtype) {
    dpred_act = a.alloc(t, dpred.shape, SlotKind::workspace);
    be_.copy(dpred_act, dpred);
  }
  Tensor dtxt = a.alloc(t, Shape{B, sh.txt_tokens, H}, SlotKind::workspace);
  Tensor dimg = a.alloc(t, Shape{B, sh.img_tokens, H}, SlotKind::workspace);
  Tensor dz = a.alloc(t, Shape{B, sh.tokens(), H}, SlotKind::workspace);
  Tensor dxm = a.alloc(t, Shape{B, sh.img_tokens, H}, SlotKind::workspace);
  Tensor dmod = a.alloc(t, Shape{B, 2 * H}, SlotKind::workspace);
  Tensor d_silu_vec = a.alloc(t, Shape{B, H}, SlotKind::workspace);
  Tensor dvec = a.alloc(t, Shape{B, H}, SlotKind::workspace);
  Tensor dact = a.alloc(t, Shape{B, H}, SlotKind::workspace);
  Tensor dhidden = a.alloc(t, Shape{B, H}, SlotKind::workspace);

  // Final layer.
  const LinearSite ada = LinearSite::bind(P, "final_layer.adaLN_modulation.1");
  const LinearSite lin = LinearSite::bind(P, "final_layer.linear");
  be_.linear_backward(dxm, lin.dw, lin.db, dpred_act, s.final_xm, P.operand(lin.w), false, lin.accumulate_grads());
  be_.layernorm_modulate_backward(dimg, dmod.cols_slice(0, H), dmod.cols_slice(H, H), dxm, s.img, s.final_mean,
                                  s.final_rstd, s.final_mod.cols_slice(H, H), false);
  linear_backward_params(be_, ada, d_silu_vec, dmod, s.silu_vec, P.operand(ada.w), false);
  report_final(final, final_parts_.at("final_layer"));

  // Single blocks on the joint sequence; the text tokens were dropped, so their gradient is 0.
  const BlockContext ctx = block_context(d_silu_vec);  // full recomputation re-runs block forwards
  if (partial_flat_.defined()) be_.fill(partial_flat_, 0.0);
  be_.fill(dtxt, 0.0);
  be_.concat_tokens(dz, dtxt, dimg);
  // Recompute::selective recomputes inside each block's backward; full re-runs whole blocks
  // here. Recomputed forwards cast with the step's scales and must not record amaxes or
  // statistics twice.
  const int64_t nd = static_cast<int64_t>(double_params_.size());
  for (size_t i = single_params_.size(); i-- > 0;) {
    const FinalPart& part = single_parts_[i];
    if (recompute_.of_block(nd + static_cast<int64_t>(i)) != Recompute::full) {
      single_block_backward(ctx, single_params_[i], s.singles[i], dz);
      report_final(final, part);
      continue;
    }
    SingleBlockSaved blk =
        SingleBlockSaved::allocate(saved_arena_, widths_, sh, t, heads_dtype_, single_params_[i], fp8_.get());
    {
      const NoFp8Recording quiet(fp8_.get());
      single_block_forward(ctx, single_params_[i], blk, s.z_at[i], s.z_at[i + 1]);
    }
    single_block_backward(ctx, single_params_[i], blk, dz);
    saved_arena_.release_to(s.block_region);
    report_final(final, part);
  }
  be_.split_tokens(dtxt, dimg, dz);
  for (size_t i = double_params_.size(); i-- > 0;) {
    const FinalPart& part = double_parts_[i];
    if (recompute_.of_block(static_cast<int64_t>(i)) != Recompute::full) {
      double_block_backward(ctx, double_params_[i], s.doubles[i], dtxt, dimg);
      report_final(final, part);
      continue;
    }
    DoubleBlockSaved blk =
        DoubleBlockSaved::allocate(saved_arena_, widths_, sh, t, heads_dtype_, double_params_[i], fp8_.get());
    {
      const NoFp8Recording quiet(fp8_.get());
      double_block_forward(ctx, double_params_[i], blk, s.txt_at[i], s.img_at[i], s.txt_at[i + 1], s.img_at[i + 1]);
    }
    double_block_backward(ctx, double_params_[i], blk, dtxt, dimg);
    saved_arena_.release_to(s.block_region);
    report_final(final, part);
  }

  const LinearSite img_in = LinearSite::bind(P, "img_in"), txt_in = LinearSite::bind(P, "txt_in");
  be_.linear_backward(Tensor{}, img_in.dw, img_in.db, dimg, s.img_in.defined() ? s.img_in : inputs_.img, img_in.w,
                      false, img_in.accumulate_grads());
  be_.linear_backward(Tensor{}, txt_in.dw, txt_in.db, dtxt, s.txt_in.defined() ? s.txt_in : inputs_.txt, txt_in.w,
                      false, txt_in.accumulate_grads());
  report_final(final, final_parts_.at("inputs"));

  // Conditioning vector: every embedder receives dvec.
  be_.silu_backward(dvec, d_silu_vec, s.vec, false);
  auto embedder_backward = [&](const std::string& name, const MlpEmbedderSaved& e, const Tensor& x) {
    const MlpEmbedder m = MlpEmbedder::bind(P, name);
    linear_backward_params(be_, m.out_layer, dact, dvec, e.act, P.operand(m.out_layer.w), false);
    be_.silu_backward(dhidden, dact, e.hidden, false);
    linear_backward_params(be_, m.in_layer, Tensor{}, dhidden, x, m.in_layer.w, false);
    P.flush_low_rank_copies();  // dact's and dhidden's rows, before the next embedder reuses them
    report_final(final, final_parts_.at(name));
  };
  embedder_backward("time_in", s.time, s.time.x);
  if (c.guidance_embed) embedder_backward("guidance_in", s.guidance, s.guidance.x);
  embedder_backward("vector_in", s.vector, s.y_in.defined() ? s.y_in : inputs_.y);
  if (!final) reduce_partial_grads(0, partial_.size());  // (with `final`: block by block)
  params_->finish_grads();                               // every gradient written (overwritten first, since zero_grads)
}

}  // namespace flux8
