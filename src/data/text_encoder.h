#pragma once
// The demo's built-in text encoder: a fixed bag of word embeddings standing in for T5 and
// CLIP, so the embedded demo trains and samples with no external model. Every word (known or
// not) maps to embeddings drawn from the counter-based RNG under a hash of the word, so the
// table needs no storage and any prompt encodes identically on every machine.
//
//   tokens    prompt lowercased (ASCII), split on whitespace; only the first text_seq_len
//             words are kept, the rest are dropped (like a tokenizer's max_length truncation)
//   "t5"      [text_seq_len, context_dim]: row i is word i's embedding, elements ~ N(0, 1)
//             (unit variance, the scale the txt_in projection's init assumes); rows after the
//             last word are zero
//   "clip"    [vec_dim]: sum over the kept words of a second per-word table (~ N(0, 1)),
//             divided by sqrt(word count) so its scale does not depend on caption length;
//             zero for a prompt without words
// The empty prompt (used for classifier-free guidance dropout) therefore encodes to zeros.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/sample.h"

namespace flux8 {

struct TextEncoding {
  HostTensor t5;    // [text_seq_len, context_dim]
  HostTensor clip;  // [vec_dim]
};

class DemoTextEncoder {
 public:
  // Fixed key of the word tables; changing it changes every embedding (and the manifest's
  // encoder name must change with it).
  static constexpr uint64_t kSeed = 0x666C7578385F7478ull;  // "flux8_tx"
  static constexpr const char* kName = "flux8-demo-words-v1";

  DemoTextEncoder(int64_t text_seq_len, int64_t context_dim, int64_t vec_dim);

  TextEncoding encode(std::string_view prompt) const;

  // Lowercased whitespace-separated words, all of them (before truncation).
  static std::vector<std::string> words(std::string_view prompt);
  // One word's rows of the two tables (the word as given, already lowercased).
  std::vector<float> token_embedding(std::string_view word) const;   // [context_dim]
  std::vector<float> pooled_embedding(std::string_view word) const;  // [vec_dim]

  int64_t text_seq_len() const { return text_seq_len_; }
  int64_t context_dim() const { return context_dim_; }
  int64_t vec_dim() const { return vec_dim_; }

 private:
  int64_t text_seq_len_, context_dim_, vec_dim_;
};

}  // namespace flux8
