#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <queue>

#include "tokenizer/unicode.h"

namespace kvstack {

namespace {

constexpr uint32_t kAttrSpecial = kAttrUnknown | kAttrControl;
constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";  // U+2581, SentencePiece's space

uint32_t attr_from_type(int32_t type) {
  switch (static_cast<TokenType>(type)) {
    case TokenType::kNormal:
      return kAttrNormal;
    case TokenType::kUnknown:
      return kAttrUnknown;
    case TokenType::kControl:
      return kAttrControl;
    case TokenType::kUserDefined:
      return kAttrUserDefined;
    case TokenType::kUnused:
      return kAttrUnused;
    case TokenType::kByte:
      return kAttrByte;
    default:
      return kAttrUndefined;
  }
}

inline bool c_isspace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s.substr(pos));
  return out;
}

// The byte a <0xXX> token stands for: the hex digits at text[3..5), parsed
// like strtol (stops at the first non-hex character; 0 if none).
uint8_t byte_token_value(const std::string& text) {
  uint32_t v = 0;
  for (size_t i = 3; i < std::min<size_t>(text.size(), 5); ++i) {
    const char c = text[i];
    int d = -1;
    if (c >= '0' && c <= '9') d = c - '0';
    if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    if (d < 0) break;
    v = v * 16 + static_cast<uint32_t>(d);
  }
  return static_cast<uint8_t>(v);
}

// Token text -> bytes for byte-level BPE: every character maps back through
// the GPT-2 table; characters outside it are spelled out as llama.cpp does.
std::string decode_byte_level(const std::string& text) {
  std::vector<uint32_t> cpts;
  unicode::decode_utf8_lenient(text, cpts);
  std::string out;
  out.reserve(text.size());
  for (uint32_t cp : cpts) {
    const int b = unicode::cp_to_byte(cp);
    if (b >= 0) {
      out.push_back(static_cast<char>(b));
      continue;
    }
    std::string utf8;
    unicode::append_utf8(cp, utf8);
    out += "[UNK_BYTE_0x";
    static const char* kHex = "0123456789abcdef";
    for (unsigned char c : utf8) {
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
    out += text;
    out += "]";
  }
  return out;
}

// A run of the input: either raw text [offset, offset + length) or a token
// matched by special-token partitioning.
struct Fragment {
  TokenId token;  // kNoToken for raw text
  size_t offset;
  size_t length;
};

// Texts llama.cpp treats as end-of-turn / end-of-generation markers.
constexpr std::string_view kEotTexts[] = {
    "<|eot_id|>",         "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>",    "<EOT>",      "_<EOT>",  "[EOT]",         "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
};
constexpr std::string_view kEomTexts[] = {"<|eom_id|>"};
constexpr std::string_view kFimPadTexts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                                             "[PAD]"};
constexpr std::string_view kFimRepTexts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                             "<REPO>", "<reponame>"};
constexpr std::string_view kFimSepTexts[] = {"<|file_sep|>"};
constexpr std::string_view kFimPreTexts[] = {"<|fim_prefix|>",  "<fim-prefix>", "<fim_prefix>",
                                             "<｜fim▁begin｜>", "<PRE>",        "▁<PRE>",
                                             "<|code_prefix|>", "<|prefix|>"};
constexpr std::string_view kFimSufTexts[] = {"<|fim_suffix|>",  "<fim-suffix>", "<fim_suffix>",
                                             "<｜fim▁hole｜>",  "<SUF>",        "▁<SUF>",
                                             "<|code_suffix|>", "<|suffix|>"};
constexpr std::string_view kFimMidTexts[] = {"<|fim_middle|>",  "<fim-middle>", "<fim_middle>",
                                             "<｜fim▁end｜>",   "<MID>",        "▁<MID>",
                                             "<|code_middle|>", "<|middle|>"};
constexpr std::string_view kEogTexts[] = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
};

template <size_t N>
bool in_list(const std::string& s, const std::string_view (&list)[N]) {
  return std::find(std::begin(list), std::end(list), s) != std::end(list);
}

}  // namespace

// ---------------------------------------------------------------------------
// Construction

Result<Tokenizer> Tokenizer::create(VocabData data) {
  Tokenizer t;
  Status st = t.init(std::move(data));
  if (!st.ok()) return st.error();
  return t;
}

Status Tokenizer::init(VocabData data) {
  const std::string& src = data.source.empty() ? std::string("vocab") : data.source;
  const size_t n = data.tokens.size();
  if (n == 0) return make_error(Errc::kCorruptFile, src + ": tokenizer has no tokens");
  if (n > static_cast<size_t>(INT32_MAX)) {
    return make_error(Errc::kCorruptFile, src + ": too many tokens");
  }
  if (!data.token_types.empty() && data.token_types.size() < n) {
    return make_error(Errc::kCorruptFile, src + ": tokenizer.ggml.token_type has " +
                                              std::to_string(data.token_types.size()) +
                                              " entries for " + std::to_string(n) + " tokens");
  }
  if (!data.scores.empty() && data.scores.size() < n) {
    return make_error(Errc::kCorruptFile, src + ": tokenizer.ggml.scores has " +
                                              std::to_string(data.scores.size()) + " entries for " +
                                              std::to_string(n) + " tokens");
  }
  type_ = data.type;

  text_ = std::move(data.tokens);
  attr_.assign(n, kAttrNormal);
  score_.assign(n, 0.0f);
  token_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (text_[i].empty()) text_[i] = "[EMPTY_" + std::to_string(i) + "]";
    if (!token_to_id_.emplace(text_[i], static_cast<TokenId>(i)).second) {
      return make_error(Errc::kCorruptFile, src + ": duplicate token text at ids " +
                                                std::to_string(token_to_id_[text_[i]]) + " and " +
                                                std::to_string(i));
    }
    if (!data.token_types.empty()) attr_[i] = attr_from_type(data.token_types[i]);
    if (!data.scores.empty()) score_[i] = data.scores[i];
  }

  // Flags by vocab type and pre-tokenizer, then metadata overrides.
  TokenId def_bos = kNoToken, def_eos = kNoToken, def_unk = kNoToken;
  if (type_ == VocabType::kBpe) {
    auto info = pre_tokenizer_from_name(data.pre);
    if (!info) {
      return make_error(
          Errc::kUnsupported,
          src + ": unsupported pre-tokenizer tokenizer.ggml.pre = '" + data.pre + "'");
    }
    pre_ = *info;
    pre_name_ = data.pre.empty() ? "default" : data.pre;
    add_space_prefix_ = false;
    add_bos_ = pre_.add_bos;
    def_bos = def_eos = 11;
  } else {
    pre_ = PreTokenizerInfo{.kind = PreTokenizer::kDefault, .clean_spaces = false};
    pre_name_ = "spm";
    add_space_prefix_ = true;
    add_bos_ = true;
    def_bos = 1;
    def_eos = 2;
    def_unk = 0;
  }
  add_eos_ = false;
  if (data.add_space_prefix) add_space_prefix_ = *data.add_space_prefix;
  if (data.add_bos) add_bos_ = *data.add_bos;
  if (data.add_eos) add_eos_ = *data.add_eos;

  auto pick = [&](const std::optional<int64_t>& meta, TokenId def) {
    TokenId id = (def >= 0 && static_cast<size_t>(def) < n) ? def : kNoToken;
    if (meta && *meta >= 0 && static_cast<uint64_t>(*meta) < n) id = static_cast<TokenId>(*meta);
    return id;
  };
  bos_ = pick(data.bos_id, def_bos);
  eos_ = pick(data.eos_id, def_eos);
  eot_ = pick(data.eot_id, kNoToken);
  eom_ = pick(data.eom_id, kNoToken);
  unk_ = pick(data.unk_id, def_unk);
  sep_ = pick(data.sep_id, kNoToken);
  pad_ = pick(data.pad_id, kNoToken);

  // Special tokens recognised by text, as llama.cpp does. Where several
  // tokens qualify llama.cpp takes the first in hash-map order; we take the
  // lowest id (the same choice for SmolLM2). A matched token that is not
  // control-typed becomes control.
  auto first_match = [&](const auto& list) {
    TokenId found = kNoToken;
    for (size_t i = 0; i < n && found == kNoToken; ++i) {
      if (in_list(text_[i], list)) found = static_cast<TokenId>(i);
    }
    if (found != kNoToken) attr_[found] |= kAttrControl;
    return found;
  };
  if (eot_ == kNoToken) eot_ = first_match(kEotTexts);
  if (eom_ == kNoToken) eom_ = first_match(kEomTexts);
  const TokenId fim_pad = first_match(kFimPadTexts);
  const TokenId fim_rep = first_match(kFimRepTexts);
  const TokenId fim_sep = first_match(kFimSepTexts);
  first_match(kFimPreTexts);  // FIM prefix/suffix/middle: only marked control
  first_match(kFimSufTexts);
  first_match(kFimMidTexts);
  for (size_t i = 0; i < n; ++i) {
    if ((attr_[i] & kAttrControl) && text_[i].find("unused") != std::string::npos) {
      attr_[i] |= kAttrUnused;
    }
  }
  for (TokenId id : {fim_pad, fim_rep, fim_sep}) {
    if (id != kNoToken) eog_.insert(id);
  }
  for (size_t i = 0; i < n; ++i) {
    if (in_list(text_[i], kEogTexts)) {
      eog_.insert(static_cast<TokenId>(i));
      attr_[i] |= kAttrControl;
    }
  }
  for (const char* t : {"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"}) {
    const TokenId id = find_token(t);
    if (id != kNoToken) attr_[id] = kAttrUserDefined;
  }
  for (TokenId id : {eos_, eot_, eom_}) {
    if (id != kNoToken) eog_.insert(id);
  }
  {
    // o200k_harmony / solar-open: "<|end|>" is not end-of-generation there.
    auto has = [&](const char* t) {
      const TokenId id = find_token(t);
      return id != kNoToken && eog_.count(id) ? id : kNoToken;
    };
    const TokenId end_id = has("<|end|>");
    const bool ret = has("<|return|>") != kNoToken;
    const bool call = has("<|call|>") != kNoToken || has("<|calls|>") != kNoToken;
    const bool flush = has("<|flush|>") != kNoToken;
    if (end_id != kNoToken && ((ret && call) || (call && flush))) {
      eog_.erase(end_id);
      attr_[end_id] = kAttrUserDefined;
    }
    // gemma4 / plamo: "</s>" is a normal token there.
    const TokenId s_id = has("</s>");
    if (s_id != kNoToken &&
        (has("<|tool_response>") != kNoToken || has("<|plamo:eos|>") != kNoToken)) {
      eog_.erase(s_id);
      attr_[s_id] = kAttrNormal;
    }
  }

  for (size_t i = 0; i < n; ++i) {
    if (attr_[i] & (kAttrControl | kAttrUserDefined | kAttrUnknown)) {
      special_tokens_.push_back(static_cast<TokenId>(i));
    }
  }
  std::stable_sort(special_tokens_.begin(), special_tokens_.end(),
                   [&](TokenId a, TokenId b) { return text_[a].size() > text_[b].size(); });

  if (type_ == VocabType::kBpe) {
    merges_.reserve(data.merges.size() * 2);
    auto sym_of = [&](const std::string& s) -> int32_t {
      const int32_t id = symbol_id(s);
      if (id >= 0) return id;
      extra_text_.push_back(s);
      const int32_t sym = static_cast<int32_t>(n + extra_text_.size() - 1);
      extra_to_sym_.emplace(s, sym);
      return sym;
    };
    for (size_t rank = 0; rank < data.merges.size(); ++rank) {
      const std::string& m = data.merges[rank];
      std::string first, second;
      const size_t pos = m.find(' ', 1);
      if (pos != std::string::npos) {
        first = m.substr(0, pos);
        second = m.substr(pos + 1);
      }
      const int32_t a = sym_of(first);
      const int32_t b = sym_of(second);
      const uint64_t key = (uint64_t(uint32_t(a)) << 32) | uint32_t(b);
      if (merges_.count(key)) continue;  // the first (best) rank wins
      const int32_t merged = sym_of(first + second);
      merges_.emplace(key, Merge{static_cast<int32_t>(rank), merged});
    }
    for (int b = 0; b < 256; ++b) {
      byte_symbol_[b] = symbol_id(unicode::byte_to_utf8(static_cast<uint8_t>(b)));
    }
  }

  piece_.resize(n);
  for (size_t i = 0; i < n; ++i) piece_[i] = make_piece(static_cast<TokenId>(i));
  return {};
}

TokenId Tokenizer::find_token(std::string_view text) const {
  auto it = token_to_id_.find(text);
  return it == token_to_id_.end() ? kNoToken : it->second;
}

int32_t Tokenizer::symbol_id(std::string_view text) const {
  const TokenId id = find_token(text);
  if (id != kNoToken) return id;
  auto it = extra_to_sym_.find(text);
  return it == extra_to_sym_.end() ? -1 : it->second;
}

const std::string& Tokenizer::symbol_text(int32_t sym) const {
  return sym < n_vocab() ? text_[sym] : extra_text_[sym - n_vocab()];
}

// ---------------------------------------------------------------------------
// Tokenize

std::vector<TokenId> Tokenizer::tokenize(std::string_view text, TokenizeOptions options) const {
  std::vector<Fragment> frags;
  if (!text.empty()) frags.push_back({kNoToken, 0, text.size()});

  // Special-token partitioning: each special token in turn (longest text
  // first) splits every remaining raw fragment at its non-overlapping
  // occurrences, left to right.
  std::vector<Fragment> next;
  for (TokenId sid : special_tokens_) {
    const uint32_t attr = attr_[sid];
    if (!options.parse_special && (attr & kAttrSpecial)) continue;
    const std::string& st = text_[sid];
    next.clear();
    bool changed = false;
    for (const Fragment& f : frags) {
      if (f.token != kNoToken) {
        next.push_back(f);
        continue;
      }
      size_t off = f.offset;
      const size_t end = f.offset + f.length;
      while (true) {
        const size_t m = text.substr(0, end).find(st, off);
        if (m == std::string_view::npos) {
          if (end > off) next.push_back({kNoToken, off, end - off});
          break;
        }
        changed = true;
        size_t left_len = m - off;
        if (attr & kAttrLstrip) {
          while (left_len > 0 && c_isspace(text[off + left_len - 1])) --left_len;
        }
        if (left_len > 0) next.push_back({kNoToken, off, left_len});
        next.push_back({sid, 0, 0});
        if (m + st.size() >= end) break;
        off = m + st.size();
        if (attr & kAttrRstrip) {
          while (off < end && c_isspace(text[off])) ++off;
        }
      }
    }
    if (changed) frags.swap(next);
  }

  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 4);
  if (type_ == VocabType::kBpe) {
    if (options.add_special && add_bos_ && bos_ != kNoToken) out.push_back(bos_);
    for (const Fragment& f : frags) {
      if (f.token != kNoToken) {
        out.push_back(f.token);
      } else {
        tokenize_bpe_fragment(text.substr(f.offset, f.length), out);
      }
    }
  } else {
    if (options.add_special && add_bos_ && bos_ != kNoToken) out.push_back(bos_);
    bool prev_special = true;  // a space prefix goes before the first text too
    for (const Fragment& f : frags) {
      if (f.token != kNoToken) {
        out.push_back(f.token);
        prev_special = true;
        continue;
      }
      std::string piece;
      if (add_space_prefix_ && prev_special) piece = " ";
      piece.append(text.substr(f.offset, f.length));
      tokenize_spm_fragment(replace_all(piece, " ", kSpaceMarker), out);
      prev_special = false;
    }
  }
  if (options.add_special && add_eos_ && eos_ != kNoToken) out.push_back(eos_);
  return out;
}

void Tokenizer::tokenize_bpe_fragment(std::string_view text, std::vector<TokenId>& out) const {
  std::vector<uint32_t> cpts;
  unicode::decode_utf8_lenient(text, cpts);
  const std::vector<uint32_t> pieces = pre_tokenize(pre_.kind, cpts);
  std::string word;
  size_t start = 0;
  for (uint32_t len : pieces) {
    word.clear();
    for (size_t i = start; i < start + len; ++i) unicode::append_utf8(cpts[i], word);
    start += len;
    bpe_word(word, out);
  }
}

void Tokenizer::bpe_word(std::string_view bytes, std::vector<TokenId>& out) const {
  const size_t n = bytes.size();
  if (n == 0) return;
  auto byte_at = [&](size_t i) { return static_cast<uint8_t>(bytes[i]); };

  if (pre_.ignore_merges) {
    std::string encoded;
    for (size_t i = 0; i < n; ++i) encoded += unicode::byte_to_utf8(byte_at(i));
    const TokenId id = find_token(encoded);
    if (id != kNoToken) {
      out.push_back(id);
      return;
    }
  }

  // Doubly linked list of symbols over the word's bytes; a merged-away
  // symbol has len 0.
  struct Sym {
    int32_t sym;  // symbol id, -1 if this byte's character is unknown
    int32_t prev, next;
    uint32_t start, len;
  };
  struct Pair {
    int32_t rank;
    int32_t left, right;          // symbol positions
    int32_t left_sym, right_sym;  // their ids when queued (stale if changed)
  };
  struct Worse {
    bool operator()(const Pair& a, const Pair& b) const {
      return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    }
  };
  std::vector<Sym> syms(n);
  for (size_t i = 0; i < n; ++i) {
    syms[i] = Sym{byte_symbol_[byte_at(i)], static_cast<int32_t>(i) - 1,
                  i + 1 == n ? -1 : static_cast<int32_t>(i + 1), static_cast<uint32_t>(i), 1};
  }
  std::vector<Pair> heap_storage;
  heap_storage.reserve(n);
  std::priority_queue<Pair, std::vector<Pair>, Worse> queue(Worse{}, std::move(heap_storage));
  auto try_pair = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const int32_t a = syms[left].sym, b = syms[right].sym;
    if (a < 0 || b < 0) return;
    auto it = merges_.find((uint64_t(uint32_t(a)) << 32) | uint32_t(b));
    if (it == merges_.end()) return;
    queue.push(Pair{it->second.rank, left, right, a, b});
  };
  for (size_t i = 1; i < n; ++i) try_pair(static_cast<int32_t>(i - 1), static_cast<int32_t>(i));

  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Sym& l = syms[p.left];
    Sym& r = syms[p.right];
    if (l.len == 0 || r.len == 0 || l.sym != p.left_sym || r.sym != p.right_sym) continue;
    const uint64_t key = (uint64_t(uint32_t(l.sym)) << 32) | uint32_t(r.sym);
    l.sym = merges_.find(key)->second.merged;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = p.left;
    try_pair(l.prev, p.left);
    try_pair(p.left, l.next);
  }

  for (int32_t i = 0; i != -1; i = syms[i].next) {
    const Sym& s = syms[i];
    if (s.len == 0) continue;
    if (s.sym >= 0 && s.sym < n_vocab()) {
      out.push_back(s.sym);
      continue;
    }
    // Not a token: fall back to single-byte tokens of its text's bytes.
    const std::string& t =
        s.sym >= 0 ? symbol_text(s.sym) : unicode::byte_to_utf8(byte_at(s.start));
    for (char c : t) {
      const TokenId id = find_token(std::string_view(&c, 1));
      if (id != kNoToken) out.push_back(id);
    }
  }
}

TokenId Tokenizer::byte_fallback_token(uint8_t byte) const {
  static const char* kHex = "0123456789ABCDEF";
  const char name[6] = {'<', '0', 'x', kHex[byte >> 4], kHex[byte & 15], '>'};
  TokenId id = find_token(std::string_view(name, 6));
  if (id == kNoToken) {
    const char raw = static_cast<char>(byte);
    id = find_token(std::string_view(&raw, 1));
  }
  // llama.cpp aborts when neither exists; we use the unknown token.
  return id != kNoToken ? id : unk_;
}

void Tokenizer::tokenize_spm_fragment(std::string_view text, std::vector<TokenId>& out) const {
  struct Sym {
    int32_t prev, next;
    uint32_t start, len;
  };
  struct Pair {
    float score;
    int32_t left, right;
    uint32_t size;
  };
  struct Worse {
    bool operator()(const Pair& a, const Pair& b) const {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    }
  };
  std::vector<Sym> syms;
  size_t off = 0;
  while (off < text.size()) {
    const size_t len =
        std::min(unicode::utf8_len_from_lead(static_cast<uint8_t>(text[off])), text.size() - off);
    const int32_t idx = static_cast<int32_t>(syms.size());
    syms.push_back(Sym{idx - 1, off + len == text.size() ? -1 : idx + 1, static_cast<uint32_t>(off),
                       static_cast<uint32_t>(len)});
    off += len;
  }
  std::priority_queue<Pair, std::vector<Pair>, Worse> queue;
  auto try_pair = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const uint32_t size = syms[left].len + syms[right].len;
    const TokenId id = find_token(text.substr(syms[left].start, size));
    if (id == kNoToken) return;
    queue.push(Pair{score_[id], left, right, size});
  };
  for (size_t i = 1; i < syms.size(); ++i) {
    try_pair(static_cast<int32_t>(i - 1), static_cast<int32_t>(i));
  }
  while (!queue.empty()) {
    const Pair p = queue.top();
    queue.pop();
    Sym& l = syms[p.left];
    Sym& r = syms[p.right];
    if (l.len == 0 || r.len == 0 || l.len + r.len != p.size) continue;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = p.left;
    try_pair(l.prev, p.left);
    try_pair(p.left, l.next);
  }
  if (syms.empty()) return;
  for (int32_t i = 0; i != -1; i = syms[i].next) {
    const Sym& s = syms[i];
    const std::string_view piece = text.substr(s.start, s.len);
    const TokenId id = find_token(piece);
    if (id != kNoToken) {
      out.push_back(id);
      continue;
    }
    for (char c : piece) {
      const TokenId b = byte_fallback_token(static_cast<uint8_t>(c));
      if (b != kNoToken) out.push_back(b);
    }
  }
}

// ---------------------------------------------------------------------------
// Detokenize

std::string Tokenizer::make_piece(TokenId id) const {
  const uint32_t attr = attr_[id];
  const std::string& text = text_[id];
  if (attr & (kAttrSpecial | kAttrUserDefined)) return text;
  if (attr & kAttrNormal) {
    return type_ == VocabType::kBpe ? decode_byte_level(text)
                                    : replace_all(text, kSpaceMarker, " ");
  }
  if (attr & kAttrByte) return std::string(1, static_cast<char>(byte_token_value(text)));
  return {};  // unused / undefined tokens render as nothing
}

void Tokenizer::append_piece(TokenId id, bool render_special, std::string& out) const {
  if (!render_special && (attr_[id] & kAttrSpecial)) return;
  out += piece_[id];
}

std::string Tokenizer::token_to_piece(TokenId id, bool render_special, int lstrip) const {
  if (!render_special && (attr_[id] & kAttrSpecial)) return {};
  const std::string& p = piece_[id];
  size_t skip = 0;
  while (static_cast<int>(skip) < lstrip && skip < p.size() && p[skip] == ' ') ++skip;
  return p.substr(skip);
}

Status Tokenizer::validate(std::span<const TokenId> ids) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!is_valid(ids[i])) {
      return make_error(Errc::kInvalidArgument,
                        "token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                            " is out of range [0, " + std::to_string(n_vocab()) + ")");
    }
  }
  return {};
}

Result<std::string> Tokenizer::detokenize(std::span<const TokenId> ids,
                                          DetokenizeOptions options) const {
  KV_TRY_STATUS(validate(ids));
  bool remove_space = add_space_prefix_;
  if (options.remove_special && add_bos_ && !ids.empty() && ids.front() == bos_) {
    remove_space = false;
    ids = ids.subspan(1);
  }
  if (options.remove_special && add_eos_ && !ids.empty() && ids.back() == eos_) {
    ids = ids.subspan(0, ids.size() - 1);
  }
  std::string text;
  for (TokenId id : ids) {
    text += token_to_piece(id, options.render_special, remove_space ? 1 : 0);
    remove_space = false;
  }
  if (!pre_.clean_spaces || text.empty()) return text;

  // clean_up_tokenization_spaces, three in-place passes as in llama.cpp.
  std::string& t = text;
  size_t total = t.size();
  // 1: " ?", " !", " .", " ," lose the space.
  size_t n1 = total;
  total = 1;
  for (size_t i = 1; i < n1; ++i) {
    const char x = t[i];
    if (t[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ',')) --total;
    t[total++] = x;
  }
  // 2: a lone apostrophe between spaces loses both spaces.
  size_t n2 = total;
  total = n2 ? 1 : 0;
  for (size_t i = 1; i < n2; ++i) {
    const char x = t[i];
    if (x == '\'' && i + 1 < n2 && t[i - 1] == ' ' && t[i + 1] == ' ') {
      --total;
      t[++i] = '\0';
    }
    t[total++] = x;
  }
  // 3: " 's", " 'm", " 're", " 've" lose the space.
  size_t n3 = total;
  total = n3 ? 1 : 0;
  for (size_t i = 1; i < n3; ++i) {
    const char x = t[i];
    if (t[i - 1] == ' ' && x == '\'' && i + 1 < n3) {
      const char x1 = t[i + 1];
      if (x1 == 's' || x1 == 'm') {
        --total;
      } else if (i + 2 < n3) {
        const char x2 = t[i + 2];
        if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) --total;
      }
    }
    t[total++] = x;
  }
  t.resize(total);
  return text;
}

// ---------------------------------------------------------------------------
// GGUF

Result<Tokenizer> Tokenizer::load_from_gguf(const GgufFile& file) {
  auto data = load_vocab_from_gguf(file);
  if (!data.ok()) return data.error();
  return create(std::move(data).value());
}

}  // namespace kvstack
