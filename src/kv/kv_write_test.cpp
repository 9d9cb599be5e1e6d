#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "core/cpu_features.h"
#include "core/half.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_write.h"

namespace kvstack {
namespace {

bool have_avx2() {
  const CpuFeatures& f = cpu_features();
  return f.avx2 && f.fma && f.f16c;
}

std::vector<float> interesting_floats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          65520.0f,  // rounds to inf in f16
                          65519.99f,
                          70000.0f,
                          std::ldexp(1.0f, -24),
                          std::ldexp(1.0f, -25),  // tie to even -> 0
                          std::ldexp(3.0f, -25),  // tie -> 2^-23
                          std::ldexp(1.0f, -14),
                          std::ldexp(1023.0f, -24),
                          1.0f + std::ldexp(1.0f, -11),
                          1.0f + 3 * std::ldexp(1.0f, -11),
                          1.0f + std::ldexp(1.0f, -8),
                          1.0f + 3 * std::ldexp(1.0f, -8),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::quiet_NaN(),
                          bits_to_f32(0x7f800001u),  // signalling NaN with payload
                          bits_to_f32(0xffc12345u),
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::min()};
  // Every f16 value and the midpoints next to it.
  for (uint32_t h = 0; h < 0x7c00; h += 7) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    v.push_back(f);
    v.push_back(-f);
    v.push_back(std::nextafter(f, 1e9f));
    v.push_back(std::nextafter(f, -1e9f));
  }
  std::mt19937 rng(42);
  for (int i = 0; i < 200000; ++i) v.push_back(bits_to_f32(static_cast<uint32_t>(rng())));
  return v;
}

TEST(ConvertRow, MatchesCoreHalfBitForBit) {
  const std::vector<float> src = interesting_floats();
  std::vector<Isa> isas = {Isa::kScalar};
  if (have_avx2()) isas.push_back(Isa::kAvx2);
  for (Isa isa : isas) {
    // Odd lengths and offsets exercise the vector tails.
    for (int64_t n :
         {int64_t{1}, int64_t{7}, int64_t{15}, int64_t{17}, static_cast<int64_t>(src.size())}) {
      for (int64_t off : {0, 3}) {
        std::vector<uint16_t> f16(n + 1, 0xdead), bf16(n + 1, 0xdead);
        convert_f32_row(isa, KvDtype::kF16, src.data() + off, f16.data(), n);
        convert_f32_row(isa, KvDtype::kBF16, src.data() + off, bf16.data(), n);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(f16[i], f32_to_f16(src[off + i]))
              << isa_name(isa) << " f16 of bits " << std::hex << f32_to_bits(src[off + i]);
          ASSERT_EQ(bf16[i], f32_to_bf16(src[off + i]))
              << isa_name(isa) << " bf16 of bits " << std::hex << f32_to_bits(src[off + i]);
        }
        EXPECT_EQ(f16[n], 0xdead) << "wrote past the row";
        EXPECT_EQ(bf16[n], 0xdead) << "wrote past the row";
      }
    }
    std::vector<float> f32(src.size());
    convert_f32_row(isa, KvDtype::kF32, src.data(), f32.data(), static_cast<int64_t>(src.size()));
    EXPECT_EQ(std::memcmp(f32.data(), src.data(), src.size() * 4), 0);
  }
}

// Reads element (block b, head h, slot s, dim i) of K or V through the
// kv_view.h formula, as float.
float read_elem(const PagedKvLayerView& v, bool is_v, int64_t b, int64_t h, int64_t s, int64_t i) {
  const uint8_t* base = is_v ? v.v : v.k;
  const uint8_t* p = base + b * v.block_stride + h * v.head_stride + s * v.slot_stride +
                     i * kv_dtype_bytes(v.dtype);
  uint16_t x;
  switch (v.dtype) {
    case KvDtype::kF32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case KvDtype::kF16:
      std::memcpy(&x, p, 2);
      return f16_to_f32(x);
    case KvDtype::kBF16:
      std::memcpy(&x, p, 2);
      return bf16_to_f32(x);
    default:  // quantized formats: kv_codec_test.cpp
      break;
  }
  return NAN;
}

float stored(KvDtype t, float f) {
  if (t == KvDtype::kF16) return f16_to_f32(f32_to_f16(f));
  if (t == KvDtype::kBF16) return bf16_to_f32(f32_to_bf16(f));
  return f;
}

// Distinct value per (layer, kv, position, head, dim).
float value_of(int l, int kv, int64_t pos, int64_t h, int64_t i) {
  return static_cast<float>(l * 7 + kv * 3) + static_cast<float>(pos) * 0.25f +
         static_cast<float>(h) * 0.0625f + static_cast<float>(i) * (1.0f / 1024.0f);
}

TEST(WriteKv, LandsAtViewAddressesWithShuffledBlocks) {
  for (KvDtype dtype : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16}) {
    for (int p : {1, 4, 16}) {
      for (Isa isa : {Isa::kScalar, Isa::kAvx2}) {
        if (isa == Isa::kAvx2 && !have_avx2()) continue;
        const int n_layers = 3, h_kv = 3, d = 20;  // d not a multiple of 8/16: vector tails
        auto layout = KvLayout::uniform(n_layers, h_kv, d, dtype, p);
        ASSERT_TRUE(layout.ok());
        const int64_t n_blocks = 24;
        auto pool_r = BlockPool::create(*layout, {.n_tokens = n_blocks * p});
        ASSERT_TRUE(pool_r.ok());
        BlockPool& pool = **pool_r;
        std::memset(pool.block_data(BlockId{0}), 0x5a, n_blocks * pool.block_bytes());
        // Take every block, then use them in shuffled order as a table.
        std::vector<BlockRef> refs;
        refs.reserve(static_cast<size_t>(n_blocks));
        for (int64_t b = 0; b < n_blocks; ++b) refs.push_back(std::move(pool.allocate()).value());
        std::vector<int32_t> table;
        table.reserve(refs.size());
        for (const BlockRef& r : refs) table.push_back(r.id().value);
        std::shuffle(table.begin(), table.end(), std::mt19937(p * 31 + static_cast<int>(dtype)));
        table.resize(n_blocks / 2);
        const int64_t n_tok = static_cast<int64_t>(table.size()) * p - (p > 1 ? 1 : 0);
        // Write in uneven chunks (prefill then decode-sized pieces).
        for (int l = 0; l < n_layers; ++l) {
          int64_t pos = 0;
          while (pos < n_tok) {
            const int64_t n = std::min<int64_t>(n_tok - pos, pos == 0 ? 2 * p + 1 : 1 + pos % 3);
            std::vector<float> k(n * h_kv * d), v(n * h_kv * d);
            for (int64_t t = 0; t < n; ++t) {
              for (int64_t h = 0; h < h_kv; ++h) {
                for (int64_t i = 0; i < d; ++i) {
                  k[(t * h_kv + h) * d + i] = value_of(l, 0, pos + t, h, i);
                  v[(t * h_kv + h) * d + i] = value_of(l, 1, pos + t, h, i);
                }
              }
            }
            write_kv_isa(isa, pool.layer_view(l), table, pos, k.data(), v.data(), n);
            pos += n;
          }
        }
        int64_t n_checked = 0;
        for (int l = 0; l < n_layers; ++l) {
          const PagedKvLayerView view = pool.layer_view(l);
          for (int64_t pos = 0; pos < n_tok; ++pos) {
            for (int64_t h = 0; h < h_kv; ++h) {
              for (int64_t i = 0; i < d; ++i) {
                const int64_t b = table[pos / p], s = pos % p;
                ASSERT_EQ(read_elem(view, false, b, h, s, i),
                          stored(dtype, value_of(l, 0, pos, h, i)))
                    << "K layer " << l << " pos " << pos << " head " << h << " dim " << i;
                ASSERT_EQ(read_elem(view, true, b, h, s, i),
                          stored(dtype, value_of(l, 1, pos, h, i)))
                    << "V layer " << l << " pos " << pos;
                n_checked += 2;
              }
            }
          }
        }
        EXPECT_EQ(n_checked, int64_t{2} * n_layers * n_tok * h_kv * d);
        // Bytes of blocks outside the table are untouched.
        std::vector<bool> in_table(n_blocks, false);
        for (int32_t b : table) in_table[b] = true;
        for (int32_t b = 0; b < n_blocks; ++b) {
          if (in_table[b]) continue;
          const uint8_t* data = pool.block_data(BlockId{b});
          ASSERT_TRUE(
              std::all_of(data, data + pool.block_bytes(), [](uint8_t x) { return x == 0x5a; }))
              << "block " << b << " not in the table was modified";
        }
      }
    }
  }
}

TEST(WriteKv, TableWriteAndMlaLayer) {
  // Layer 0: standard 2 heads x 8 dims f16; layer 1: MLA d_c = 12, d_R = 4, bf16.
  std::vector<KvLayerSpec> specs = {
      {.n_kv_heads = 2, .head_dim_k = 8, .head_dim_v = 8, .dtype = KvDtype::kF16},
      {.kind = KvLayerKind::kMlaLatent, .latent_dim = 12, .rope_dim = 4, .dtype = KvDtype::kBF16},
  };
  auto layout = KvLayout::create(specs, 4);
  ASSERT_TRUE(layout.ok());
  auto pool_r = BlockPool::create(*layout, {.n_tokens = 64});
  ASSERT_TRUE(pool_r.ok());
  BlockPool& pool = **pool_r;
  BlockTable other(pool);  // takes block 0 so the table's blocks are not 0..n
  ASSERT_TRUE(other.reserve(1).ok());
  BlockTable t(pool);
  ASSERT_TRUE(t.reserve(6).ok());
  std::vector<float> k(6 * 2 * 8), v(6 * 2 * 8), lat(6 * 16);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(i);
    v[i] = -static_cast<float>(i);
  }
  for (size_t i = 0; i < lat.size(); ++i) lat[i] = 0.5f * static_cast<float>(i);
  t.write(0, 0, k.data(), v.data(), 6);
  t.write(1, 0, lat.data(), nullptr, 6);
  t.commit(6);
  const PagedKvLayerView v0 = pool.layer_view(0), v1 = pool.layer_view(1);
  for (int64_t pos = 0; pos < 6; ++pos) {
    const int64_t b = t.ids()[pos / 4], s = pos % 4;
    for (int64_t h = 0; h < 2; ++h) {
      for (int64_t i = 0; i < 8; ++i) {
        EXPECT_EQ(read_elem(v0, false, b, h, s, i), k[(pos * 2 + h) * 8 + i]);
        EXPECT_EQ(read_elem(v0, true, b, h, s, i), v[(pos * 2 + h) * 8 + i]);
      }
    }
    for (int64_t i = 0; i < 16; ++i) {
      EXPECT_EQ(read_elem(v1, false, b, 0, s, i), stored(KvDtype::kBF16, lat[pos * 16 + i]));
    }
  }
  // Decode step: one more token into the partly filled tail block.
  ASSERT_TRUE(t.reserve(1).ok());
  EXPECT_EQ(t.n_blocks(), 2);
  std::vector<float> k1(16, 3.0f), v1r(16, 4.0f), lat1(16, 5.0f);
  t.write(0, 6, k1.data(), v1r.data(), 1);
  t.write(1, 6, lat1.data(), nullptr, 1);
  t.commit(1);
  EXPECT_EQ(read_elem(v0, true, t.ids()[1], 1, 2, 7), 4.0f);
  EXPECT_EQ(read_elem(v1, false, t.ids()[1], 0, 2, 15), 5.0f);
  // Position 5 (written in the prefill) is intact.
  EXPECT_EQ(read_elem(v0, false, t.ids()[1], 0, 1, 0), k[(5 * 2 + 0) * 8 + 0]);
  pool.check_invariants();
}

}  // namespace
}  // namespace kvstack
