#include "tokenizer/pretokenizer.h"

#include "tokenizer/unicode.h"

namespace kvstack {

namespace {

using unicode::cp_flags;

// One stage splits the segment [begin, end) of `c` and appends piece lengths.
using Stage = void (*)(const uint32_t* c, size_t begin, size_t end, std::vector<uint32_t>& out);

constexpr uint16_t kL = unicode::kLetter;
constexpr uint16_t kN = unicode::kNumber;
constexpr uint16_t kWs = unicode::kWhitespace;

// [^\s\p{L}\p{N}] for an in-segment codepoint (flags 0 means "past the end").
inline bool is_other(uint16_t f) {
  return f != 0 && (f & (kWs | kL | kN)) == 0;
}

inline uint32_t ascii_lower(uint32_t c) {
  return (c >= 'A' && c <= 'Z') ? c + 32 : c;
}

// Emits pieces while a cursor walks the segment.
struct Cursor {
  const uint32_t* c;
  size_t begin, end;
  std::vector<uint32_t>& out;
  uint16_t flags(size_t p) const { return p < end ? cp_flags(c[p]) : 0; }
  bool at(size_t p, uint32_t ch) const { return p < end && c[p] == ch; }
  // Emits [pos, to) and returns `to`.
  size_t emit(size_t pos, size_t to) {
    if (to > pos) out.push_back(static_cast<uint32_t>(to - pos));
    return to;
  }
};

// Length of a contraction ('s 't 'm 'd 're 've 'll) at `pos`, or 0.
size_t contraction_len(const Cursor& k, size_t pos, bool case_insensitive) {
  if (k.c[pos] != '\'' || pos + 1 >= k.end) return 0;
  auto low = [&](size_t p) { return case_insensitive ? ascii_lower(k.c[p]) : k.c[p]; };
  const uint32_t a = low(pos + 1);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (pos + 2 >= k.end) return 0;
  const uint32_t b = low(pos + 2);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
void split_gpt2(const uint32_t* c, size_t begin, size_t end, std::vector<uint32_t>& out) {
  Cursor k{c, begin, end, out};
  size_t pos = begin;
  while (pos < end) {
    if (size_t n = contraction_len(k, pos, /*case_insensitive=*/false)) {
      pos = k.emit(pos, pos + n);
      continue;
    }
    const bool space = c[pos] == ' ';
    const uint16_t f2 = k.flags(pos + (space ? 1 : 0));
    if (f2 & kL) {
      size_t q = pos + (space ? 1 : 0);
      while (k.flags(q) & kL) ++q;
      pos = k.emit(pos, q);
      continue;
    }
    if (f2 & kN) {
      size_t q = pos + (space ? 1 : 0);
      while (k.flags(q) & kN) ++q;
      pos = k.emit(pos, q);
      continue;
    }
    if (is_other(f2)) {
      size_t q = pos + (space ? 1 : 0);
      while (is_other(k.flags(q))) ++q;
      pos = k.emit(pos, q);
      continue;
    }
    size_t n_ws = 0;
    while (k.flags(pos + n_ws) & kWs) ++n_ws;
    if (n_ws > 1 && pos + n_ws < end) {
      pos = k.emit(pos, pos + n_ws - 1);  // \s+(?!\S): leave the last one
    } else if (n_ws > 0) {
      pos = k.emit(pos, pos + n_ws);
    } else {
      pos = k.emit(pos, pos + 1);
    }
  }
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
//  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
template <size_t kMaxDigits>
void split_llama3(const uint32_t* c, size_t begin, size_t end, std::vector<uint32_t>& out) {
  Cursor k{c, begin, end, out};
  size_t pos = begin;
  while (pos < end) {
    const uint32_t cpt = c[pos];
    const uint16_t f = k.flags(pos);
    if (size_t n = contraction_len(k, pos, /*case_insensitive=*/true)) {
      pos = k.emit(pos, pos + n);
      continue;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+
    const bool lead_ok = cpt != '\r' && cpt != '\n' && !(f & kN);
    if ((f & kL) || (lead_ok && (k.flags(pos + 1) & kL))) {
      size_t q = pos + 1;
      while (k.flags(q) & kL) ++q;
      pos = k.emit(pos, q);
      continue;
    }
    // \p{N}{1,max}
    if (f & kN) {
      size_t q = pos + 1;
      while (q < pos + kMaxDigits && (k.flags(q) & kN)) ++q;
      pos = k.emit(pos, q);
      continue;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    size_t run = end;  // start of the [^\s\p{L}\p{N}]+ run, if any
    if (cpt == ' ' && is_other(k.flags(pos + 1))) {
      run = pos + 1;
    } else if (is_other(f)) {
      run = pos;
    }
    if (run != end) {
      size_t q = run;
      while (is_other(k.flags(q))) ++q;
      while (k.at(q, '\r') || k.at(q, '\n')) ++q;
      pos = k.emit(pos, q);
      continue;
    }
    size_t n_ws = 0;
    size_t last_newline_end = 0;  // one past the last \r or \n in the run
    while (k.flags(pos + n_ws) & kWs) {
      if (c[pos + n_ws] == '\r' || c[pos + n_ws] == '\n') last_newline_end = pos + n_ws + 1;
      ++n_ws;
    }
    if (last_newline_end > 0) {
      pos = k.emit(pos, last_newline_end);  // \s*[\r\n]+
    } else if (n_ws > 1 && pos + n_ws < end) {
      pos = k.emit(pos, pos + n_ws - 1);  // \s+(?!\S)
    } else if (n_ws > 0) {
      pos = k.emit(pos, pos + n_ws);  // \s+
    } else {
      pos = k.emit(pos, pos + 1);
    }
  }
}

// The classes below follow llama.cpp's "collapsed" evaluation of \p{..}
// inside bracket expressions: ASCII codepoints by their ASCII class, others
// by category.
inline bool collapsed_number(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return (cp_flags(cp) & unicode::kCategoryMask) == kN;
}

// [\p{P}\$\+<=>\^~\|]
inline bool default_punct(uint32_t cp) {
  if (cp < 0x80) {
    return (cp >= 0x21 && cp <= 0x2F) || (cp >= 0x3A && cp <= 0x40) || (cp >= 0x5B && cp <= 0x5F) ||
           (cp >= 0x7B && cp <= 0x7E);
  }
  return (cp_flags(cp) & unicode::kCategoryMask) == unicode::kPunctuation;
}

// Every codepoint matching `pred` is its own piece; the rest stay together.
template <bool (*kPred)(uint32_t)>
void isolate_each(const uint32_t* c, size_t begin, size_t end, std::vector<uint32_t>& out) {
  size_t gap = begin;
  for (size_t p = begin; p < end; ++p) {
    if (!kPred(c[p])) continue;
    if (p > gap) out.push_back(static_cast<uint32_t>(p - gap));
    out.push_back(1);
    gap = p + 1;
  }
  if (end > gap) out.push_back(static_cast<uint32_t>(end - gap));
}

// Maximal runs of codepoints matching `pred` are pieces; the rest stay together.
template <bool (*kPred)(uint32_t)>
void isolate_runs(const uint32_t* c, size_t begin, size_t end, std::vector<uint32_t>& out) {
  size_t gap = begin;
  size_t p = begin;
  while (p < end) {
    if (!kPred(c[p])) {
      ++p;
      continue;
    }
    size_t q = p + 1;
    while (q < end && kPred(c[q])) ++q;
    if (p > gap) out.push_back(static_cast<uint32_t>(p - gap));
    out.push_back(static_cast<uint32_t>(q - p));
    gap = p = q;
  }
  if (end > gap) out.push_back(static_cast<uint32_t>(end - gap));
}

inline bool ascii_digit(uint32_t cp) {
  return cp >= '0' && cp <= '9';
}

// [0-9][0-9][0-9]: leftmost non-overlapping triples are pieces.
void isolate_digit_triples(const uint32_t* c, size_t begin, size_t end,
                           std::vector<uint32_t>& out) {
  size_t gap = begin;
  size_t p = begin;
  while (p + 3 <= end) {
    if (ascii_digit(c[p]) && ascii_digit(c[p + 1]) && ascii_digit(c[p + 2])) {
      if (p > gap) out.push_back(static_cast<uint32_t>(p - gap));
      out.push_back(3);
      gap = p = p + 3;
    } else {
      ++p;
    }
  }
  if (end > gap) out.push_back(static_cast<uint32_t>(end - gap));
}

std::vector<Stage> stages_for(PreTokenizer kind) {
  switch (kind) {
    case PreTokenizer::kGpt2:
      return {split_gpt2};
    case PreTokenizer::kSmollm:
      return {isolate_each<collapsed_number>, split_gpt2};
    case PreTokenizer::kLlama3:
      return {split_llama3<3>};
    case PreTokenizer::kQwen2:
      return {split_llama3<1>};
    case PreTokenizer::kDefault:
      return {isolate_runs<default_punct>, split_gpt2, isolate_runs<collapsed_number>,
              isolate_digit_triples};
  }
  return {};
}

}  // namespace

std::optional<PreTokenizerInfo> pre_tokenizer_from_name(std::string_view name) {
  struct Entry {
    const char* name;
    PreTokenizer kind;
    bool clean_spaces;
    bool ignore_merges;
    bool add_bos;
  };
  using P = PreTokenizer;
  static constexpr Entry kEntries[] = {
      {"default", P::kDefault, true, false, false},
      {"llama3", P::kLlama3, true, true, true},
      {"llama-v3", P::kLlama3, true, true, true},
      {"llama-bpe", P::kLlama3, true, true, true},
      {"falcon3", P::kLlama3, true, true, true},
      {"falcon-h1", P::kLlama3, true, true, true},
      {"pixtral", P::kLlama3, true, true, true},
      {"midm-2.0", P::kLlama3, true, true, true},
      {"lfm2", P::kLlama3, true, true, true},
      {"dbrx", P::kLlama3, true, false, false},
      {"smaug-bpe", P::kLlama3, true, false, false},
      {"gpt-2", P::kGpt2, true, false, false},
      {"gpt2", P::kGpt2, true, false, false},  // alias; not a llama.cpp name
      {"phi-2", P::kGpt2, true, false, false},
      {"gigachat", P::kGpt2, true, false, false},
      {"a.x-4.0", P::kGpt2, true, false, false},
      {"mellum", P::kGpt2, true, false, false},
      {"exaone4", P::kGpt2, true, false, false},
      {"mpt", P::kGpt2, true, false, false},
      {"olmo", P::kGpt2, true, false, false},
      {"jais", P::kGpt2, true, false, false},
      {"trillion", P::kGpt2, false, false, false},
      {"smollm", P::kSmollm, false, false, false},
      {"command-r", P::kSmollm, false, false, false},
      {"starcoder", P::kSmollm, true, false, false},
      {"refact", P::kSmollm, true, false, false},
      {"codeshell", P::kSmollm, true, false, false},
      {"exaone", P::kSmollm, true, false, false},
      {"minerva-7b", P::kSmollm, true, false, false},
      {"qwen2", P::kQwen2, false, false, false},
      {"deepseek-r1-qwen", P::kQwen2, false, false, false},
      {"kormo", P::kQwen2, false, false, false},
      {"f2llmv2", P::kQwen2, false, false, false},
      {"hunyuan", P::kQwen2, false, false, false},
      {"stablelm2", P::kQwen2, true, false, false},
  };
  if (name.empty()) name = "default";
  for (const Entry& e : kEntries) {
    if (name == e.name) {
      return PreTokenizerInfo{.kind = e.kind,
                              .clean_spaces = e.clean_spaces,
                              .ignore_merges = e.ignore_merges,
                              .add_bos = e.add_bos};
    }
  }
  return std::nullopt;
}

const char* pre_tokenizer_name(PreTokenizer kind) {
  switch (kind) {
    case PreTokenizer::kDefault:
      return "default";
    case PreTokenizer::kGpt2:
      return "gpt-2";
    case PreTokenizer::kSmollm:
      return "smollm";
    case PreTokenizer::kLlama3:
      return "llama3";
    case PreTokenizer::kQwen2:
      return "qwen2";
  }
  return "?";
}

std::vector<uint32_t> pre_tokenize(PreTokenizer kind, const std::vector<uint32_t>& cpts) {
  std::vector<uint32_t> pieces;
  if (cpts.empty()) return pieces;
  pieces.push_back(static_cast<uint32_t>(cpts.size()));
  std::vector<uint32_t> next;
  for (Stage stage : stages_for(kind)) {
    next.clear();
    next.reserve(pieces.size() * 2);
    size_t start = 0;
    for (uint32_t len : pieces) {
      stage(cpts.data(), start, start + len, next);
      start += len;
    }
    pieces.swap(next);
  }
  return pieces;
}

std::vector<std::string> pre_tokenize_text(PreTokenizer kind, std::string_view text) {
  std::vector<uint32_t> cpts;
  unicode::decode_utf8_lenient(text, cpts);
  std::vector<std::string> words;
  size_t start = 0;
  for (uint32_t len : pre_tokenize(kind, cpts)) {
    std::string w;
    for (size_t i = start; i < start + len; ++i) unicode::append_utf8(cpts[i], w);
    words.push_back(std::move(w));
    start += len;
  }
  return words;
}

}  // namespace kvstack
