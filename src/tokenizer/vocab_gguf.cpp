// load_vocab_from_gguf: the tokenizer.* metadata keys -> VocabData.
#include "model/gguf.h"
#include "tokenizer/tokenizer.h"

namespace kvstack {

namespace {

// Reads an optional key with `get`; absent -> nullopt, present but of the
// wrong type -> the getter's error.
template <class T, class Getter>
Status read_optional(const GgufFile& file, std::string_view key, Getter get,
                     std::optional<T>& out) {
  if (file.find(key) == nullptr) return {};
  auto v = (file.*get)(key);
  if (!v.ok()) return v.error();
  out = static_cast<T>(*v);
  return {};
}

}  // namespace

Result<VocabData> load_vocab_from_gguf(const GgufFile& file) {
  VocabData d;
  d.source = file.path();
  auto model = file.get_string("tokenizer.ggml.model");
  if (!model.ok()) return model.error();
  if (*model == "gpt2") {
    d.type = VocabType::kBpe;
  } else if (*model == "llama") {
    d.type = VocabType::kSpm;
  } else {
    return make_error(Errc::kUnsupported, file.path() + ": unsupported tokenizer.ggml.model '" +
                                              *model + "' (supported: gpt2, llama)");
  }
  if (file.find("tokenizer.ggml.pre") != nullptr) {
    auto pre = file.get_string("tokenizer.ggml.pre");
    if (!pre.ok()) return pre.error();
    d.pre = std::move(*pre);
  }

  auto tokens = file.get_string_array("tokenizer.ggml.tokens");
  if (!tokens.ok()) return tokens.error();
  d.tokens = std::move(*tokens);

  if (file.find("tokenizer.ggml.token_type") != nullptr) {
    auto types = file.get_int_array("tokenizer.ggml.token_type");
    if (!types.ok()) return types.error();
    d.token_types.reserve(types->size());
    for (int64_t t : *types) d.token_types.push_back(static_cast<int32_t>(t));
  }
  if (file.find("tokenizer.ggml.scores") != nullptr) {
    auto scores = file.get_float_array("tokenizer.ggml.scores");
    if (!scores.ok()) return scores.error();
    d.scores.reserve(scores->size());
    for (double s : *scores) d.scores.push_back(static_cast<float>(s));
  }
  if (d.type == VocabType::kBpe) {
    auto merges = file.get_string_array("tokenizer.ggml.merges");
    if (!merges.ok()) return merges.error();
    d.merges = std::move(*merges);
  }

  struct IdKey {
    const char* key;
    std::optional<int64_t>* out;
  };
  const IdKey ids[] = {
      {"tokenizer.ggml.bos_token_id", &d.bos_id},
      {"tokenizer.ggml.eos_token_id", &d.eos_id},
      {"tokenizer.ggml.eot_token_id", &d.eot_id},
      {"tokenizer.ggml.eom_token_id", &d.eom_id},
      {"tokenizer.ggml.unknown_token_id", &d.unk_id},
      {"tokenizer.ggml.seperator_token_id", &d.sep_id},  // sic: GGUF's spelling
      {"tokenizer.ggml.padding_token_id", &d.pad_id},
  };
  for (const IdKey& k : ids) {
    KV_TRY_STATUS(read_optional<int64_t>(file, k.key, &GgufFile::get_i64, *k.out));
  }
  KV_TRY_STATUS(
      read_optional<bool>(file, "tokenizer.ggml.add_bos_token", &GgufFile::get_bool, d.add_bos));
  KV_TRY_STATUS(
      read_optional<bool>(file, "tokenizer.ggml.add_eos_token", &GgufFile::get_bool, d.add_eos));
  KV_TRY_STATUS(read_optional<bool>(file, "tokenizer.ggml.add_space_prefix", &GgufFile::get_bool,
                                    d.add_space_prefix));
  return d;
}

}  // namespace kvstack
