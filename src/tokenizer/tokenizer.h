// Tokenizer: text <-> token ids, byte-for-byte identical to llama.cpp for the
// vocab types and pre-tokenizers it supports.
//
//   * Byte-level BPE (tokenizer.ggml.model = "gpt2"): GPT-2 byte-to-unicode
//     mapping, merges ranked by their order, pre-tokenizer chosen by
//     tokenizer.ggml.pre (see pretokenizer.h).
//   * SentencePiece-style BPE (tokenizer.ggml.model = "llama"): merges driven
//     by token scores, U+2581 as the space marker, <0xXX> byte fallback,
//     optional space prefix.
//
// The core is built from a plain VocabData (tests build one by hand;
// load_vocab_from_gguf fills one from a model file).
//
// Thread-safety: a constructed Tokenizer is immutable; all const methods may
// be called concurrently.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/result.h"
#include "tokenizer/pretokenizer.h"

namespace kvstack {

class GgufFile;

using TokenId = int32_t;
constexpr TokenId kNoToken = -1;

enum class VocabType { kBpe, kSpm };

// tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// Per-token attribute bits (llama.cpp's llama_token_attr values).
enum TokenAttr : uint32_t {
  kAttrUndefined = 0,
  kAttrUnknown = 1u << 0,
  kAttrUnused = 1u << 1,
  kAttrNormal = 1u << 2,
  kAttrControl = 1u << 3,
  kAttrUserDefined = 1u << 4,
  kAttrByte = 1u << 5,
  kAttrLstrip = 1u << 7,  // special-token match eats whitespace on its left
  kAttrRstrip = 1u << 8,  // ... and on its right
};

// Everything the tokenizer needs, as stored in GGUF metadata.
struct VocabData {
  std::string source;  // names the origin in error messages (file path)
  VocabType type = VocabType::kBpe;
  std::string pre;                   // tokenizer.ggml.pre; "" = "default" (BPE only)
  std::vector<std::string> tokens;   // [n_vocab] token text (GPT-2 byte chars / U+2581)
  std::vector<int32_t> token_types;  // [n_vocab] TokenType, or empty = all normal
  std::vector<float> scores;         // [n_vocab] SPM merge priority, or empty = all 0
  std::vector<std::string> merges;   // BPE "left right"; rank = index
  // Special ids from metadata; unset means the vocab type's default
  // (BPE: bos = eos = 11 if in range; SPM: bos 1, eos 2, unk 0). An id out of
  // range is ignored with the default kept, as llama.cpp does.
  std::optional<int64_t> bos_id, eos_id, eot_id, eom_id, unk_id, sep_id, pad_id;
  std::optional<bool> add_bos, add_eos, add_space_prefix;
};

// Reads the tokenizer.* keys. Errors (kCorruptFile / kUnsupported) name the
// file and the key.
Result<VocabData> load_vocab_from_gguf(const GgufFile& file);

struct TokenizeOptions {
  bool add_special = true;     // BOS/EOS as the vocab's add_bos/add_eos say
  bool parse_special = false;  // text of control/unknown tokens -> that token
};

struct DetokenizeOptions {
  bool remove_special = false;  // drop a leading BOS / trailing EOS the vocab adds
  bool render_special = false;  // emit the text of control/unknown tokens
};

class Tokenizer {
 public:
  static Result<Tokenizer> create(VocabData data);
  static Result<Tokenizer> load_from_gguf(const GgufFile& file);

  Tokenizer(Tokenizer&&) noexcept = default;
  Tokenizer& operator=(Tokenizer&&) noexcept = default;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // llama_tokenize(text, add_special, parse_special). Never fails: invalid
  // UTF-8 bytes are tokenized as U+FFFD.
  std::vector<TokenId> tokenize(std::string_view text, TokenizeOptions options = {}) const;

  // llama_token_to_piece: the bytes of one token (possibly a partial UTF-8
  // character). Control/unknown tokens are empty unless render_special;
  // `lstrip` drops up to that many leading spaces. REQUIRES: is_valid(id).
  std::string token_to_piece(TokenId id, bool render_special = false, int lstrip = 0) const;
  void append_piece(TokenId id, bool render_special, std::string& out) const;

  // llama_detokenize: pieces concatenated, plus the vocab's space clean-up.
  // Errors (kInvalidArgument) on an id outside [0, n_vocab).
  Result<std::string> detokenize(std::span<const TokenId> ids,
                                 DetokenizeOptions options = {}) const;

  // Error naming the first id outside [0, n_vocab), if any.
  Status validate(std::span<const TokenId> ids) const;

  int32_t n_vocab() const { return static_cast<int32_t>(text_.size()); }
  bool is_valid(TokenId id) const { return id >= 0 && id < n_vocab(); }
  VocabType type() const { return type_; }
  PreTokenizer pre_tokenizer() const { return pre_.kind; }
  const std::string& pre_name() const { return pre_name_; }

  TokenId bos() const { return bos_; }  // kNoToken if none
  TokenId eos() const { return eos_; }
  TokenId eot() const { return eot_; }
  TokenId eom() const { return eom_; }
  TokenId unk() const { return unk_; }
  TokenId pad() const { return pad_; }
  TokenId sep() const { return sep_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  bool add_space_prefix() const { return add_space_prefix_; }

  // End-of-generation tokens: eos, eot, eom and the end-of-turn-looking
  // tokens llama.cpp recognises by text.
  bool is_eog(TokenId id) const { return eog_.count(id) != 0; }
  const std::set<TokenId>& eog_ids() const { return eog_; }

  // REQUIRES: is_valid(id).
  const std::string& token_text(TokenId id) const { return text_[id]; }
  uint32_t token_attr(TokenId id) const { return attr_[id]; }
  bool is_control(TokenId id) const { return (attr_[id] & kAttrControl) != 0; }
  float token_score(TokenId id) const { return score_[id]; }

  // Id of the token whose text is exactly `text`, or kNoToken.
  TokenId find_token(std::string_view text) const;

 private:
  Tokenizer() = default;

  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using TextMap = std::unordered_map<std::string, TokenId, StringHash, std::equal_to<>>;

  // A BPE merge result: rank orders merges, `merged` is the symbol id of the
  // concatenation. Symbol ids are token ids, or n_vocab + i for the i-th
  // merge string that is not itself a token (extra_text_).
  struct Merge {
    int32_t rank;
    int32_t merged;
  };

  Status init(VocabData data);
  void tokenize_bpe_fragment(std::string_view text, std::vector<TokenId>& out) const;
  void tokenize_spm_fragment(std::string_view text, std::vector<TokenId>& out) const;
  void bpe_word(std::string_view word_bytes, std::vector<TokenId>& out) const;
  TokenId byte_fallback_token(uint8_t byte) const;
  std::string make_piece(TokenId id) const;
  int32_t symbol_id(std::string_view text) const;
  const std::string& symbol_text(int32_t sym) const;

  VocabType type_ = VocabType::kBpe;
  PreTokenizerInfo pre_;
  std::string pre_name_;
  std::vector<std::string> text_;   // [n_vocab]
  std::vector<uint32_t> attr_;      // [n_vocab] TokenAttr bits
  std::vector<float> score_;        // [n_vocab]
  std::vector<std::string> piece_;  // [n_vocab] token_to_piece(id, render_special=true)
  TextMap token_to_id_;

  // BPE merges keyed by (left symbol << 32 | right symbol).
  std::unordered_map<uint64_t, Merge> merges_;
  std::vector<std::string> extra_text_;  // symbol texts beyond the vocab
  TextMap extra_to_sym_;
  int32_t byte_symbol_[256] = {};  // symbol of each byte's GPT-2 character, or -1

  // Control / user-defined / unknown tokens, longest text first.
  std::vector<TokenId> special_tokens_;

  TokenId bos_ = kNoToken, eos_ = kNoToken, eot_ = kNoToken, eom_ = kNoToken;
  TokenId unk_ = kNoToken, pad_ = kNoToken, sep_ = kNoToken;
  bool add_bos_ = false, add_eos_ = false, add_space_prefix_ = false;
  std::set<TokenId> eog_;
};

}  // namespace kvstack
