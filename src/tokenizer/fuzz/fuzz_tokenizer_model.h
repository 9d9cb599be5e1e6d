// Shared by the tokenizer, chat-template and request fuzzers: the default
// model's tokenizer, loaded once per fuzzing process from $KVSTACK_MODEL
// (else <source>/models/SmolLM2-135M-Instruct.Q4_1.gguf). A real vocabulary
// (49152 byte-level BPE tokens, merges, special tokens) exercises the
// pre-tokenizer, BPE and special-token paths as serving does.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "model/gguf.h"
#include "tokenizer/tokenizer.h"

namespace kvstack::fuzz {

inline const Tokenizer& model_tokenizer() {
  static const std::unique_ptr<Tokenizer> tok = [] {
    std::string path;
    if (const char* env = std::getenv("KVSTACK_MODEL"); env != nullptr && *env != '\0') {
      path = env;
    } else {
      path = std::string(KVSTACK_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    }
    auto file = GgufFile::open(path);
    if (!file) {
      std::fprintf(stderr, "fuzz: cannot open the model %s: %s (set KVSTACK_MODEL)\n", path.c_str(),
                   file.error().message.c_str());
      std::abort();
    }
    auto t = Tokenizer::load_from_gguf(*file);
    if (!t) {
      std::fprintf(stderr, "fuzz: %s: %s\n", path.c_str(), t.error().message.c_str());
      std::abort();
    }
    return std::make_unique<Tokenizer>(std::move(t).value());
  }();
  return *tok;
}

}  // namespace kvstack::fuzz
