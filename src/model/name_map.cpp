#include "model/name_map.h"

#include <map>

#include "core/error.h"

namespace flux8 {

namespace {

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// "double_blocks.3.img_attn.qkv.weight" -> block 3, rest "img_attn.qkv", suffix "weight"
struct Parsed {
  std::string group;  // "double_blocks", "single_blocks" or ""
  std::string index;
  std::string module;  // without group/index and without the last component
  std::string leaf;    // "weight", "bias", "scale"
};

Parsed parse(const std::string& name) {
  Parsed p;
  std::string rest = name;
  for (const char* g : {"double_blocks.", "single_blocks."}) {
    if (starts_with(rest, g)) {
      p.group = std::string(g, std::char_traits<char>::length(g) - 1);
      rest = rest.substr(p.group.size() + 1);
      const size_t dot = rest.find('.');
      p.index = rest.substr(0, dot);
      rest = rest.substr(dot + 1);
    }
  }
  const size_t last = rest.rfind('.');
  p.module = rest.substr(0, last);
  p.leaf = rest.substr(last + 1);
  return p;
}

}  // namespace

std::vector<NamePiece> diffusers_pieces(const ParamInfo& param, const FluxConfig& c) {
  const int64_t H = c.hidden_size, M = c.mlp_hidden();
  const Parsed p = parse(param.name);
  const std::string leaf = p.leaf == "scale" ? "weight" : p.leaf;
  const int64_t rows = param.shape[0];
  auto whole = [&](const std::string& d) { return std::vector<NamePiece>{{d + "." + leaf, 0, 0, rows}}; };
  // Consecutive row blocks of the reference tensor, each a whole diffusers tensor.
  auto stacked = [&](const std::string& prefix, std::vector<std::pair<std::string, int64_t>> parts) {
    std::vector<NamePiece> out;
    int64_t row = 0;
    for (auto& [d, n] : parts) {
      out.push_back({prefix + d + "." + leaf, 0, row, n});
      row += n;
    }
    FLUX8_CHECK(row == rows, "name map rows of {}", param.name);
    return out;
  };

  if (p.group.empty()) {
    static const std::map<std::string, std::string> top = {
        {"img_in", "x_embedder"},
        {"txt_in", "context_embedder"},
        {"time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"},
        {"time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"},
        {"vector_in.in_layer", "time_text_embed.text_embedder.linear_1"},
        {"vector_in.out_layer", "time_text_embed.text_embedder.linear_2"},
        {"guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1"},
        {"guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2"},
        {"final_layer.linear", "proj_out"},
    };
    if (p.module == "final_layer.adaLN_modulation.1") {
      // reference [shift; scale] <- diffusers norm_out.linear [scale; shift]
      const std::string d = "norm_out.linear." + leaf;
      return {{d, H, 0, H}, {d, 0, H, H}};
    }
    auto it = top.find(p.module);
    if (it == top.end()) fail("name map: no diffusers name for '{}'", param.name);
    return whole(it->second);
  }

  if (p.group == "double_blocks") {
    const std::string b = "transformer_blocks." + p.index + ".";
    static const std::map<std::string, std::string> dbl = {
        {"img_mod.lin", "norm1.linear"},
        {"txt_mod.lin", "norm1_context.linear"},
        {"img_attn.norm.query_norm", "attn.norm_q"},
        {"img_attn.norm.key_norm", "attn.norm_k"},
        {"txt_attn.norm.query_norm", "attn.norm_added_q"},
        {"txt_attn.norm.key_norm", "attn.norm_added_k"},
        {"img_attn.proj", "attn.to_out.0"},
        {"txt_attn.proj", "attn.to_add_out"},
        {"img_mlp.0", "ff.net.0.proj"},
        {"img_mlp.2", "ff.net.2"},
        {"txt_mlp.0", "ff_context.net.0.proj"},
        {"txt_mlp.2", "ff_context.net.2"},
    };
    if (p.module == "img_attn.qkv") return stacked(b + "attn.", {{"to_q", H}, {"to_k", H}, {"to_v", H}});
    if (p.module == "txt_attn.qkv")
      return stacked(b + "attn.", {{"add_q_proj", H}, {"add_k_proj", H}, {"add_v_proj", H}});
    auto it = dbl.find(p.module);
    if (it == dbl.end()) fail("name map: no diffusers name for '{}'", param.name);
    return whole(b + it->second);
  }

  const std::string b = "single_transformer_blocks." + p.index + ".";
  if (p.module == "linear1") return stacked(b, {{"attn.to_q", H}, {"attn.to_k", H}, {"attn.to_v", H}, {"proj_mlp", M}});
  static const std::map<std::string, std::string> sgl = {
      {"linear2", "proj_out"},
      {"norm.query_norm", "attn.norm_q"},
      {"norm.key_norm", "attn.norm_k"},
      {"modulation.lin", "norm.linear"},
  };
  auto it = sgl.find(p.module);
  if (it == sgl.end()) fail("name map: no diffusers name for '{}'", param.name);
  return whole(b + it->second);
}

std::vector<DiffusersTensor> diffusers_tensors(const ParamLayout& layout, const FluxConfig& cfg) {
  std::vector<DiffusersTensor> out;
  std::map<std::string, size_t> index;
  for (const ParamInfo& p : layout.params()) {
    for (const NamePiece& piece : diffusers_pieces(p, cfg)) {
      auto [it, fresh] = index.emplace(piece.diffusers, out.size());
      if (fresh) {
        Shape s = p.shape;
        s.d[0] = 0;
        out.push_back({piece.diffusers, s});
      }
      out[it->second].shape.d[0] += piece.rows;
    }
  }
  return out;
}

}  // namespace flux8
