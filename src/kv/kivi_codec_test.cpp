// KIVI codec round trips (kivi2, kivi4) on random and adversarial data, the
// layout's geometry, and the block table's residual: groups converted at
// commit exactly when they leave the newest R tokens, forks and prefix
// adoption copying/sharing correctly.
#include "kv/kivi_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/half.h"
#include "kv/block_pool.h"
#include "kv/block_table.h"
#include "kv/kv_write.h"
#include "kv/layout.h"

namespace kvstack {
namespace {

template <typename T>
T must(Result<T> r) {
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message);
  return std::move(*r);
}

float meta_f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// Checks one quantization group of n values (x[i * stride], decoded
// y[i * stride]): the encoder (asym_quant_fit) never does worse than the
// min-max fit, whose every value is within half a step s_mm / 2, s_mm =
// (max - min) / qmax (plus f16 rounding of min and scale); a constant group
// (s_mm == 0) decodes to x rounded to f16.
void expect_group_within(const float* x, const float* y, int64_t stride, int n, int qmax,
                         const char* what) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
  }
  if (lo == hi) {
    for (int i = 0; i < n; ++i) {
      ASSERT_LE(std::fabs(x[i * stride] - y[i * stride]), std::fabs(lo) / 1024 + 6e-8f) << what;
    }
    return;
  }
  const double s_mm =
      (static_cast<double>(hi) - lo + std::fabs(lo) / 1024.0) / qmax * (1.0 + 1.0 / 1024.0);
  double sse = 0.0;
  for (int i = 0; i < n; ++i) {
    const double e = static_cast<double>(x[i * stride]) - y[i * stride];
    sse += e * e;
  }
  ASSERT_LE(sse, n * (s_mm / 2) * (s_mm / 2) * (1.0 + 1e-4) + 1e-30)
      << what << ": group of " << n << " in [" << lo << ", " << hi << "]";
}

enum class Data { kRandom, kOutlierChannels, kConstant, kZeros, kHuge };

std::vector<float> make_data(Data kind, int n_tok, int d, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n_tok) * d);
  for (int t = 0; t < n_tok; ++t) {
    for (int c = 0; c < d; ++c) {
      float& v = x[static_cast<size_t>(t) * d + c];
      switch (kind) {
        case Data::kRandom:
          v = nd(rng);
          break;
        case Data::kOutlierChannels:
          v = nd(rng) * (c % 13 == 5 ? 200.0f : 1.0f) + (c == 7 ? 50.0f : 0.0f);
          break;
        case Data::kConstant: {
          // Constant along the tokens of a channel and within each group of
          // 32 channels: every key and value group is constant.
          const auto group = c / 32;
          v = -0.7f + 1.5f * static_cast<float>(group);
          break;
        }
        case Data::kZeros:
          v = 0.0f;
          break;
        case Data::kHuge:
          v = nd(rng) > 0 ? 65504.0f * (0.5f + 0.5f * std::fabs(std::tanh(nd(rng))))
                          : -65504.0f * std::fabs(std::tanh(nd(rng)));
          break;
      }
    }
  }
  return x;
}

class KiviRoundTrip : public ::testing::TestWithParam<int> {};

TEST_P(KiviRoundTrip, KeysPerChannelAndValuesPerTokenWithinTheMinMaxError) {
  const int bits = GetParam();
  std::mt19937 rng(bits);
  for (Data kind :
       {Data::kRandom, Data::kOutlierChannels, Data::kConstant, Data::kZeros, Data::kHuge}) {
    for (int d : {32, 64, 128}) {
      for (int g : {1, 4, 16, 32}) {
        SCOPED_TRACE("kind " + std::to_string(static_cast<int>(kind)) + " d " + std::to_string(d) +
                     " g " + std::to_string(g));
        const std::vector<float> x = make_data(kind, g, d, rng);
        ASSERT_TRUE(kivi_validate_values(x.data(), static_cast<int64_t>(x.size())).ok());
        const int row_bytes = d * bits / 8;
        const int64_t stride = row_bytes + 3;  // codes rows need not be packed
        std::vector<uint8_t> codes(static_cast<size_t>(g * stride), 0xAA);
        std::vector<uint8_t> kmeta(static_cast<size_t>(d) * 4);
        kivi_encode_key_group(bits, x.data(), d, g, d, codes.data(), stride, kmeta.data());
        const int qmax = (1 << bits) - 1;
        std::vector<float> out(static_cast<size_t>(g) * d);
        for (int t = 0; t < g; ++t) {
          kivi_decode_key_row(bits, codes.data() + t * stride, kmeta.data(), d, out.data() + t * d);
          // Bytes past the row's codes are untouched.
          for (int64_t i = row_bytes; i < stride; ++i) ASSERT_EQ(codes[t * stride + i], 0xAA);
        }
        double err_sum = 0, range_sum = 0;
        for (int c = 0; c < d; ++c) {  // key groups: one channel over the g tokens
          expect_group_within(x.data() + c, out.data() + c, d, g, qmax, "key");
          for (int t = 0; t < g; ++t) err_sum += std::fabs(x[t * d + c] - out[t * d + c]);
          range_sum += g * meta_f(kmeta.data() + 4 * c);
        }
        if (kind == Data::kZeros) {
          ASSERT_EQ(err_sum, 0.0);
        }
        if (kind == Data::kRandom && g >= 16) {
          // Uniform rounding error averages about s / 4, well below s / 2.
          EXPECT_LT(err_sum, 0.35 * range_sum);
        }
        std::vector<uint8_t> vcodes(static_cast<size_t>(row_bytes));
        std::vector<uint8_t> vmeta(static_cast<size_t>(d / 32) * 4);
        for (int t = 0; t < g; ++t) {
          const float* row = x.data() + static_cast<size_t>(t) * d;
          kivi_encode_value_row(bits, row, d, vcodes.data(), vmeta.data());
          kivi_decode_value_row(bits, vcodes.data(), vmeta.data(), d, out.data());
          for (int c = 0; c < d; c += 32)
            expect_group_within(row + c, out.data() + c, 1, 32, qmax, "value");
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Bits, KiviRoundTrip, ::testing::Values(2, 4));

TEST(KiviCodec, PackUnpackAreInverse) {
  std::mt19937 rng(3);
  for (int bits : {2, 4}) {
    std::vector<uint8_t> q(96), back(96), packed(96 * bits / 8);
    for (auto& v : q) v = static_cast<uint8_t>(rng() % (1u << bits));
    kivi_pack_codes(bits, q.data(), 96, packed.data());
    kivi_unpack_codes(bits, packed.data(), 96, back.data());
    EXPECT_EQ(q, back);
  }
  // 4-bit order equals int4's nibble order: element j low, j + 16 high.
  std::vector<uint8_t> q(32, 0);
  q[3] = 5;
  q[19] = 9;
  uint8_t packed[16];
  kivi_pack_codes(4, q.data(), 32, packed);
  EXPECT_EQ(packed[3], 0x95);
}

TEST(KiviCodec, RejectsNonFiniteAndOutOfRangeValuesNamingTheElement) {
  std::vector<float> x(8, 1.0f);
  x[5] = std::nanf("");
  Status s = kivi_validate_values(x.data(), 8);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("element 5"), std::string::npos) << s.error().message;
  x[5] = INFINITY;
  EXPECT_FALSE(kivi_validate_values(x.data(), 8).ok());
  x[5] = 70000.0f;
  s = kivi_validate_values(x.data(), 8);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.error().message.find("f16"), std::string::npos);
  x[5] = -65504.0f;
  EXPECT_TRUE(kivi_validate_values(x.data(), 8).ok());
}

TEST(KiviLayout, BytesPerElementAreWOver8PlusSOverG) {
  EXPECT_EQ(must(parse_kv_dtype("kivi2")), kKvDtypeKivi2);
  EXPECT_STREQ(kv_dtype_name(kKvDtypeKivi4), "kivi4");
  EXPECT_FALSE(KvLayout::uniform(1, 2, 48, kKvDtypeKivi2, 16).ok());  // 48 % 32 != 0
  EXPECT_FALSE(
      KvLayout::create(
          {KvLayerSpec{
              .n_kv_heads = 1, .head_dim_k = 64, .head_dim_v = 64, .dtype = kKvDtypeKivi2}},
          16, {.kivi_residual = 24})
          .ok());  // R not a multiple of G = 16
  for (int p : {16, 32, 64}) {
    const int g = kivi_group_size(p);
    for (KvDtype t : {kKvDtypeKivi2, kKvDtypeKivi4}) {
      const int w = kv_dtype_kivi_bits(t);
      const KvLayout l = must(KvLayout::uniform(3, 2, 64, t, p));
      EXPECT_TRUE(l.has_kivi());
      EXPECT_EQ(l.kivi_group(), g);
      EXPECT_EQ(l.kivi_residual(), 128);
      // Per element: K w/8 + 4/G (per-block metadata), V w/8 + 4/32 (per token).
      const double k_bytes = 3.0 * 2 * 64 * (w / 8.0 + 4.0 / g);
      const double v_bytes = 3.0 * 2 * 64 * (w / 8.0 + 4.0 / 32);
      EXPECT_EQ(l.payload_bytes(p), static_cast<int64_t>((k_bytes + v_bytes) * p));
      EXPECT_EQ(l.block_meta_bytes(), static_cast<int64_t>(3 * 2 * 64 * 4 * (p / g)));
    }
  }
  // K and V formats may differ.
  const KvLayout mixed = must(KvLayout::uniform(1, 1, 64, kKvDtypeKivi2, 16, KvDtype::kInt8));
  EXPECT_TRUE(mixed.layer_view(0, nullptr).v_distinct);
  EXPECT_EQ(mixed.layer_payload_bytes_per_token(0), 16 + 0 + 64 + 2);
}

// ---------------------------------------------------------------------------
// Block table residual.
// ---------------------------------------------------------------------------

struct Rows {
  std::vector<float> k, v;  // [n, H, d]
};

Rows random_rows(int n, int h, int d, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Rows r;
  r.k.resize(static_cast<size_t>(n) * h * d);
  r.v.resize(r.k.size());
  for (size_t i = 0; i < r.k.size(); ++i) {
    r.k[i] = nd(rng) * ((i % d) == 3 ? 20.0f : 1.0f);
    r.v[i] = nd(rng);
  }
  return r;
}

// Appends rows [b, e) of `all` to `t` in one step, all layers.
void append(BlockTable& t, const Rows& all, int b, int e, int h, int d) {
  ASSERT_TRUE(t.reserve(e - b).ok());
  const int64_t w = int64_t{h} * d;
  for (int l = 0; l < t.pool().layout().n_layers(); ++l) {
    t.write(l, b, all.k.data() + b * w, all.v.data() + b * w, e - b);
  }
  t.commit(e - b);
}

// What the table must hold: groups below `converted` quantized from the f16
// residual rows (at the same moments), the rest f16.
void expect_table_holds(const BlockTable& t, const Rows& all, int h, int d) {
  const KvLayout& layout = t.pool().layout();
  const int64_t w = int64_t{h} * d;
  const int64_t q = t.converted();
  const int64_t g = layout.kivi_group();
  const int64_t r = layout.kivi_residual();
  ASSERT_EQ(q % g, 0);
  ASSERT_GE(t.length() - q, std::min<int64_t>(t.length(), r));
  std::vector<float> f16k(all.k.size()), f16v(all.v.size());
  for (size_t i = 0; i < all.k.size(); ++i) {
    f16k[i] = f16_to_f32(f32_to_f16(all.k[i]));
    f16v[i] = f16_to_f32(f32_to_f16(all.v[i]));
  }
  for (int l = 0; l < layout.n_layers(); ++l) {
    const PagedKvLayerView view = t.pool().layer_view(l);
    // Expected codes: encode the f16 rows group by group into a scratch pool.
    std::vector<float> got_k(static_cast<size_t>(q * w)), got_v(got_k.size());
    read_kv(view, t.ids(), 0, q, got_k.data(), got_v.data());
    const int bits_k = kv_dtype_kivi_bits(view.dtype);
    std::vector<uint8_t> codes(static_cast<size_t>(g * d)), meta(static_cast<size_t>(d) * 4);
    std::vector<float> row(d);
    for (int64_t t0 = 0; t0 < q; t0 += g) {
      for (int hh = 0; hh < h; ++hh) {
        kivi_encode_key_group(bits_k, f16k.data() + t0 * w + hh * d, w, static_cast<int>(g), d,
                              codes.data(), d, meta.data());
        for (int64_t j = 0; j < g; ++j) {
          kivi_decode_key_row(bits_k, codes.data() + j * d, meta.data(), d, row.data());
          for (int c = 0; c < d; ++c) {
            ASSERT_EQ(got_k[(t0 + j) * w + hh * d + c], row[c])
                << "layer " << l << " pos " << t0 + j << " head " << hh << " ch " << c;
          }
        }
      }
    }
    for (int64_t p = 0; p < q; ++p) {
      for (int hh = 0; hh < h; ++hh) {
        std::vector<uint8_t> vc(d), vm(static_cast<size_t>(d / 32) * 4);
        kivi_encode_value_row(kv_dtype_kivi_bits(view.value_dtype()), f16v.data() + p * w + hh * d,
                              d, vc.data(), vm.data());
        kivi_decode_value_row(kv_dtype_kivi_bits(view.value_dtype()), vc.data(), vm.data(), d,
                              row.data());
        for (int c = 0; c < d; ++c) ASSERT_EQ(got_v[p * w + hh * d + c], row[c]);
      }
    }
    const KvResidualView res = t.residual_view(l);
    ASSERT_EQ(res.start, q);
    ASSERT_EQ(res.n_tokens, t.length() - q);
    for (int64_t i = 0; i < res.n_tokens * w; ++i) {
      ASSERT_EQ(f16_to_f32(res.k[i]), f16k[q * w + i]);
      ASSERT_EQ(f16_to_f32(res.v[i]), f16v[q * w + i]);
    }
  }
}

TEST(KiviBlockTable, GroupsConvertAtCommitOnceOutsideTheResidual) {
  const int h = 2, d = 64, p = 8;
  for (KvDtype t : {kKvDtypeKivi2, kKvDtypeKivi4}) {
    auto layout = must(KvLayout::uniform(2, h, d, t, p, std::nullopt, {.kivi_residual = 16}));
    auto pool = must(BlockPool::create(layout, {.n_tokens = 512}));
    std::mt19937 rng(11);
    const Rows all = random_rows(200, h, d, rng);
    BlockTable a(*pool);
    int pos = 0;
    for (int chunk : {5, 1, 1, 30, 1, 2, 7, 1}) {
      append(a, all, pos, pos + chunk, h, d);
      pos += chunk;
      EXPECT_EQ(a.converted(), std::max(0, (pos - 16) / 8 * 8));
      expect_table_holds(a, all, h, d);
    }
    // An abandoned step leaves nothing in the residual.
    ASSERT_TRUE(a.reserve(3).ok());
    a.write(0, pos, all.k.data() + pos * h * d, all.v.data() + pos * h * d, 3);
    EXPECT_EQ(a.residual_view(0).n_tokens, pos + 3 - a.converted());
    a.rollback();
    EXPECT_EQ(a.residual_view(0).n_tokens, pos - a.converted());
    expect_table_holds(a, all, h, d);

    // Fork in the middle of a partly converted block: both continue with
    // different rows; the shared blocks are copied before a conversion writes.
    BlockTable b = a.fork();
    const Rows other = [&] {
      Rows o = all;
      std::mt19937 r2(99);
      const Rows x = random_rows(200, h, d, r2);
      std::copy(x.k.begin() + pos * h * d, x.k.end(), o.k.begin() + pos * h * d);
      std::copy(x.v.begin() + pos * h * d, x.v.end(), o.v.begin() + pos * h * d);
      return o;
    }();
    const int64_t cow_before = pool->stats().n_cow_copies;
    for (int i = 0; i < 40; ++i) {
      append(a, all, pos + i, pos + i + 1, h, d);
      append(b, other, pos + i, pos + i + 1, h, d);
      if (i % 8 == 7) {
        expect_table_holds(a, all, h, d);
        expect_table_holds(b, other, h, d);
      }
    }
    EXPECT_GT(pool->stats().n_cow_copies, cow_before);
    pos += 40;

    // Prefix sharing: only converted blocks may be shared; the adopter starts
    // with everything converted and an empty residual.
    const int64_t n_share = a.shareable_length() / p;
    ASSERT_GT(n_share, 2);
    std::vector<BlockRef> refs;
    for (int64_t i = 0; i < n_share; ++i) refs.push_back(a.share_block(i));
    BlockTable c(*pool);
    c.adopt_prefix(std::move(refs));
    EXPECT_EQ(c.converted(), n_share * p);
    EXPECT_EQ(c.residual_view(0).n_tokens, 0);
    append(c, all, static_cast<int>(n_share * p), static_cast<int>(n_share * p) + 20, h, d);
    expect_table_holds(c, all, h, d);
    expect_table_holds(a, all, h, d);
    pool->check_invariants();
  }
}

// A KV transfer places converted blocks' bytes directly into a table's
// reserved blocks: commit_final counts them as converted (no residual
// pass), and the table continues exactly like one that adopted them.
TEST(KiviBlockTable, CommitFinalTakesPlacedBlocksAsConverted) {
  const int h = 2, d = 64, p = 8;
  for (KvDtype t : {kKvDtypeKivi2, kKvDtypeKivi4}) {
    auto layout = must(KvLayout::uniform(2, h, d, t, p, std::nullopt, {.kivi_residual = 16}));
    auto pool = must(BlockPool::create(layout, {.n_tokens = 512}));
    std::mt19937 rng(5);
    const Rows all = random_rows(160, h, d, rng);
    BlockTable a(*pool);
    append(a, all, 0, 100, h, d);
    const int64_t n = a.shareable_length() / p;
    ASSERT_GT(n, 2);
    BlockTable c(*pool);
    ASSERT_TRUE(c.reserve(n * p).ok());
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(pool->block_data(BlockId{c.ids()[i]}), pool->block_data(BlockId{a.ids()[i]}),
                  static_cast<size_t>(pool->block_bytes()));
    }
    c.commit_final(n * p);
    EXPECT_EQ(c.length(), n * p);
    EXPECT_EQ(c.converted(), n * p);
    EXPECT_EQ(c.residual_view(0).n_tokens, 0);
    append(c, all, static_cast<int>(n * p), static_cast<int>(n * p) + 30, h, d);
    expect_table_holds(c, all, h, d);
    pool->check_invariants();
  }
}

TEST(KiviBlockTable, PartialAdoptionReexpandsTheCutGroupIntoTheResidual) {
  const int h = 1, d = 32, p = 16;  // G = 16
  auto layout =
      must(KvLayout::uniform(1, h, d, kKvDtypeKivi4, p, std::nullopt, {.kivi_residual = 0}));
  auto pool = must(BlockPool::create(layout, {.n_tokens = 256}));
  std::mt19937 rng(5);
  const Rows all = random_rows(64, h, d, rng);
  BlockTable a(*pool);
  append(a, all, 0, 32, h, d);  // R = 0: everything converted at commit
  ASSERT_EQ(a.converted(), 32);
  BlockRef src = a.share_block(1);
  std::vector<BlockRef> first;
  first.push_back(a.share_block(0));
  BlockTable b(*pool);
  b.adopt_prefix(std::move(first));
  ASSERT_TRUE(b.adopt_partial_copy(std::move(src), 5).ok());
  EXPECT_EQ(b.length(), 21);
  EXPECT_EQ(b.converted(), 16);
  // The residual holds the decoded values of positions 16..20 of a's group.
  std::vector<float> k(5 * d), v(5 * d);
  read_kv(pool->layer_view(0), a.ids(), 16, 5, k.data(), v.data());
  const KvResidualView res = b.residual_view(0);
  ASSERT_EQ(res.n_tokens, 5);
  for (int i = 0; i < 5 * d; ++i) {
    EXPECT_EQ(f16_to_f32(res.k[i]), f16_to_f32(f32_to_f16(k[i])));
    EXPECT_EQ(f16_to_f32(res.v[i]), f16_to_f32(f32_to_f16(v[i])));
  }
  pool->check_invariants();
}

}  // namespace
}  // namespace kvstack
