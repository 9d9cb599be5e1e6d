#include <gtest/gtest.h>

#include <vector>

#include "kv/kv_memory.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

KvLayout must(Result<KvLayout> r) {
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  return std::move(r).value();
}

TEST(KvLayout, SmolLm2PayloadAndBlockBytes) {
  // SmolLM2-135M: 30 layers, 3 KV heads, head dim 64, f16 (2 bytes).
  // Payload per token: 30 layers x 2 (K,V) x 3 heads x 64 dims x 2 bytes = 23040.
  const KvLayout l = must(KvLayout::uniform(30, 3, 64, KvDtype::kF16, 16));
  EXPECT_EQ(l.payload_bytes_per_token(), 30 * 2 * 3 * 64 * 2);
  EXPECT_EQ(l.payload_bytes_per_token(), 23040);
  EXPECT_EQ(l.layer_payload_bytes_per_token(7), 2 * 3 * 64 * 2);
  // Block of P=16: per layer K = 3 heads x 16 slots x 64 dims x 2 B = 6144 (64-aligned), V same.
  EXPECT_EQ(l.block_bytes(), 30 * (6144 + 6144));
  EXPECT_EQ(l.block_bytes(), 368640);
  // Layer 2: two previous layers of 12288 bytes each. Per head a K tile of
  // 16 x 128 bytes, then its V tile: V of head 0 follows K of head 0.
  EXPECT_EQ(l.placement(2).k_offset, 2 * 12288);
  EXPECT_EQ(l.placement(2).v_offset, 2 * 12288 + 2048);
  EXPECT_EQ(l.placement(2).slot_stride, 64 * 2);
  EXPECT_EQ(l.placement(2).head_stride, 2 * 16 * 64 * 2);
  EXPECT_EQ(l.placement(2).v_head_stride, 2 * 16 * 64 * 2);
  EXPECT_EQ(l.placement(29).end_offset, l.block_bytes());
}

TEST(KvLayout, F32AndBf16Bytes) {
  // 4 layers x 2 x 8 heads x 128 dims x 4 bytes = 32768 bytes per token.
  EXPECT_EQ(must(KvLayout::uniform(4, 8, 128, KvDtype::kF32, 1)).payload_bytes_per_token(), 32768);
  // bf16 halves it.
  EXPECT_EQ(must(KvLayout::uniform(4, 8, 128, KvDtype::kBF16, 1)).payload_bytes_per_token(), 16384);
}

TEST(KvLayout, EveryBlockSizeFrom1To256) {
  for (int p = 1; p <= 256; p *= 2) {
    const KvLayout l = must(KvLayout::uniform(30, 3, 64, KvDtype::kF16, p));
    // 3 heads x 64 dims x 2 B = 384 bytes per token per K region: a multiple of
    // 64 for every P, so no padding: block bytes = payload per token x P.
    EXPECT_EQ(l.block_bytes(), 23040 * p) << p;
    EXPECT_EQ(l.block_size(), p);
    const PagedKvLayerView v = l.layer_view(3, reinterpret_cast<uint8_t*>(uintptr_t{4096}));
    EXPECT_EQ(v.block_size, p);
    EXPECT_EQ(v.block_stride, 23040 * p);
    EXPECT_EQ(v.head_stride, p * 256);  // a K tile and a V tile of p x 128 bytes
    EXPECT_EQ(v.slot_stride, 128);
    EXPECT_EQ(v.k, reinterpret_cast<uint8_t*>(uintptr_t{4096}) + 3 * 2 * 384 * p);
    EXPECT_EQ(v.v, v.k + 128 * p);
  }
  for (int bad : {0, -1, 3, 6, 24, 100, 512}) {
    auto r = KvLayout::uniform(2, 1, 64, KvDtype::kF16, bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, Errc::kInvalidArgument);
    EXPECT_NE(r.error().message.find("block size"), std::string::npos);
  }
}

TEST(KvLayout, PaddingTo64Bytes) {
  // 1 head x 3 dims x f16 = 6 bytes per slot; P = 4 -> K tile 24 bytes, V
  // tile right after it; the layer takes what K and V regions padded to 64
  // bytes each would: 128 bytes per layer, 2 layers -> 256.
  const KvLayout l = must(KvLayout::uniform(2, 1, 3, KvDtype::kF16, 4));
  EXPECT_EQ(l.payload_bytes_per_token(), 2 * 2 * 1 * 3 * 2);  // 24, unpadded
  EXPECT_EQ(l.placement(0).k_bytes, 24);
  EXPECT_EQ(l.placement(0).v_offset, 24);
  EXPECT_EQ(l.placement(1).k_offset, 128);
  EXPECT_EQ(l.placement(1).v_offset, 128 + 24);
  EXPECT_EQ(l.block_bytes(), 256);
  for (int i = 0; i < l.n_layers(); ++i) EXPECT_EQ(l.placement(i).k_offset % 64, 0);
}

TEST(KvLayout, MixedLayersAndMla) {
  // Layer 0: standard, 2 heads x 8 dims f32 -> K = 2 x 4 x 8 x 4 = 256 B (P=4), V 256.
  // Layer 1: MLA, d_c = 16, d_R = 4, bf16 -> 20 x 2 = 40 B per token, 160 B per
  //          block, padded to 192; no V; payload 40 B/token (no factor 2).
  // Layer 2: standard, 1 head x 16 dims f16, window 8 -> K = 1 x 4 x 16 x 2 = 128, V 128.
  std::vector<KvLayerSpec> specs = {
      {.n_kv_heads = 2, .head_dim_k = 8, .head_dim_v = 8, .dtype = KvDtype::kF32},
      {.kind = KvLayerKind::kMlaLatent, .latent_dim = 16, .rope_dim = 4, .dtype = KvDtype::kBF16},
      {.n_kv_heads = 1, .head_dim_k = 16, .head_dim_v = 16, .dtype = KvDtype::kF16, .window = 8},
  };
  const KvLayout l = must(KvLayout::create(specs, 4));
  EXPECT_EQ(l.layer_payload_bytes_per_token(0), 2 * 2 * 8 * 4);   // 128
  EXPECT_EQ(l.layer_payload_bytes_per_token(1), (16 + 4) * 2);    // 40
  EXPECT_EQ(l.layer_payload_bytes_per_token(2), 2 * 1 * 16 * 2);  // 64
  EXPECT_EQ(l.payload_bytes_per_token(), 128 + 40 + 64);
  EXPECT_EQ(l.placement(0).k_offset, 0);
  EXPECT_EQ(l.placement(0).v_offset, 128);  // after head 0's K tile of 4 x 32 bytes
  EXPECT_EQ(l.placement(0).head_stride, 256);
  EXPECT_EQ(l.placement(1).k_offset, 512);
  EXPECT_EQ(l.placement(1).v_offset, -1);
  EXPECT_EQ(l.placement(2).k_offset, 512 + 192);
  EXPECT_EQ(l.placement(2).v_offset, 512 + 192 + 128);
  EXPECT_EQ(l.block_bytes(), 512 + 192 + 256);

  auto* base = reinterpret_cast<uint8_t*>(uintptr_t{1} << 20);
  const PagedKvLayerView mla = l.layer_view(1, base);
  EXPECT_EQ(mla.k, base + 512);
  EXPECT_EQ(mla.v, nullptr);
  EXPECT_EQ(mla.n_kv_heads, 1);
  EXPECT_EQ(mla.head_dim, 20);
  EXPECT_EQ(mla.slot_stride, 40);
  EXPECT_EQ(mla.dtype, KvDtype::kBF16);
  EXPECT_EQ(l.layer(2).window, 8);
}

TEST(KvLayout, RejectsBadSpecsWithClearErrors) {
  auto expect_err = [](std::vector<KvLayerSpec> specs, Errc code, const char* needle) {
    auto r = KvLayout::create(std::move(specs), 16);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, code);
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  };
  const KvLayerSpec ok{.n_kv_heads = 2, .head_dim_k = 64, .head_dim_v = 64};
  expect_err({}, Errc::kInvalidArgument, "layer count");
  expect_err({ok, {.n_kv_heads = 0, .head_dim_k = 64, .head_dim_v = 64}}, Errc::kInvalidArgument,
             "layer 1: n_kv_heads 0");
  expect_err({{.n_kv_heads = 2, .head_dim_k = 0, .head_dim_v = 0}}, Errc::kInvalidArgument,
             "head dims");
  expect_err({{.n_kv_heads = 2, .head_dim_k = 192, .head_dim_v = 128}}, Errc::kUnsupported,
             "head_dim_k 192 != head_dim_v 128");
  expect_err({{.n_kv_heads = 2, .head_dim_k = 64, .head_dim_v = 64, .window = -4}},
             Errc::kInvalidArgument, "window -4");
  expect_err({{.kind = KvLayerKind::kMlaLatent, .latent_dim = 0}}, Errc::kInvalidArgument,
             "MLA latent_dim 0");
  expect_err({{.kind = KvLayerKind::kMlaLatent, .n_kv_heads = 4, .latent_dim = 8}},
             Errc::kInvalidArgument, "MLA layers take");
  expect_err({{.n_kv_heads = 2, .head_dim_k = 64, .head_dim_v = 64, .dtype = KvDtype(9)}},
             Errc::kInvalidArgument, "dtype");
}

TEST(KvLayout, DtypeNames) {
  for (KvDtype t : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16, KvDtype::kFp8, KvDtype::kInt8,
                    KvDtype::kInt4}) {
    auto r = parse_kv_dtype(kv_dtype_name(t));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(*r, t);
  }
  auto bad = parse_kv_dtype("fp6");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("'fp6'"), std::string::npos);
}

TEST(KvLayout, SameFormat) {
  const KvLayout a = must(KvLayout::uniform(4, 2, 64, KvDtype::kF16, 16));
  EXPECT_TRUE(a.same_format(must(KvLayout::uniform(4, 2, 64, KvDtype::kF16, 16))));
  EXPECT_FALSE(a.same_format(must(KvLayout::uniform(4, 2, 64, KvDtype::kBF16, 16))));
  EXPECT_FALSE(a.same_format(must(KvLayout::uniform(4, 2, 64, KvDtype::kF16, 32))));
  EXPECT_FALSE(a.same_format(must(KvLayout::uniform(5, 2, 64, KvDtype::kF16, 16))));
}

TEST(KvFootprint, FormulaByHand) {
  const KvLayout l = must(KvLayout::uniform(30, 3, 64, KvDtype::kF16, 16));
  const std::vector<int64_t> lengths = {0, 1, 16, 17, 100};
  const KvFootprint f = kv_footprint(l, lengths);
  EXPECT_EQ(f.n_sequences, 5);
  EXPECT_EQ(f.n_tokens, 134);
  EXPECT_EQ(f.payload_bytes, 134 * 23040);  // 2 N H_kv d b sum T_i
  // ceil(T/16): 0 + 1 + 1 + 2 + 7 = 11 blocks, 176 slots, 42 slots of tail waste.
  EXPECT_EQ(f.n_blocks, 11);
  EXPECT_EQ(f.n_slots, 176);
  EXPECT_EQ(f.n_waste_slots, 42);
  EXPECT_EQ(f.allocated_bytes, 11 * 368640);
  EXPECT_EQ(f.table_bytes, 11 * 4);
  // Waste bound: < B * P slots.
  EXPECT_LT(f.n_waste_slots, 5 * 16);
  EXPECT_EQ(blocks_for_tokens(l, 0), 0);
  EXPECT_EQ(blocks_for_tokens(l, 32), 2);
  EXPECT_EQ(blocks_for_tokens(l, 33), 3);
}

}  // namespace
}  // namespace kvstack
