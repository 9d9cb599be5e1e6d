// The real Gemma 3 270M file (models/gemma-3-270m-q4_k_m.gguf): the config
// kvstack derives from its metadata (the llama.cpp facts listed in
// model/config.cpp), the tensors the forward binds, the embedding scale on
// its Q8_0 rows, and the tokenizer's special ids and end-of-generation set
// as llama.cpp reports them (llama_vocab_bos/eos/eot, llama_vocab_is_eog over
// every id, captured with llama-cpp-python 0.3.36).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "engine/model.h"
#include "engine/testing/model_files.h"
#include "model/dequant.h"
#include "tokenizer/tokenizer.h"

namespace kvstack {
namespace {

using testing::gemma3_model_path;

class Gemma3File : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(gemma3_model_path())) {
      GTEST_SKIP() << gemma3_model_path() << " not found (scripts/setup.sh model fetches it)";
    }
    auto m = Model::load(gemma3_model_path());
    ASSERT_TRUE(m.ok()) << m.error().message;
    model_ = std::move(*m);
  }
  std::unique_ptr<Model> model_;
};

TEST_F(Gemma3File, ConfigMatchesLlamaCpp) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.arch, "gemma3");
  EXPECT_EQ(c.n_layers, 18);
  EXPECT_EQ(c.n_embd, 640);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 1);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.n_rot, 256);
  EXPECT_EQ(c.n_ff, 2048);
  EXPECT_EQ(c.n_vocab, 262144);
  EXPECT_EQ(c.n_ctx_train, 32768);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_TRUE(c.rope_neox);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FLOAT_EQ(c.norm_eps, 1e-6f);
  EXPECT_EQ(c.attn_scale, 1.0f / 16.0f);
  EXPECT_EQ(c.embd_scale, std::sqrt(640.0f));
  for (int l = 0; l < c.n_layers; ++l) {
    const bool full = l == 5 || l == 11 || l == 17;
    EXPECT_EQ(c.window(l), full ? 0 : 512) << "layer " << l;
    EXPECT_EQ(c.rope_base(l), full ? 1e6f : 1e4f) << "layer " << l;
    EXPECT_EQ(c.rope_scale(l), 1.0f) << "layer " << l;
    const LayerWeights& w = model_->layers()[l];
    EXPECT_NE(w.attn_q_norm, nullptr);
    EXPECT_NE(w.attn_k_norm, nullptr);
    EXPECT_NE(w.attn_post_norm, nullptr);
    EXPECT_NE(w.ffn_post_norm, nullptr);
  }
}

TEST_F(Gemma3File, EmbeddingRowsAreQ8RowsTimesSqrtEmbd) {
  const WeightView& e = model_->token_embd();
  const int64_t n = e.n_in;
  const size_t row_bytes = ggml_row_bytes(e.type, n);
  for (int32_t tok : {2, 106, 9259, 262143}) {
    std::vector<float> raw(static_cast<size_t>(n)), got(static_cast<size_t>(n));
    dequantize_row(e.type, e.data + static_cast<size_t>(tok) * row_bytes, raw.data(), n);
    model_->embed(&tok, 1, got.data());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(got[i], raw[i] * std::sqrt(640.0f)) << "token " << tok << " dim " << i;
      ASSERT_NEAR(got[i], static_cast<double>(raw[i]) * std::sqrt(640.0),
                  1e-6 * std::fabs(got[i]) + 1e-30);
    }
  }
}

TEST_F(Gemma3File, TokenizerSpecialsMatchLlamaCpp) {
  auto tok = Tokenizer::load_from_gguf(model_->file());
  ASSERT_TRUE(tok.ok()) << tok.error().message;
  EXPECT_EQ(tok->type(), VocabType::kSpm);
  EXPECT_EQ(tok->bos(), 2);
  EXPECT_EQ(tok->eos(), 1);
  EXPECT_EQ(tok->eot(), 106);
  EXPECT_TRUE(tok->add_bos());
  EXPECT_FALSE(tok->add_eos());
  EXPECT_FALSE(tok->add_space_prefix());
  // llama_vocab_is_eog is true for exactly <eos>, <end_of_turn> and </s>.
  EXPECT_EQ(tok->eog_ids(), (std::set<TokenId>{1, 106, 212}));
  EXPECT_EQ(tok->find_token("<start_of_turn>"), 105);
  EXPECT_EQ(tok->find_token("<end_of_turn>"), 106);
}

}  // namespace
}  // namespace kvstack
