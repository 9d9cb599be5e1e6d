// `kvstack tokenize` and `kvstack detokenize`: the model's tokenizer from the
// command line, one-shot or in batches (--jsonl) for reference testing.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "cli/args.h"
#include "core/json_string.h"
#include "model/gguf.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace kvstack::cli {
namespace {

// Parses one JSON string literal (the whole of `s`, surrounding whitespace
// allowed) into bytes. \uDC80-\uDCFF (lone low surrogates, Python's
// "surrogateescape") stand for the raw bytes 0x80-0xFF so that invalid UTF-8
// can be passed in; other lone surrogates are errors.
Result<std::string> parse_json_string(std::string_view s) {
  auto bad = [&](const std::string& why) {
    return make_error(Errc::kInvalidArgument,
                      "invalid JSON string (" + why + "): " + std::string(s.substr(0, 60)));
  };
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  if (i >= s.size() || s[i] != '"') return bad("expected '\"'");
  ++i;
  std::string out;
  auto hex4 = [&](size_t at, uint32_t& v) {
    if (at + 4 > s.size()) return false;
    v = 0;
    for (size_t k = at; k < at + 4; ++k) {
      const char c = s[k];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        return false;
    }
    return true;
  };
  while (true) {
    if (i >= s.size()) return bad("unterminated");
    const char c = s[i++];
    if (c == '"') break;
    if (c != '\\') {
      out.push_back(c);
      continue;
    }
    if (i >= s.size()) return bad("dangling escape");
    const char e = s[i++];
    switch (e) {
      case '"':
        out.push_back('"');
        break;
      case '\\':
        out.push_back('\\');
        break;
      case '/':
        out.push_back('/');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'u': {
        uint32_t cp;
        if (!hex4(i, cp)) return bad("bad \\u escape");
        i += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          uint32_t lo;
          if (i + 6 <= s.size() && s[i] == '\\' && s[i + 1] == 'u' && hex4(i + 2, lo) &&
              lo >= 0xDC00 && lo <= 0xDFFF) {
            i += 6;
            unicode::append_utf8(0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00), out);
          } else {
            return bad("lone high surrogate");
          }
        } else if (cp >= 0xDC80 && cp <= 0xDCFF) {
          out.push_back(static_cast<char>(cp - 0xDC00));  // surrogate-escaped raw byte
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
          return bad("lone low surrogate");
        } else {
          unicode::append_utf8(cp, out);
        }
        break;
      }
      default:
        return bad(std::string("unknown escape \\") + e);
    }
  }
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  if (i != s.size()) return bad("trailing characters");
  return out;
}

std::string to_json_array(const std::vector<TokenId>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ids[i]);
  }
  out += "]";
  return out;
}

// "1,2,3", "1 2 3" or "[1, 2, 3]" -> ids (range is checked by the tokenizer).
Result<std::vector<TokenId>> parse_id_list(std::string_view s) {
  std::vector<TokenId> ids;
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  const bool bracketed = i < s.size() && s[i] == '[';
  if (bracketed) ++i;
  bool closed = false;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c)) || c == ',') {
      ++i;
      continue;
    }
    if (c == ']' && bracketed) {
      closed = true;
      ++i;
      break;
    }
    size_t j = i;
    if (s[j] == '-' || s[j] == '+') ++j;
    while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    const std::string item(s.substr(i, j - i));
    if (item.empty() || item == "-" || item == "+" ||
        (j < s.size() && !std::isspace(static_cast<unsigned char>(s[j])) && s[j] != ',' &&
         s[j] != ']')) {
      size_t k = i;
      while (k < s.size() && s[k] != ',' && s[k] != ']' &&
             !std::isspace(static_cast<unsigned char>(s[k])))
        ++k;
      return make_error(Errc::kInvalidArgument,
                        "bad token id '" + std::string(s.substr(i, k - i)) + "'");
    }
    if (item.size() > 11)
      return make_error(Errc::kInvalidArgument, "token id '" + item + "' is out of range");
    const long long v = std::stoll(item);
    if (v < INT32_MIN || v > INT32_MAX) {
      return make_error(Errc::kInvalidArgument, "token id '" + item + "' is out of range");
    }
    ids.push_back(static_cast<TokenId>(v));
    i = j;
  }
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  if (bracketed && !closed) return make_error(Errc::kInvalidArgument, "missing ']' in token list");
  if (i != s.size())
    return make_error(Errc::kInvalidArgument, "trailing text after ']' in token list");
  return ids;
}

Result<Tokenizer> load_tokenizer(const Args& args) {
  const std::string path = resolve_model_path(args);
  auto file = GgufFile::open(path);
  if (!file.ok()) return file.error();
  return Tokenizer::load_from_gguf(*file);
}

int run_tokenize(const std::vector<std::string>& argv) {
  const std::vector<OptionSpec> specs = {
      model_option(),
      {"prompt", 'p', "TEXT", "text to tokenize"},
      {"file", 'f', "FILE", "read the text to tokenize from FILE (bytes as is)"},
      {"special", 0, "", "parse special-token text (e.g. <|im_start|>) into those tokens"},
      {"no-bos", 0, "", "do not add BOS/EOS even if the model asks for them"},
      {"jsonl", 0, "",
       "batch mode: read one JSON string per line from stdin, write one JSON array per line"},
      help_option(),
  };
  auto args = Args::parse(argv, specs);
  if (!args.ok()) return fail("tokenize", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack tokenize [-m MODEL] (-p TEXT | -f FILE | --jsonl) [--special] "
                           "[--no-bos]",
                           "Prints the token ids of the text as a JSON array on one line.", specs)
                   .c_str(),
               stdout);
    return 0;
  }
  const int n_inputs = args->has("prompt") + args->has("file") + args->flag("jsonl");
  if (n_inputs != 1) return fail("tokenize", "give exactly one of -p TEXT, -f FILE or --jsonl");
  auto tok = load_tokenizer(*args);
  if (!tok.ok()) return fail("tokenize", tok.error().message);
  const TokenizeOptions opts{.add_special = !args->flag("no-bos"),
                             .parse_special = args->flag("special")};

  if (args->flag("jsonl")) {
    std::string line;
    size_t line_no = 0;
    while (std::getline(std::cin, line)) {
      ++line_no;
      auto text = parse_json_string(line);
      if (!text.ok()) {
        return fail("tokenize",
                    "stdin line " + std::to_string(line_no) + ": " + text.error().message);
      }
      const std::string out = to_json_array(tok->tokenize(*text, opts)) + "\n";
      std::fwrite(out.data(), 1, out.size(), stdout);
    }
    return 0;
  }
  std::string text;
  if (auto p = args->get("prompt")) {
    text = *p;
  } else {
    const std::string path = *args->get("file");
    std::ifstream in(path, std::ios::binary);
    if (!in) return fail("tokenize", "cannot open '" + path + "'");
    std::ostringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  std::printf("%s\n", to_json_array(tok->tokenize(text, opts)).c_str());
  return 0;
}

int run_detokenize(const std::vector<std::string>& argv) {
  const std::vector<OptionSpec> specs = {
      model_option(),
      {"tokens", 't', "IDS", "token ids: \"1,2,3\" or a JSON array \"[1, 2, 3]\""},
      {"special", 0, "", "render control tokens (e.g. <|im_end|>) as their text"},
      {"jsonl", 0, "",
       "batch mode: read one JSON array of ids per line from stdin, write one JSON string per "
       "line (invalid UTF-8 bytes as \\udc80-\\udcff)"},
      help_option(),
  };
  auto args = Args::parse(argv, specs);
  if (!args.ok()) return fail("detokenize", args.error().message);
  if (args->flag("help")) {
    std::fputs(format_help("kvstack detokenize [-m MODEL] (--tokens IDS | --jsonl) [--special]",
                           "Prints the text of the token ids (followed by a newline).", specs)
                   .c_str(),
               stdout);
    return 0;
  }
  if (args->has("tokens") == args->flag("jsonl")) {
    return fail("detokenize", "give exactly one of --tokens IDS or --jsonl");
  }
  auto tok = load_tokenizer(*args);
  if (!tok.ok()) return fail("detokenize", tok.error().message);
  const DetokenizeOptions opts{.render_special = args->flag("special")};

  if (args->flag("jsonl")) {
    std::string line;
    size_t line_no = 0;
    while (std::getline(std::cin, line)) {
      ++line_no;
      auto ids = parse_id_list(line);
      if (!ids.ok()) {
        return fail("detokenize",
                    "stdin line " + std::to_string(line_no) + ": " + ids.error().message);
      }
      auto text = tok->detokenize(*ids, opts);
      if (!text.ok()) {
        return fail("detokenize",
                    "stdin line " + std::to_string(line_no) + ": " + text.error().message);
      }
      // ASCII-only; invalid UTF-8 bytes as \udc80-\udcff, which Python decodes
      // back with .encode("utf-8", "surrogateescape").
      const std::string out =
          json_quote(*text, {.ascii_only = true, .invalid_utf8 = InvalidUtf8::kSurrogateEscape}) +
          "\n";
      std::fwrite(out.data(), 1, out.size(), stdout);
    }
    return 0;
  }
  auto ids = parse_id_list(*args->get("tokens"));
  if (!ids.ok()) return fail("detokenize", ids.error().message);
  auto text = tok->detokenize(*ids, opts);
  if (!text.ok()) return fail("detokenize", text.error().message);
  std::fwrite(text->data(), 1, text->size(), stdout);
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace

KVSTACK_COMMAND(tokenize_command, "tokenize", "print the token ids of a text", run_tokenize);
KVSTACK_COMMAND(detokenize_command, "detokenize", "print the text of token ids", run_detokenize);

}  // namespace kvstack::cli
