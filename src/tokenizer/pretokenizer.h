// Pre-tokenizers: split text into the words that BPE merges within, matching
// llama.cpp's split rules for each `tokenizer.ggml.pre` value. Hand-written
// matchers (no std::regex, which has no Unicode categories): each rule below
// reproduces the leftmost-first, greedy-with-backtracking semantics of the
// regex it names.
//
// A split runs in stages; each stage refines the pieces of the previous one
// and never merges across a piece boundary (the boundary acts as end of text
// for lookaheads). Stages by kind:
//   kGpt2:    GPT-2 rule:  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
//   ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ kSmollm:  every \p{N} codepoint isolated, then the GPT-2 rule
//             (also starcoder, refact, command-r, codeshell, exaone, minerva-7b)
//   kLlama3:  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//             ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//   kQwen2:   as kLlama3 with \p{N} (one digit per piece)
//   kDefault: runs of [\p{P}$+<=>^~|] isolated, then the GPT-2 rule, then \p{N}+
//             runs isolated, then [0-9]{3} groups isolated
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvstack {

enum class PreTokenizer { kDefault, kGpt2, kSmollm, kLlama3, kQwen2 };

// What a `tokenizer.ggml.pre` value selects in llama.cpp for a BPE vocab.
struct PreTokenizerInfo {
  PreTokenizer kind = PreTokenizer::kDefault;
  bool clean_spaces = true;    // detokenize drops spaces before ?!., etc.
  bool ignore_merges = false;  // a word that is itself a token skips BPE
  bool add_bos = false;        // default for add_bos before metadata overrides
};

// Looks up a `tokenizer.ggml.pre` value; nullopt if unsupported. An empty
// name means "default" (as in llama.cpp, which warns about it).
std::optional<PreTokenizerInfo> pre_tokenizer_from_name(std::string_view name);
const char* pre_tokenizer_name(PreTokenizer kind);

// Splits `cpts` (codepoints) into consecutive pieces; returns their lengths in
// codepoints (all > 0, summing to cpts.size()).
std::vector<uint32_t> pre_tokenize(PreTokenizer kind, const std::vector<uint32_t>& cpts);

// Convenience for tests: decodes `text` (lenient UTF-8), splits it and returns
// the pieces re-encoded as UTF-8.
std::vector<std::string> pre_tokenize_text(PreTokenizer kind, std::string_view text);

}  // namespace kvstack
