// Layout conversion of transferred blocks (kv_convert.h): block size and
// float dtype changes keep every value (or apply this side's own encoder),
// unconvertible pairs are refused, and the producer's layout is rebuilt
// exactly from its kv_format string.
#include "transfer/kv_convert.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "core/check.h"
#include "kv/cache_identity.h"
#include "kv/kv_write.h"

namespace kvstack::transfer {
namespace {

constexpr int kLayers = 2;
constexpr int kHeads = 2;
constexpr int kDim = 8;
constexpr int64_t kTokens = 40;  // not a multiple of any block size used

KvLayout layout(KvDtype k, int block_size, std::optional<KvDtype> v = std::nullopt) {
  auto l = KvLayout::uniform(kLayers, kHeads, kDim, k, block_size, v);
  KV_CHECK(l.ok(), "layout");
  return *l;
}

// A pool of n blocks (64-byte aligned), freed on destruction.
struct Pool {
  explicit Pool(const KvLayout& l, int n)
      : bytes(static_cast<size_t>(l.block_bytes() * n)),
        base(static_cast<uint8_t*>(std::aligned_alloc(64, bytes))) {
    std::memset(base, 0, bytes);
  }
  ~Pool() { std::free(base); }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  size_t bytes;
  uint8_t* base;
};

std::vector<int32_t> table(const KvLayout& l, int64_t n_tokens, bool reversed) {
  const int64_t n = (n_tokens + l.block_size() - 1) / l.block_size();
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    t[static_cast<size_t>(i)] = static_cast<int32_t>(reversed ? n - 1 - i : i);
  return t;
}

std::vector<float> rows(uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, 3.f);
  std::vector<float> r(static_cast<size_t>(kTokens * kHeads * kDim));
  for (float& x : r) x = d(g);
  return r;
}

// Writes the same rows into every layer of `l` (block table t over base).
void fill(const KvLayout& l, uint8_t* base, const std::vector<int32_t>& t, uint32_t seed) {
  for (int layer = 0; layer < l.n_layers(); ++layer) {
    const auto k = rows(seed + 2 * layer);
    const auto v = rows(seed + 2 * layer + 1);
    write_kv(l.layer_view(layer, base), t, 0, k.data(), v.data(), kTokens);
  }
}

// Every layer's K and V, tokens [from, kTokens), decoded to float.
std::vector<float> dump(const KvLayout& l, uint8_t* base, const std::vector<int32_t>& t,
                        int64_t from) {
  std::vector<float> out;
  const size_t n = static_cast<size_t>((kTokens - from) * kHeads * kDim);
  std::vector<float> k(n);
  std::vector<float> v(n);
  for (int layer = 0; layer < l.n_layers(); ++layer) {
    read_kv(l.layer_view(layer, base), t, from, kTokens - from, k.data(), v.data());
    out.insert(out.end(), k.begin(), k.end());
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

struct Case {
  KvDtype src;
  int src_p;
  KvDtype dst;
  int dst_p;
};

TEST(KvConvert, BlockSizeAndFloatDtypeChangesKeepTheValues) {
  for (const Case c :
       {Case{KvDtype::kF16, 16, KvDtype::kF16, 8}, Case{KvDtype::kF16, 16, KvDtype::kF16, 32},
        Case{KvDtype::kBF16, 4, KvDtype::kBF16, 16}, Case{KvDtype::kF16, 16, KvDtype::kF32, 32},
        Case{KvDtype::kBF16, 16, KvDtype::kF32, 16}, Case{KvDtype::kF32, 8, KvDtype::kF16, 16},
        Case{KvDtype::kF32, 16, KvDtype::kBF16, 16}}) {
    SCOPED_TRACE(std::string(kv_dtype_name(c.src)) + "/" + std::to_string(c.src_p) + " -> " +
                 kv_dtype_name(c.dst) + "/" + std::to_string(c.dst_p));
    const KvLayout src = layout(c.src, c.src_p);
    const KvLayout dst = layout(c.dst, c.dst_p);
    ASSERT_TRUE(check_convertible(src, dst).ok());
    const auto st = table(src, kTokens, /*reversed=*/true);  // scattered blocks
    const auto dt = table(dst, kTokens, /*reversed=*/false);
    Pool sp(src, static_cast<int>(st.size()));
    Pool dp(dst, static_cast<int>(dt.size()));
    fill(src, sp.base, st, 7);
    // From a position inside the destination's second block, as after a
    // partly adopted local prefix (tokens before `from` are not touched).
    const int64_t from = c.dst_p;
    convert_kv_blocks(src, sp.base, st, dst, dp.base, dt, from, kTokens - from);
    // Reference: the destination format written directly from the values
    // the source holds (exact for widening; this side's encoder otherwise).
    std::vector<float> held = dump(src, sp.base, st, 0);
    Pool rp(dst, static_cast<int>(dt.size()));
    for (int layer = 0; layer < kLayers; ++layer) {
      const size_t n = static_cast<size_t>(kTokens * kHeads * kDim);
      const float* k = held.data() + 2 * n * static_cast<size_t>(layer);
      write_kv(dst.layer_view(layer, rp.base), dt, 0, k, k + n, kTokens);
    }
    EXPECT_TRUE(bit_equal(dump(dst, dp.base, dt, from), dump(dst, rp.base, dt, from)));
    if (c.dst == c.src || c.dst == KvDtype::kF32) {  // nothing lost
      EXPECT_TRUE(bit_equal(dump(dst, dp.base, dt, from), dump(src, sp.base, st, from)));
    }
    // Tokens before `from` stay as they were (zero here).
    std::vector<float> head(static_cast<size_t>(from * kHeads * kDim));
    std::vector<float> hv(head.size());
    read_kv(dst.layer_view(0, dp.base), dt, 0, from, head.data(), hv.data());
    for (float x : head) ASSERT_EQ(x, 0.f);
  }
}

TEST(KvConvert, UnconvertiblePairsAreRefusedByName) {
  auto refused = [](const KvLayout& a, const KvLayout& b, const char* what) {
    const Status s = check_convertible(a, b);
    ASSERT_FALSE(s.ok()) << what;
    EXPECT_EQ(s.error().code, Errc::kUnsupported);
    EXPECT_NE(s.error().message.find(what), std::string::npos) << s.error().message;
  };
  refused(layout(KvDtype::kF16, 16), layout(KvDtype::kBF16, 16), "f16 -> bf16");
  refused(layout(KvDtype::kBF16, 16), layout(KvDtype::kF16, 32), "bf16 -> f16");
  refused(layout(KvDtype::kInt8, 16), layout(KvDtype::kInt8, 32), "quantized");
  refused(layout(KvDtype::kF16, 16), layout(KvDtype::kF16, 16, KvDtype::kInt8), " V f16 -> int8");
  auto other = KvLayout::uniform(kLayers, kHeads + 1, kDim, KvDtype::kF16, 16);
  ASSERT_TRUE(other.ok());
  refused(layout(KvDtype::kF16, 16), *other, "geometry");
}

TEST(KvConvert, ProducerLayoutIsRebuiltFromItsFormatString) {
  const KvLayout local = layout(KvDtype::kF16, 16);
  for (const KvLayout& remote : {layout(KvDtype::kF32, 32), layout(KvDtype::kBF16, 8),
                                 layout(KvDtype::kF16, 16, KvDtype::kF32)}) {
    auto got = producer_layout(local, kv_format_key(remote));
    ASSERT_TRUE(got.ok()) << got.error().message;
    EXPECT_EQ(kv_format_key(*got), kv_format_key(remote));
    EXPECT_TRUE(got->same_format(remote));
  }
  auto other = KvLayout::uniform(kLayers, kHeads + 1, kDim, KvDtype::kF16, 16);
  ASSERT_TRUE(other.ok());
  EXPECT_FALSE(producer_layout(local, kv_format_key(*other)).ok());
  auto more = KvLayout::uniform(kLayers + 1, kHeads, kDim, KvDtype::kF16, 16);
  ASSERT_TRUE(more.ok());
  EXPECT_FALSE(producer_layout(local, kv_format_key(*more)).ok());
  for (const char* junk : {"", "int8", "P=x;[0,1,dt", "P=16;bb=1;L=2;[0,2,8,8,0,0,dt9/1,w0]"}) {
    auto r = producer_layout(local, junk);
    ASSERT_FALSE(r.ok()) << junk;
    EXPECT_EQ(r.error().code, Errc::kUnsupported);
  }
}

}  // namespace
}  // namespace kvstack::transfer
