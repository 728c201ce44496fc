#include "data/text_encoder.h"

#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace flux8 {
namespace {

// FNV-1a 64: a stable hash of the word's bytes (std::hash is not stable across libraries).
uint64_t word_hash(std::string_view word) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : word) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

enum Table : uint64_t { kTokenTable = 1, kPooledTable = 2 };

std::vector<float> table_row(uint64_t table, std::string_view word, int64_t dim) {
  const uint64_t stream = rng_stream(table, word_hash(word), word.size());
  std::vector<float> row(static_cast<size_t>(dim));
  for (int64_t j = 0; j < dim; ++j)
    row[static_cast<size_t>(j)] = rng_normal(DemoTextEncoder::kSeed, stream, static_cast<uint64_t>(j));
  return row;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

}  // namespace

DemoTextEncoder::DemoTextEncoder(int64_t text_seq_len, int64_t context_dim, int64_t vec_dim)
    : text_seq_len_(text_seq_len), context_dim_(context_dim), vec_dim_(vec_dim) {
  if (text_seq_len < 1 || context_dim < 1 || vec_dim < 1)
    fail(
        "demo text encoder: text_seq_len ({}), context_dim ({}) and vec_dim ({}) must all be "
        ">= 1; check the model config",
        text_seq_len, context_dim, vec_dim);
}

std::vector<std::string> DemoTextEncoder::words(std::string_view prompt) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : prompt) {
    if (is_space(c)) {
      if (!cur.empty()) out.push_back(std::move(cur));
      cur.clear();
    } else {
      cur.push_back(c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c);
    }
  }
  if (!cur.empty()) out.push_back(std::move(cur));
  return out;
}

std::vector<float> DemoTextEncoder::token_embedding(std::string_view word) const {
  return table_row(kTokenTable, word, context_dim_);
}

std::vector<float> DemoTextEncoder::pooled_embedding(std::string_view word) const {
  return table_row(kPooledTable, word, vec_dim_);
}

TextEncoding DemoTextEncoder::encode(std::string_view prompt) const {
  std::vector<std::string> ws = words(prompt);
  if (static_cast<int64_t>(ws.size()) > text_seq_len_) ws.resize(static_cast<size_t>(text_seq_len_));

  TextEncoding enc;
  enc.t5.shape = {text_seq_len_, context_dim_};
  enc.t5.data.assign(static_cast<size_t>(text_seq_len_ * context_dim_), 0.0f);
  enc.clip.shape = {vec_dim_};
  enc.clip.data.assign(static_cast<size_t>(vec_dim_), 0.0f);

  for (size_t i = 0; i < ws.size(); ++i) {
    const std::vector<float> tok = token_embedding(ws[i]);
    std::copy(tok.begin(), tok.end(), enc.t5.data.begin() + static_cast<std::ptrdiff_t>(i * tok.size()));
    const std::vector<float> pooled = pooled_embedding(ws[i]);
    for (size_t j = 0; j < pooled.size(); ++j) enc.clip.data[j] += pooled[j];
  }
  if (!ws.empty()) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(ws.size()));
    for (float& v : enc.clip.data) v *= scale;
  }
  return enc;
}

}  // namespace flux8
