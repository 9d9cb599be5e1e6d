// Every planner formula against hand-computed cases; the arithmetic is
// written next to each expectation.
#include "kv/capacity.h"

#include <gtest/gtest.h>

#include "kv/layout.h"
#include "kv/presets.h"

namespace kvstack::capacity {
namespace {

ModelArch preset(const char* name) {
  auto a = find_preset(name);
  EXPECT_TRUE(a.ok()) << name;
  return *a;
}

KvFormat fmt(const char* name) {
  auto f = find_kv_format(name);
  EXPECT_TRUE(f.ok()) << name;
  return *f;
}

PlanInput input_for(ModelArch arch, std::vector<int64_t> seqs, const char* kv = "f16") {
  PlanInput in;
  in.arch = std::move(arch);
  in.kv_format = fmt(kv);
  in.workload.seq_tokens = std::move(seqs);
  return in;
}

PlanResult run(const PlanInput& in) {
  auto r = plan(in);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  return r.ok() ? *r : PlanResult{};
}

TEST(Capacity, MhaGqaMqaBytesPerToken) {
  // MHA, Llama-2-7B: 2 (K,V) x 32 heads x 128 x 2 B = 16384 B per layer; x 32 = 524288.
  PlanResult mha = run(input_for(preset("llama-2-7b"), {1000, 1000, 1000, 1000}));
  EXPECT_TRUE(mha.kv_bytes_per_token_exact);
  EXPECT_EQ(mha.kv_bytes_per_token_int, 524288u);
  // 4 requests x 1000 tokens x 524288 B = 2,097,152,000 B.
  EXPECT_EQ(mha.kv_payload_bytes, 2097152000u);
  // GQA, Llama-2-70B: 2 x 8 x 128 x 2 = 4096 per layer; x 80 = 327680.
  PlanResult gqa = run(input_for(preset("llama-2-70b"), {10}));
  EXPECT_EQ(gqa.kv_bytes_per_token_int, 327680u);
  EXPECT_EQ(gqa.kv_payload_bytes, 3276800u);
  // MQA: 32 layers, 32 query heads, 1 KV head, d 128: 2 x 1 x 128 x 2 = 512; x 32 = 16384.
  PlanResult mqa = run(input_for(make_uniform_arch("mqa", 32, 32, 1, 128, 4096, 1), {3}));
  EXPECT_EQ(mqa.kv_bytes_per_token_int, 16384u);
  EXPECT_EQ(mqa.kv_payload_bytes, 3u * 16384u);
  // f32 doubles it: 2 x 1 x 128 x 4 x 32 = 32768.
  PlanResult mqa32 = run(input_for(make_uniform_arch("mqa", 32, 32, 1, 128, 4096, 1), {3}, "f32"));
  EXPECT_EQ(mqa32.kv_bytes_per_token_int, 32768u);
}

TEST(Capacity, BytesPerElementOfFormats) {
  // int4: 4/8 + 4 B (f16 scale + min) / 32 = 0.625.
  EXPECT_DOUBLE_EQ(key_bytes_per_element(fmt("int4"), 128, 16), 0.625);
  // int8: 1 + 2 / 128 (one f16 scale per token per head, g = head_dim).
  EXPECT_DOUBLE_EQ(value_bytes_per_element(fmt("int8"), 128, 16), 1.0 + 2.0 / 128);
  // fp8: 1 + 4 / (16 x 128) (one f32 scale per block of 16 tokens per head).
  EXPECT_DOUBLE_EQ(key_bytes_per_element(fmt("fp8"), 128, 16), 1.0 + 4.0 / 2048);
  // kivi2: 2/8 + 4/32 = 0.375 for keys (per channel, 32 tokens) and values.
  EXPECT_DOUBLE_EQ(key_bytes_per_element(fmt("kivi2"), 128, 32), 0.375);
  EXPECT_DOUBLE_EQ(value_bytes_per_element(fmt("kivi2"), 128, 16), 0.375);
  // A key group never spans blocks: with P = 16, G = 16 and keys take 2/8 + 4/16.
  EXPECT_DOUBLE_EQ(key_bytes_per_element(fmt("kivi2"), 128, 16), 0.5);
  // Split formats: K kivi2, V int8 (1 + 2/128).
  const KvFormat split = combine_kv_formats(fmt("kivi2"), fmt("int8"));
  EXPECT_EQ(split.name, "kivi2/int8");
  EXPECT_DOUBLE_EQ(key_bytes_per_element(split, 128, 32), 0.375);
  EXPECT_DOUBLE_EQ(value_bytes_per_element(split, 128, 32), 1.0 + 2.0 / 128);
  EXPECT_EQ(split.residual_tokens, 128);
  EXPECT_DOUBLE_EQ(key_bytes_per_element(fmt("bf16"), 128, 16), 2.0);

  // int4 on Llama-3-8B: per head per token 128 x 0.5 + 4 groups x 4 B = 80 B;
  // x 8 heads x 2 (K,V) = 1280 per layer; x 32 layers = 40960, exact.
  PlanResult r = run(input_for(preset("llama-3-8b"), {7}, "int4"));
  EXPECT_TRUE(r.kv_bytes_per_token_exact);
  EXPECT_EQ(r.kv_bytes_per_token_int, 40960u);
  EXPECT_EQ(r.kv_payload_bytes, 7u * 40960u);
  // int8: (128 + 2) x 8 x 2 x 32 = 66560 per token.
  r = run(input_for(preset("llama-3-8b"), {7}, "int8"));
  EXPECT_EQ(r.kv_bytes_per_token_int, 66560u);
}

TEST(Capacity, Grouped2BitWithResidual) {
  // One layer, H_kv 2, d 64, kivi2 (w 2, g 32, s 4, R 128).
  ModelArch a = make_uniform_arch("toy", 1, 2, 2, 64, 128, 1000);
  // T = 992 = 128 residual + 864 quantized (27 full groups of 32).
  // Spec: 2 H_kv d ((T - R) b_q + R b) = 2 x 2 x 64 x (864 x 0.375 + 128 x 2)
  //      = 256 x (324 + 256) = 148480.
  EXPECT_EQ(run(input_for(a, {992}, "kivi2")).kv_payload_bytes, 148480u);
  // T = 1000: groups convert only when whole, so the residual holds
  // R + (T - R) % G = 128 + 872 % 32 = 136 tokens and 864 are quantized.
  // K: codes 2 x 864 x 64 x 2 / 8 = 27648; scales per channel 2 x 64 x 27 x 4
  //    = 13824; residual 2 x 136 x 64 x 2 = 34816 -> 76288.
  // V: codes 27648; per-token groups 2 x 864 x (64/32) x 4 = 13824; residual 34816 -> 76288.
  const PlanResult r = run(input_for(a, {1000}, "kivi2"));
  EXPECT_EQ(r.kv_payload_bytes, 76288u + 76288u);
  EXPECT_EQ(residual_tokens_at(fmt("kivi2"), 1000, 0), 136);
  EXPECT_EQ(residual_tokens_at(fmt("kivi2"), 1000, 16), 128 + 872 % 16);
  EXPECT_EQ(residual_tokens_at(fmt("kivi2"), 90, 16), 90);
  EXPECT_FALSE(r.kv_bytes_per_token_exact);
  // Amortised: 2 x 64 x 0.375 x 2 streams = 96 B per token.
  EXPECT_DOUBLE_EQ(r.kv_bytes_per_token, 96.0);
  // Shorter than the residual: everything f16, 2 x 2 x 64 x 2 x 100 = 51200.
  EXPECT_EQ(run(input_for(a, {100}, "kivi2")).kv_payload_bytes, 51200u);

  // Custom grouped format: 2-bit, g 64, s 8, R 32 via the overrides.
  auto custom = customize_kv_format(fmt("kivi2"), 64, 8, 32);
  ASSERT_TRUE(custom.ok());
  PlanInput in = input_for(a, {160});
  in.kv_format = *custom;
  // 128 quantized, 32 residual. K: 2x128x64/4 = 4096 + 2x64x(128/64)x8 = 2048 + 2x32x64x2 = 8192
  // -> 14336. V: 4096 + 2x128x(64/64)x8 = 2048 + 8192 -> 14336. Total 28672.
  // Spec: b_q = 2/8 + 8/64 = 0.375; 2 x 2 x 64 x (128 x 0.375 + 32 x 2) = 256 x 112 = 28672.
  EXPECT_EQ(run(in).kv_payload_bytes, 28672u);
}

TEST(Capacity, Mla) {
  // DeepSeek-V2: (d_c + d_R) x b = (512 + 64) x 2 = 1152 B per layer per token, no factor 2;
  // x 60 layers = 69120 B per token.
  PlanResult r = run(input_for(preset("deepseek-v2"), {1000}));
  EXPECT_EQ(r.kv_bytes_per_token_int, 69120u);
  EXPECT_EQ(r.kv_payload_bytes, 69120000u);
  // Explicit MLA arch, f32: (256 + 32) x 4 = 1152 per layer, 2 layers -> 2304 per token.
  ModelArch a;
  a.name = "mla";
  LayerSpec l;
  l.kind = LayerKind::kMla;
  l.n_q_heads = 8;
  l.head_dim_k = 96;
  l.head_dim_v = 64;
  l.mla_latent = 256;
  l.mla_rope_dim = 32;
  a.layers.assign(2, l);
  a.n_params = 1;
  EXPECT_EQ(run(input_for(a, {5}, "f32")).kv_payload_bytes, 5u * 2304u);
  // Decode attention intensity (absorbed): per token per head 2 (2 d_c + d_R) FLOPs =
  // 2 x (1024 + 64) = 2176 x 128 heads = 278528 FLOPs per 1152 B: 241.78 FLOP/B.
  EXPECT_NEAR(r.attention.flop_per_byte, 278528.0 / 1152.0, 1e-9);
}

TEST(Capacity, CrossLayerSharedKvStoresNothingButIsRead) {
  // SmolLM2-135M with its last 10 of 30 layers reading layer 19's K/V: 20
  // storing layers x 768 B per token (f16), the shared ones 0 B; decode reads
  // all 30 layers' worth (the shared layers read their source again).
  ModelArch a = preset("smollm2-135m");
  const PlanResult full = run(input_for(a, {1000}));
  for (size_t i = 20; i < 30; ++i) a.layers[i].kv_source = 19;
  PlanInput in = input_for(a, {1000, 33});
  in.workload.block_size = 16;
  const PlanResult r = run(in);
  EXPECT_EQ(r.kv_bytes_per_token_int, 20u * 768u);
  EXPECT_EQ(r.kv_payload_bytes, 1033u * 20u * 768u);
  ASSERT_TRUE(r.paging.has_value());
  EXPECT_EQ(r.paging->block_bytes, 20u * 2u * 3u * 16u * 64u * 2u);
  ASSERT_EQ(r.layer_groups.size(), 2u);
  EXPECT_FALSE(r.layer_groups[0].shared);
  EXPECT_EQ(r.layer_groups[0].n_layers, 20);
  EXPECT_TRUE(r.layer_groups[1].shared);
  EXPECT_EQ(r.layer_groups[1].n_layers, 10);
  EXPECT_EQ(r.layer_groups[1].payload_bytes, 0u);
  EXPECT_EQ(full.kv_bytes_per_token_int, 30u * 768u);
  const PlanResult one = run(input_for(a, {1000}));
  EXPECT_DOUBLE_EQ(one.attention.flops_per_step, full.attention.flops_per_step);
  EXPECT_EQ(one.attention.kv_bytes_read, full.attention.kv_bytes_read);
  // A layer may only share an earlier storing layer of its own kind and shape.
  a.layers[25].kv_source = 26;
  EXPECT_FALSE(validate_arch(a).ok());
  a.layers[25].kv_source = 19;
  a.layers[19].kind = LayerKind::kWindow;
  a.layers[19].window = 64;
  EXPECT_FALSE(validate_arch(a).ok());
}

TEST(Capacity, DeepSeekMlaPresets) {
  // (d_c + d_R) x 2 B = 1152 B per layer and token (f16) for every DeepSeek MLA
  // model; layers 60 / 27 / 61, heads 128 / 16 / 128, hidden 5120 / 2048 / 7168.
  struct Want {
    const char* id;
    int64_t layers, heads, hidden, vocab;
  };
  for (const Want& w :
       {Want{"deepseek-v2", 60, 128, 5120, 102400}, Want{"deepseek-v2-lite", 27, 16, 2048, 102400},
        Want{"DeepSeek-V3", 61, 128, 7168, 129280}}) {
    const ModelArch a = preset(w.id);
    ASSERT_EQ(static_cast<int64_t>(a.layers.size()), w.layers) << w.id;
    EXPECT_EQ(a.layers[0].kind, LayerKind::kMla) << w.id;
    EXPECT_EQ(a.layers[0].n_q_heads, w.heads) << w.id;
    EXPECT_EQ(a.layers[0].mla_latent, 512) << w.id;
    EXPECT_EQ(a.layers[0].mla_rope_dim, 64) << w.id;
    EXPECT_EQ(a.hidden, w.hidden) << w.id;
    EXPECT_EQ(a.vocab, w.vocab) << w.id;
    EXPECT_NE(a.source.find("config.json"), std::string::npos) << w.id;
    PlanResult r = run(input_for(a, {1000}));
    EXPECT_EQ(r.kv_bytes_per_token_int, static_cast<uint64_t>(w.layers) * 1152u) << w.id;
    // int8: 576 codes + one f16 scale per row (the engine's int8 latent).
    EXPECT_EQ(run(input_for(a, {1000}, "int8")).kv_payload_bytes,
              1000u * static_cast<uint64_t>(w.layers) * 578u)
        << w.id;
  }
}

TEST(Capacity, TailWasteOneAboveBlockBoundary) {
  // SmolLM2-135M, f16, P = 16: block = 30 layers x (K 3x16x64x2 = 6144 + V 6144) = 368640.
  PlanInput in = input_for(preset("smollm2-135m"), {17, 33, 16});
  in.workload.block_size = 16;
  PlanResult r = run(in);
  ASSERT_TRUE(r.paging.has_value());
  EXPECT_EQ(r.paging->block_bytes, 368640u);
  // ceil(17/16) + ceil(33/16) + ceil(16/16) = 2 + 3 + 1 = 6 blocks.
  EXPECT_EQ(r.paging->block_count, 6u);
  EXPECT_EQ(r.paging->slots, 96u);
  // waste: (32 - 17) + (48 - 33) + 0 = 30 tokens.
  EXPECT_EQ(r.paging->tail_waste_tokens, 30u);
  EXPECT_EQ(r.paging->kv_allocated_bytes, 6u * 368640u);
  EXPECT_EQ(r.paging->table_bytes, 6u * 4u);
  EXPECT_EQ(r.paging->allocator_total_bytes, 6u * 368640u + 24u);
  // payload: 66 tokens x 23040 B (2 x 3 x 64 x 2 x 30).
  EXPECT_EQ(r.kv_payload_bytes, 66u * 23040u);

  // Batch of 3 one above 32: 3 x 3 blocks, waste 3 x 15 = 45 (< B P = 48).
  in.workload.seq_tokens = {33, 33, 33};
  r = run(in);
  EXPECT_EQ(r.paging->block_count, 9u);
  EXPECT_EQ(r.paging->tail_waste_tokens, 45u);
}

TEST(Capacity, BlockBytesMatchEngineLayout) {
  // The planner's block must be the engine's block, padding included.
  struct Case {
    int n_layers, n_kv_heads, head_dim, block_size;
    KvDtype dtype;
    const char* fmt;
  };
  for (const Case c : {Case{30, 3, 64, 16, KvDtype::kF16, "f16"},
                       Case{2, 1, 8, 1, KvDtype::kF16, "f16"},   // 16 B regions pad to 64
                       Case{3, 5, 12, 4, KvDtype::kF32, "f32"},  // 240 B regions pad to 256
                       Case{4, 2, 3, 2, KvDtype::kBF16, "bf16"}}) {
    auto layout = KvLayout::uniform(c.n_layers, c.n_kv_heads, c.head_dim, c.dtype, c.block_size);
    ASSERT_TRUE(layout.ok()) << layout.error().message;
    const ModelArch a =
        make_uniform_arch("x", c.n_layers, c.n_kv_heads, c.n_kv_heads, c.head_dim, 64, 1);
    EXPECT_EQ(block_bytes(a, fmt(c.fmt), c.block_size),
              static_cast<uint64_t>(layout->block_bytes()))
        << c.n_layers << " " << c.n_kv_heads << " " << c.head_dim;
    EXPECT_EQ(run(input_for(a, {1}, c.fmt)).kv_bytes_per_token_int,
              static_cast<uint64_t>(layout->payload_bytes_per_token()));
  }
  // Explicit: 2 layers x (K 1x1x8x2 = 16 -> 64, V -> 64) = 256.
  EXPECT_EQ(block_bytes(make_uniform_arch("x", 2, 1, 1, 8, 8, 1), fmt("f16"), 1), 256u);
  // int4, H_kv 2, d 64, P 16: codes 2x16x64/2 = 1024, meta 2x16x2x4 = 256 per stream,
  // both already 64-aligned: (1024 + 256) x 2 = 2560.
  EXPECT_EQ(block_bytes(make_uniform_arch("x", 1, 2, 2, 64, 8, 1), fmt("int4"), 16), 2560u);
}

TEST(Capacity, KiviPlanMatchesEngineLayoutAndResidual) {
  // Pool accounting = planner for KIVI and split formats: block bytes, and the
  // payload of T tokens = layout payload of the converted tokens + f16 residual.
  for (int p : {16, 32, 64}) {
    for (const char* name : {"kivi2", "kivi4"}) {
      const KvDtype t = *parse_kv_dtype(name);
      auto layout = KvLayout::uniform(30, 3, 64, t, p);
      ASSERT_TRUE(layout.ok()) << layout.error().message;
      const ModelArch a = make_uniform_arch("x", 30, 9, 3, 64, 64, 1);
      EXPECT_EQ(block_bytes(a, fmt(name), p), static_cast<uint64_t>(layout->block_bytes()))
          << name << " P " << p;
      for (int64_t tokens : {1, 100, 128, 129, 700, 1000}) {
        PlanInput in = input_for(a, {tokens, tokens}, name);
        in.workload.block_size = p;
        const PlanResult r = run(in);
        const int64_t res = residual_tokens_at(fmt(name), tokens, p);
        const int64_t g = std::min(32, p);
        EXPECT_EQ(res, tokens < 128 ? tokens : 128 + (tokens - 128) % g);
        const uint64_t res_bytes = static_cast<uint64_t>(res) * 30 * 2 * 3 * 64 * 2;
        EXPECT_EQ(r.kv_payload_bytes,
                  2 * (static_cast<uint64_t>(layout->payload_bytes(tokens - res)) + res_bytes))
            << name << " P " << p << " T " << tokens;
        EXPECT_EQ(r.paging->block_count, 2 * static_cast<uint64_t>((tokens + p - 1) / p));
        EXPECT_EQ(r.paging->residual_buffer_bytes, 2 * res_bytes);
      }
    }
  }
  auto split = KvLayout::uniform(30, 3, 64, *parse_kv_dtype("kivi2"), 32, KvDtype::kInt8);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(block_bytes(make_uniform_arch("x", 30, 9, 3, 64, 64, 1),
                        combine_kv_formats(fmt("kivi2"), fmt("int8")), 32),
            static_cast<uint64_t>(split->block_bytes()));
}

TEST(Capacity, PrefixSharingAcrossRequests) {
  // 4 requests of 100 tokens sharing 64, P 16, SmolLM2 f16 (23040 B per token).
  PlanInput in = input_for(preset("smollm2-135m"), {100, 100, 100, 100});
  in.workload.block_size = 16;
  in.workload.shared_prefix = 64;
  PlanResult r = run(in);
  // Shared: 64/16 = 4 full blocks once; private 36 tokens each -> ceil(36/16) = 3 blocks.
  // 4 + 4 x 3 = 16 blocks versus 4 x ceil(100/16) = 28 unshared.
  EXPECT_EQ(r.paging->block_count, 16u);
  EXPECT_EQ(r.paging->block_count_unshared, 28u);
  // Tables still list the shared ids: 4 x 7 ids x 4 B = 112.
  EXPECT_EQ(r.paging->table_bytes, 112u);
  // Payload: (64 + 4 x 36) = 208 tokens vs 400.
  EXPECT_EQ(r.kv_payload_bytes, 208u * 23040u);
  EXPECT_EQ(r.kv_payload_bytes_unshared, 400u * 23040u);
  // A shared prefix of 70 still shares only the 4 full blocks (the partial block is private).
  in.workload.shared_prefix = 70;
  r = run(in);
  EXPECT_EQ(r.paging->block_count, 16u);
  EXPECT_EQ(r.kv_payload_bytes, 208u * 23040u);
  // Without paging the whole 70 tokens are shared: 70 + 4 x 30 = 190 tokens.
  in.workload.block_size = 0;
  EXPECT_EQ(run(in).kv_payload_bytes, 190u * 23040u);
}

TEST(Capacity, WindowLayersCapAtWindow) {
  // Gemma-3-27B, f16, T = 2048: 52 local layers keep 1024, 10 global keep 2048;
  // per layer per token 2 x 16 x 128 x 2 = 8192 B.
  // 8192 x (52 x 1024 + 10 x 2048) = 8192 x 73728 = 603,979,776.
  PlanResult r = run(input_for(preset("gemma-3-27b"), {2048}));
  EXPECT_EQ(r.kv_payload_bytes, 603979776u);
  ASSERT_EQ(r.layer_groups.size(), 2u);
  EXPECT_EQ(r.layer_groups[0].n_layers + r.layer_groups[1].n_layers, 62);
  // Below the window every layer keeps everything: 62 x 8192 x 1000.
  EXPECT_EQ(run(input_for(preset("gemma-3-27b"), {1000})).kv_payload_bytes, 62u * 8192u * 1000u);
}

TEST(Capacity, TensorParallelReplication) {
  // Llama-3-8B has 8 KV heads. tp = 4: 2 heads per rank, 2 x 2 x 128 x 2 x 32 = 32768 per token.
  PlanInput in = input_for(preset("llama-3-8b"), {1});
  in.tp = 4;
  PlanResult r = run(in);
  EXPECT_EQ(r.tp->kv_heads_per_rank, 2);
  EXPECT_EQ(r.tp->replication, 1);
  EXPECT_EQ(r.tp->kv_payload_bytes_per_rank, 32768u);
  // tp = 16 > 8 KV heads: each rank holds 1 head (replicated twice):
  // 2 x 1 x 128 x 2 x 32 = 16384 per rank, not 131072 / 16 = 8192.
  in.tp = 16;
  r = run(in);
  EXPECT_EQ(r.tp->kv_heads_per_rank, 1);
  EXPECT_EQ(r.tp->replication, 2);
  EXPECT_EQ(r.tp->kv_payload_bytes_per_rank, 16384u);
  EXPECT_EQ(r.tp->naive_per_rank_bytes, 8192u);
  EXPECT_EQ(r.tp->kv_bytes_all_ranks, 16u * 16384u);
  // Weights split: ceil(8,030,261,248 x 2 / 16) = 1,003,782,656.
  EXPECT_EQ(r.memory.weights_bytes, 1003782656u);
  // Heads that do not divide.
  in.tp = 3;
  auto bad = plan(in);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("do not divide"), std::string::npos);
  // 8 KV heads, tp 32? 32 query heads / 32 = 1, KV replicated 4x.
  in.tp = 32;
  r = run(in);
  EXPECT_EQ(r.tp->replication, 4);
}

TEST(Capacity, MemoryCrossoverAndBudget) {
  // SmolLM2 in bf16: weights 134,515,008 x 2 = 269,030,016 B; KV 23040 B per token.
  PlanInput in = input_for(preset("smollm2-135m"), {1000});
  in.activation_bytes = 0;
  PlanResult r = run(in);
  EXPECT_EQ(r.memory.weights_bytes, 269030016u);
  EXPECT_EQ(r.memory.total_bytes, 269030016u + 23040000u);
  // Crossover: ceil(269,030,016 / 23040) = 11677 (11676 x 23040 = 269,015,040 < weights).
  ASSERT_TRUE(r.crossover_tokens.has_value());
  EXPECT_EQ(*r.crossover_tokens, 11677);
  // Budget = weights + 10 requests of 1000 tokens + 5 B -> max batch 10.
  in.hw.mem_budget = 269030016u + 10u * 23040000u + 5u;
  in.workload.seq_tokens = {1000, 1000};
  r = run(in);
  EXPECT_EQ(*r.max_batch_for_budget, 10);
  // Max ctx with 2 sequences: floor(230,400,005 / (2 x 23040)) = 5000.
  EXPECT_EQ(*r.max_ctx_for_budget, 5000);
  // Weights alone over budget: nothing fits.
  in.hw.mem_budget = 1000;
  r = run(in);
  EXPECT_EQ(*r.max_batch_for_budget, 0);
  EXPECT_EQ(*r.max_ctx_for_budget, 0);
  // q4_0 weights: ceil(134,515,008 / 32) x 18 = 4,203,594 x 18 = 75,664,692.
  in.weight_format = *find_weight_format("q4_0");
  EXPECT_EQ(run(in).memory.weights_bytes, 75664692u);
}

TEST(Capacity, DecodeLowerBoundAndIntensity) {
  // SmolLM2 bf16: (269,030,016 + 1000 x 23040) B / 1e11 B/s = 2.92070016 ms.
  PlanInput in = input_for(preset("smollm2-135m"), {1000});
  in.hw.mem_bw = 1e11;
  PlanResult r = run(in);
  EXPECT_EQ(r.decode->bytes_per_step, 292070016u);
  EXPECT_DOUBLE_EQ(r.decode->step_lower_bound_s, 292070016.0 / 1e11);
  // MHA f16: 2 x H x (d + d) FLOPs per 2 x H x d x 2 B = 1 FLOP/B.
  EXPECT_DOUBLE_EQ(run(input_for(preset("gpt2-small"), {64})).attention.flop_per_byte, 1.0);
  // GQA group 4 (Llama-3-8B): 2 x 32 x 256 / (2 x 8 x 128 x 2) = 4 FLOP/B.
  EXPECT_DOUBLE_EQ(run(input_for(preset("llama-3-8b"), {64})).attention.flop_per_byte, 4.0);
  // Mixtral reads only active weights: 12,879,925,248 x 2 B.
  PlanInput mx = input_for(preset("mixtral-8x7b"), {1});
  mx.hw.mem_bw = 1e12;
  EXPECT_EQ(run(mx).decode->bytes_per_step, 12879925248u * 2u + 131072u);
}

TEST(Capacity, FetchVersusRecompute) {
  // SmolLM2: fetch(L) = 1 ms + 23040 L / 1e9; recompute(L) = L / 1000.
  PlanInput in = input_for(preset("smollm2-135m"), {500});
  in.hw.link_bw = 1e9;
  in.hw.link_latency_s = 1e-3;
  in.hw.recompute_tokens_per_s = 1000;
  PlanResult r = run(in);
  EXPECT_EQ(r.fetch->prefix_tokens, 500);
  EXPECT_EQ(r.fetch->fetch_bytes, 500u * 23040u);
  EXPECT_DOUBLE_EQ(r.fetch->fetch_time_s, 1e-3 + 11520000.0 / 1e9);
  EXPECT_DOUBLE_EQ(*r.fetch->recompute_time_s, 0.5);
  // L = 1: 1.02304 ms > 1 ms; L = 2: 1.04608 ms < 2 ms -> break-even 2.
  EXPECT_EQ(*r.fetch->break_even_tokens, 2);
  // Recompute at 1e6 tok/s costs 1 us per token < 23.04 us per token fetched: never.
  in.hw.recompute_tokens_per_s = 1e6;
  r = run(in);
  EXPECT_FALSE(r.fetch->break_even_tokens.has_value());
  EXPECT_TRUE(r.fetch->fetch_never_wins);
  // Break-even L* = latency / (1/rate - c): rate 10000/s, 0.1 s latency:
  // 0.1 / (1e-4 - 2.304e-5) = 1299.38 -> first integer with fetch faster is 1300.
  in.hw.recompute_tokens_per_s = 1e4;
  in.hw.link_latency_s = 0.1;
  EXPECT_EQ(*run(in).fetch->break_even_tokens, 1300);
}

TEST(Capacity, DisaggregatedPipelinedTransfer) {
  // 2 layers, 1 KV head, d 4, f16: 16 B per layer per token; T = 1000 -> 16000 B per layer.
  PlanInput in = input_for(make_uniform_arch("toy", 2, 1, 1, 4, 4, 1000), {1000});
  in.hw.link_bw = 16000;               // t_x = 1 s per layer
  in.hw.recompute_tokens_per_s = 500;  // prefill 2 s -> t_p = 1 s per layer
  PlanResult r = run(in);
  EXPECT_EQ(r.transfer->bytes, 32000u);
  EXPECT_DOUBLE_EQ(r.transfer->transfer_time_s, 2.0);
  // t_p + t_x + (L - 1) max(t_p, t_x) = 1 + 1 + 1 = 3 s; after prefill: L (t_p + t_x) = 4 s.
  EXPECT_DOUBLE_EQ(*r.transfer->pipelined_ready_time_s, 3.0);
  EXPECT_DOUBLE_EQ(*r.transfer->sequential_ready_time_s, 4.0);
  EXPECT_EQ(r.transfer->in_flight_bytes, 64000u);
  // Slower link (t_x = 2 s): 1 + 2 + 1 x 2 = 5 s vs 2 x 3 = 6 s.
  in.hw.link_bw = 8000;
  r = run(in);
  EXPECT_DOUBLE_EQ(*r.transfer->pipelined_ready_time_s, 5.0);
  EXPECT_DOUBLE_EQ(*r.transfer->sequential_ready_time_s, 6.0);
}

TEST(Capacity, FlopRecomputeModel) {
  // 1 layer, H_q 2, d 4, params 100, T 3: 2 x 100 x 3 + 2 x 2 x (4 + 4) x (1 + 2 + 3) = 792.
  ModelArch a = make_uniform_arch("toy", 1, 2, 2, 4, 8, 100);
  Hardware hw;
  hw.compute_flops = 792;
  EXPECT_DOUBLE_EQ(*recompute_time_s(a, hw, 3), 1.0);
  // Window 2 caps the attended keys: 1 + 2 + 2 = 5 -> 600 + 32 x 5 = 760.
  a.layers[0].kind = LayerKind::kWindow;
  a.layers[0].window = 2;
  EXPECT_DOUBLE_EQ(*recompute_time_s(a, hw, 3), 760.0 / 792.0);
  EXPECT_FALSE(recompute_time_s(a, Hardware{}, 3).has_value());
}

TEST(Capacity, BadInputIsAClearError) {
  ModelArch a = make_uniform_arch("m", 4, 32, 5, 128, 4096, 1);
  Status s = validate_arch(a);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("not a multiple of KV heads"), std::string::npos);
  EXPECT_FALSE(validate_arch(make_uniform_arch("m", 0, 32, 8, 128, 4096, 1)).ok());
  EXPECT_FALSE(validate_arch(make_uniform_arch("m", 2, 0, 0, 128, 4096, 1)).ok());
  EXPECT_FALSE(validate_arch(make_uniform_arch("m", 2, 8, 8, -1, 4096, 1)).ok());

  PlanInput in = input_for(preset("smollm2-135m"), {0});
  EXPECT_FALSE(plan(in).ok());
  in.workload.seq_tokens = {};
  EXPECT_FALSE(plan(in).ok());
  in.workload.seq_tokens = {10, 20};
  in.workload.shared_prefix = 11;
  auto r = plan(in);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("shortest sequence"), std::string::npos);
  in.workload.shared_prefix = 0;
  in.tp = 0;
  EXPECT_FALSE(plan(in).ok());

  auto p = find_preset("llama-9-1b");
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.error().message.find("unknown preset 'llama-9-1b'"), std::string::npos);
  EXPECT_TRUE(find_preset("Llama_3_8B").ok());
  EXPECT_TRUE(find_preset("qwen2.5-7b").ok());
  EXPECT_FALSE(find_kv_format("int3").ok());
  EXPECT_FALSE(customize_kv_format(fmt("f16"), 32, std::nullopt, std::nullopt).ok());
  EXPECT_FALSE(customize_kv_format(fmt("int4"), 0, std::nullopt, std::nullopt).ok());
  EXPECT_FALSE(customize_kv_format(fmt("int4"), std::nullopt, -1, std::nullopt).ok());
  EXPECT_FALSE(find_weight_format("q9_9").ok());

  // 3-bit codes on head width 12: 36 bits per token is not whole bytes... 12 x 3 = 36 bits
  // -> rejected (the engine stores whole bytes per head row).
  KvFormat odd = fmt("int4");
  odd.bits = 3;
  PlanInput in2 = input_for(make_uniform_arch("m", 1, 1, 1, 12, 12, 1), {4});
  in2.kv_format = odd;
  EXPECT_FALSE(plan(in2).ok());
}

TEST(Capacity, EveryPresetIsValidAndPlans) {
  for (const auto& info : list_presets()) {
    auto a = find_preset(info.id);
    ASSERT_TRUE(a.ok()) << info.id;
    EXPECT_TRUE(validate_arch(*a).ok()) << info.id;
    EXPECT_FALSE(a->source.empty()) << info.id;
    PlanInput in = input_for(*a, {4096, 100});
    in.workload.block_size = 16;
    EXPECT_TRUE(plan(in).ok()) << info.id;
  }
  EXPECT_GE(list_presets().size(), 11u);
}

TEST(Capacity, CompareVerify) {
  PlanInput in = input_for(preset("smollm2-135m"), {17, 33});
  in.workload.block_size = 16;
  const PlanResult p = run(in);
  VerifyReport m;
  m.payload_bytes = p.kv_payload_bytes;
  m.allocated_bytes = p.paging->kv_allocated_bytes;
  m.block_count = p.paging->block_count;
  m.block_bytes = p.paging->block_bytes;
  m.rss_growth_bytes = 123;  // reported, never fails
  EXPECT_TRUE(compare_verify(p, m).ok);
  m.allocated_bytes += 1;
  const VerifyComparison c = compare_verify(p, m);
  EXPECT_FALSE(c.ok);
  bool found = false;
  for (const auto& row : c.rows) {
    if (row.name == "allocated_bytes") {
      found = true;
      EXPECT_FALSE(row.matches);
    }
  }
  EXPECT_TRUE(found);
}

TEST(Capacity, HybridModelPagesAsTheEnginesKvGroups) {
  // 8 layers, 3 and 7 full, the rest window 20: classes of 2 and 6 layers ->
  // groups of gcd = 2 (one full, three window), one block size. H_kv 1, d 8,
  // f16, P 4: a group block is 2 layers x (K 64 + V 64) = 256 B.
  ModelArch a = make_uniform_arch("hybrid", 8, 1, 1, 8, 8, 1);
  for (int l = 0; l < 8; ++l) {
    if (l % 4 != 3) {
      a.layers[static_cast<size_t>(l)].kind = LayerKind::kWindow;
      a.layers[static_cast<size_t>(l)].window = 20;
    }
  }
  PlanInput in = input_for(a, {50});
  in.workload.block_size = 4;
  const PlanResult r = run(in);
  ASSERT_TRUE(r.paging.has_value());
  const PagingFigures& p = *r.paging;
  ASSERT_EQ(p.groups.size(), 4u);
  EXPECT_EQ(p.block_bytes, 256u);
  // Full group: ceil(50 / 4) = 13 blocks, 50 tokens x 2 layers x 32 B.
  EXPECT_EQ(p.groups[0].window, 0);
  EXPECT_EQ(p.groups[0].block_count, 13u);
  EXPECT_EQ(p.groups[0].payload_bytes, 3200u);
  EXPECT_EQ(p.groups[0].resident_bytes, 3200u);
  for (size_t g = 1; g < 4; ++g) {
    // Blocks overlapping [50 - 20 + 1, 50) = [31, 50): 7 .. 12, 6 blocks,
    // 22 resident tokens; the payload is the window's 20 tokens.
    EXPECT_EQ(p.groups[g].window, 20);
    EXPECT_EQ(p.groups[g].n_layers, 2);
    EXPECT_EQ(p.groups[g].block_count, 6u);
    EXPECT_EQ(p.groups[g].payload_bytes, 1280u);
    EXPECT_EQ(p.groups[g].resident_bytes, 1408u);
    EXPECT_EQ(p.groups[g].allocated_bytes, 6u * 256u);
  }
  EXPECT_EQ(p.block_count, 31u);
  EXPECT_EQ(p.kv_allocated_bytes, 31u * 256u);
  EXPECT_EQ(p.table_bytes, 4u * 4u * 13u);  // 13 logical ids in each of 4 group tables
  EXPECT_EQ(r.kv_payload_bytes, 3200u + 3 * 1280u);
  // With a shared prefix the grouped pool is not modelled: no groups.
  in.workload.shared_prefix = 16;
  EXPECT_TRUE(run(in).paging->groups.empty());
}

}  // namespace
}  // namespace kvstack::capacity
