// Where the model tests (MODEL_TESTS in src/engine/CMakeLists.txt) find the
// real GGUF files: an environment variable first, then the gitignored
// models/ folder. Header-only, like the other helpers in this folder.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

namespace kvstack::testing {

// The default model (SmolLM2-135M-Instruct, Q4_1): $KVSTACK_MODEL, else the
// first of models/ under the working directory, its parent, or /work/main
// that exists; "" when none does (the caller skips).
inline std::string default_model_path() {
  if (const char* m = std::getenv("KVSTACK_MODEL")) return m;
  for (const char* p :
       {"models/SmolLM2-135M-Instruct.Q4_1.gguf", "../models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "/work/main/models/SmolLM2-135M-Instruct.Q4_1.gguf"}) {
    if (std::filesystem::exists(p)) return p;
  }
  return "";
}

// Gemma 3 270M (Q4_K_M): $KVSTACK_GEMMA3_MODEL, else
// $KVSTACK_SOURCE_DIR/models/gemma-3-270m-q4_k_m.gguf ("." when unset); the
// caller checks that the file exists.
inline std::string gemma3_model_path() {
  if (const char* env = std::getenv("KVSTACK_GEMMA3_MODEL")) return env;
  const char* src = std::getenv("KVSTACK_SOURCE_DIR");
  return std::string(src ? src : ".") + "/models/gemma-3-270m-q4_k_m.gguf";
}

}  // namespace kvstack::testing
