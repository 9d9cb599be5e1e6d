// paged_attention: AVX2 and scalar kernels and the paged double reference,
// all against a direct double-precision softmax(q K^T * scale) V computed from
// contiguous per-sequence K/V (the same dtype-rounded values), on random
// shapes with shuffled physical blocks and poisoned (NaN) unused slots.
#include "attention/paged_attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/cpu_features.h"
#include "core/half.h"

namespace kvstack {
namespace {

constexpr double kU = 5.9604644775390625e-8;  // float unit roundoff, 2^-24

struct SeqSpec {
  int n_past;
  int n_new;
};

struct Case {
  int n_q_heads;
  int n_kv_heads;
  int head_dim;
  int block_size;
  KvDtype dtype;
  int window;
  int n_threads;
  bool slot_major;  // [block, slot, head, d] instead of [block, head, slot, d]
  int slot_pad;     // extra bytes after each slot row
  std::vector<SeqSpec> seqs;
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "H_q=" << c.n_q_heads << " H_kv=" << c.n_kv_heads << " d=" << c.head_dim
     << " P=" << c.block_size << " dtype=" << static_cast<int>(c.dtype) << " window=" << c.window
     << " threads=" << c.n_threads << (c.slot_major ? " slot-major" : " head-major")
     << " pad=" << c.slot_pad << " seqs:";
  for (const SeqSpec& q : c.seqs) os << " " << q.n_past << "+" << q.n_new;
  return os.str();
}

float round_to(KvDtype t, float x) {
  if (t == KvDtype::kF16) return f16_to_f32(f32_to_f16(x));
  if (t == KvDtype::kBF16) return bf16_to_f32(f32_to_bf16(x));
  return x;
}

void store_elem(KvDtype t, uint8_t* p, float x) {
  if (t == KvDtype::kF32) {
    std::memcpy(p, &x, 4);
  } else {
    const uint16_t h = t == KvDtype::kF16 ? f32_to_f16(x) : f32_to_bf16(x);
    std::memcpy(p, &h, 2);
  }
}

// A block pool holding every sequence of a case, with its tables, the
// logical (contiguous) K/V the pool was written from, and the queries.
struct World {
  std::vector<uint8_t> k_pool, v_pool;
  PagedKvLayerView view;
  std::vector<std::vector<int32_t>> tables;
  std::vector<std::vector<float>> k, v;  // per seq [n_kv_heads, n_tokens, d], dtype-rounded
  std::vector<std::vector<float>> q;     // per seq [n_new, n_q_heads, d]
  AttnParams params;
};

World build_world(const Case& c, std::mt19937& rng) {
  World w;
  const int d = c.head_dim;
  const int eb = kv_dtype_bytes(c.dtype);
  std::normal_distribution<float> nd;
  int n_blocks_total = 3;  // spare blocks nobody owns
  for (const SeqSpec& s : c.seqs)
    n_blocks_total += (s.n_past + s.n_new + c.block_size - 1) / c.block_size;
  PagedKvLayerView& v = w.view;
  v.dtype = c.dtype;
  v.block_size = c.block_size;
  v.n_kv_heads = c.n_kv_heads;
  v.head_dim = d;
  const int64_t row = int64_t{d} * eb + c.slot_pad;
  if (c.slot_major) {
    v.head_stride = row;
    v.slot_stride = row * c.n_kv_heads;
    v.block_stride = v.slot_stride * c.block_size;
  } else {
    v.slot_stride = row;
    v.head_stride = row * c.block_size;
    v.block_stride = v.head_stride * c.n_kv_heads;
  }
  const size_t bytes = static_cast<size_t>(v.block_stride) * n_blocks_total;
  w.k_pool.resize(bytes);
  w.v_pool.resize(bytes);
  // Poison everything: a kernel that reads a slot it must not see, or a
  // padding byte, produces NaN.
  for (size_t i = 0; i + eb <= bytes; i += eb) {
    store_elem(c.dtype, w.k_pool.data() + i, std::nanf(""));
    store_elem(c.dtype, w.v_pool.data() + i, std::nanf(""));
  }
  v.k = w.k_pool.data();
  v.v = w.v_pool.data();
  std::vector<int32_t> phys(n_blocks_total);
  std::iota(phys.begin(), phys.end(), 0);
  std::shuffle(phys.begin(), phys.end(), rng);
  int next = 0;
  for (const SeqSpec& s : c.seqs) {
    const int n_tokens = s.n_past + s.n_new;
    const int n_blocks = (n_tokens + c.block_size - 1) / c.block_size;
    std::vector<int32_t> table(phys.begin() + next, phys.begin() + next + n_blocks);
    next += n_blocks;
    std::vector<float> k(static_cast<size_t>(c.n_kv_heads) * n_tokens * d);
    std::vector<float> vv(k.size());
    for (int h = 0; h < c.n_kv_heads; ++h) {
      for (int t = 0; t < n_tokens; ++t) {
        const int64_t off = table[t / c.block_size] * v.block_stride + h * v.head_stride +
                            (t % c.block_size) * v.slot_stride;
        for (int i = 0; i < d; ++i) {
          const size_t li = (static_cast<size_t>(h) * n_tokens + t) * d + i;
          k[li] = round_to(c.dtype, nd(rng));
          vv[li] = round_to(c.dtype, nd(rng));
          store_elem(c.dtype, w.k_pool.data() + off + int64_t{i} * eb, k[li]);
          store_elem(c.dtype, w.v_pool.data() + off + int64_t{i} * eb, vv[li]);
        }
      }
    }
    std::vector<float> q(static_cast<size_t>(s.n_new) * c.n_q_heads * d);
    for (float& x : q) x = nd(rng);
    w.tables.push_back(std::move(table));
    w.k.push_back(std::move(k));
    w.v.push_back(std::move(vv));
    w.q.push_back(std::move(q));
  }
  w.params = AttnParams{.n_q_heads = c.n_q_heads,
                        .n_kv_heads = c.n_kv_heads,
                        .head_dim = d,
                        .scale = 1.0f / std::sqrt(static_cast<float>(d)),
                        .window = c.window};
  return w;
}

std::vector<AttnSeq> make_seqs(const Case& c, const World& w,
                               std::vector<std::vector<float>>& out) {
  std::vector<AttnSeq> seqs;
  out.assign(c.seqs.size(), {});
  for (size_t i = 0; i < c.seqs.size(); ++i) {
    out[i].assign(w.q[i].size(), -12345.0f);
    seqs.push_back(AttnSeq{.block_table = w.tables[i].data(),
                           .n_blocks = static_cast<int32_t>(w.tables[i].size()),
                           .n_past = c.seqs[i].n_past,
                           .n_new = c.seqs[i].n_new,
                           .q = w.q[i].data(),
                           .out = out[i].data()});
  }
  return seqs;
}

// Direct double-precision attention over the contiguous K/V, and for each
// output vector an a-priori bound on the error of a float kernel:
//  - a score is a length-d dot product (plus the scale): with rounding errors
//    behaving as independent, its error is about u sqrt(d+2) A, A =
//    scale * sum_i |q_i k_i| (the largest over visible keys);
//  - exp (library or polynomial) adds a few u; rescaling by exp(m_old -
//    m_new) multiplies numerator and denominator alike and cancels;
//  - a relative error eta on every weight p_j moves the normalised output by
//    at most 2 eta max|v|;
//  - sums of L weighted values (and of the weights) in float: about
//    u sqrt(L) max|v| each.
// tol = max|v| * 8 u (2 sqrt(d+2) A + 2 sqrt(L) + 10); the factor 8 makes a
// statistical exceedance practically impossible while an error of one
// misplaced key (~ max|v| / L) or one wrong head stays far above it.
struct Expected {
  std::vector<double> out;  // [n_new, n_q_heads, d]
  std::vector<double> tol;  // [n_new, n_q_heads]
};

Expected direct_attention(const Case& c, const World& w, size_t si) {
  const SeqSpec& s = c.seqs[si];
  const int d = c.head_dim;
  const int g = c.n_q_heads / c.n_kv_heads;
  const int n_tokens = s.n_past + s.n_new;
  const double scale = w.params.scale;
  Expected e;
  e.out.assign(static_cast<size_t>(s.n_new) * c.n_q_heads * d, 0.0);
  e.tol.assign(static_cast<size_t>(s.n_new) * c.n_q_heads, 0.0);
  std::vector<double> sc;
  for (int r = 0; r < s.n_new; ++r) {
    const int pos = s.n_past + r;
    const int lo = c.window > 0 ? std::max(0, pos - c.window + 1) : 0;
    for (int h = 0; h < c.n_q_heads; ++h) {
      const int kvh = h / g;
      const float* q = w.q[si].data() + (static_cast<size_t>(r) * c.n_q_heads + h) * d;
      const float* kh = w.k[si].data() + static_cast<size_t>(kvh) * n_tokens * d;
      const float* vh = w.v[si].data() + static_cast<size_t>(kvh) * n_tokens * d;
      sc.assign(pos + 1 - lo, 0.0);
      double mx = -1e300, a_max = 0.0, v_max = 0.0;
      for (int t = lo; t <= pos; ++t) {
        double dot = 0.0, abs_dot = 0.0;
        for (int i = 0; i < d; ++i) {
          dot += double{q[i]} * kh[static_cast<size_t>(t) * d + i];
          abs_dot += std::fabs(double{q[i]} * kh[static_cast<size_t>(t) * d + i]);
          v_max = std::max(v_max, std::fabs(double{vh[static_cast<size_t>(t) * d + i]}));
        }
        sc[t - lo] = dot * scale;
        a_max = std::max(a_max, abs_dot * scale);
        mx = std::max(mx, sc[t - lo]);
      }
      double sum = 0.0;
      double* o = e.out.data() + (static_cast<size_t>(r) * c.n_q_heads + h) * d;
      for (int t = lo; t <= pos; ++t) {
        const double p = std::exp(sc[t - lo] - mx);
        sum += p;
        for (int i = 0; i < d; ++i) o[i] += p * vh[static_cast<size_t>(t) * d + i];
      }
      for (int i = 0; i < d; ++i) o[i] /= sum;
      const double n_keys = pos + 1 - lo;
      e.tol[static_cast<size_t>(r) * c.n_q_heads + h] =
          v_max * 8 * kU * (2 * std::sqrt(d + 2.0) * a_max + 2 * std::sqrt(n_keys) + 10);
    }
  }
  return e;
}

// Checks got against the direct reference; tol_override >= 0 replaces the
// float-kernel bound with tol_override * (|expected| + max|v|-ish floor).
void expect_close(const Case& c, const std::vector<Expected>& ref,
                  const std::vector<std::vector<float>>& got, const char* what, bool exact_ref) {
  double worst_ratio = 0.0;
  for (size_t si = 0; si < c.seqs.size(); ++si) {
    const int d = c.head_dim;
    for (size_t vi = 0; vi < ref[si].tol.size(); ++vi) {
      for (int i = 0; i < d; ++i) {
        const double want = ref[si].out[vi * d + i];
        const double have = got[si][vi * d + i];
        // The double reference differs from `want` only by its final
        // rounding to float (and double-precision noise).
        const double tol = exact_ref ? kU * std::fabs(want) + 1e-12 : ref[si].tol[vi];
        const double err = std::fabs(have - want);
        if (!(err <= tol)) {
          ADD_FAILURE() << what << " " << describe(c) << "\n  seq " << si << " row "
                        << vi / c.n_q_heads << " q head " << vi % c.n_q_heads << " dim " << i
                        << ": got " << have << " want " << want << " tol " << tol;
          return;
        }
        worst_ratio = std::max(worst_ratio, err / tol);
      }
    }
  }
  ::testing::Test::RecordProperty(std::string(what) + "_worst_err_over_tol",
                                  std::to_string(worst_ratio));
}

// The ISA caps the CPU runs: scalar, avx2, and avx512 (the AVX-512 f16
// decode kernel for f16 KV; f32/bf16 still run AVX2 there) where present.
std::vector<Isa> test_isas() {
  std::vector<Isa> isas = {Isa::kScalar};
  const CpuFeatures& f = cpu_features();
  if (f.avx2 && f.fma && f.f16c) isas.push_back(Isa::kAvx2);
  if (f.avx2 && f.fma && f.f16c && f.avx512f) isas.push_back(Isa::kAvx512);
  return isas;
}

// Whether paged_attention() runs f16 decode rows on the AVX-512 f16 kernel
// at the ISA cap `isa`, or why not (printed by the tests that check it).
const char* avx512_f16_missing(Isa isa) {
  if (!cpu_features().avx512f) return "no AVX-512 F on this CPU";
  set_isa_override(isa);
  const std::string name = attention_kernel_name(KvDtype::kF16, KvDtype::kF16, 64);
  set_isa_override(Isa::kAvx512);
  if (name.rfind("avx512-f16", 0) != 0) return "capped (KVSTACK_ISA / KVSTACK_ATTN_ISA)";
  return nullptr;
}

void run_case(const Case& c, std::mt19937& rng, bool check_paged_reference) {
  World w = build_world(c, rng);
  std::vector<Expected> ref;
  for (size_t si = 0; si < c.seqs.size(); ++si) ref.push_back(direct_attention(c, w, si));
  ThreadPool pool(c.n_threads);
  std::vector<std::vector<float>> out;

  for (Isa isa : test_isas()) {
    set_isa_override(isa);
    std::vector<AttnSeq> seqs = make_seqs(c, w, out);
    const Status st = paged_attention(w.view, w.params, seqs, &pool);
    ASSERT_TRUE(st.ok()) << st.error().message;
    expect_close(c, ref, out, isa_name(isa), false);
  }
  set_isa_override(Isa::kAvx512);  // back to the best the CPU has
  if (check_paged_reference) {
    std::vector<AttnSeq> seqs = make_seqs(c, w, out);
    const Status st = paged_attention_reference(w.view, w.params, seqs);
    ASSERT_TRUE(st.ok()) << st.error().message;
    expect_close(c, ref, out, "reference", true);
  }
}

Case random_case(std::mt19937& rng) {
  static const int kHeads[][2] = {{4, 4}, {3, 3}, {9, 3}, {8, 1}, {5, 1}, {12, 4}, {6, 2}, {7, 7}};
  static const int kDims[] = {32, 64, 80, 128};
  static const int kBlocks[] = {1, 2, 16, 64, 256};
  static const KvDtype kTypes[] = {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16};
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  Case c;
  const auto& hh = kHeads[pick(8)];
  c.n_q_heads = hh[0];
  c.n_kv_heads = hh[1];
  c.head_dim = kDims[pick(4)];
  c.block_size = kBlocks[pick(5)];
  c.dtype = kTypes[pick(3)];
  c.window = pick(3) == 0 ? 1 + pick(100) : 0;
  c.n_threads = 1 + pick(4);
  c.slot_major = pick(2) == 0;
  c.slot_pad = pick(3) == 0 ? 4 * pick(5) : 0;
  const bool decode = pick(2) == 0;
  const int n_seqs = 1 + pick(4);
  for (int i = 0; i < n_seqs; ++i) {
    c.seqs.push_back(SeqSpec{pick(301), decode ? 1 : 1 + pick(70)});
  }
  return c;
}

TEST(PagedAttention, RandomShapesMatchDirectSoftmax) {
  std::mt19937 rng(20240611);
  for (int it = 0; it < 90; ++it) {
    const Case c = random_case(rng);
    SCOPED_TRACE("case " + std::to_string(it));
    run_case(c, rng, it % 4 == 0);
    if (HasFailure()) return;
  }
}

// Every dtype x head layout x block size on a fixed mixed batch: a decode
// row, a prefill chunk from scratch and a chunk on top of a cached prefix.
TEST(PagedAttention, GridOfLayouts) {
  std::mt19937 rng(7);
  const int kHeads[][2] = {{6, 6}, {9, 3}, {5, 1}};
  for (const auto& hh : kHeads) {
    for (KvDtype dt : {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16}) {
      for (int bs : {1, 2, 16, 64, 256}) {
        Case c{hh[0], hh[1], 64, bs, dt, 0, 2, bs == 16, 0, {{37, 1}, {0, 23}, {130, 41}}};
        run_case(c, rng, false);
        if (HasFailure()) return;
      }
    }
  }
}

// One long sequence on several threads goes through split-K and the merge
// of partial (max, sum, acc); also short multi-row chunks on a long prefix.
TEST(PagedAttention, LongSequenceSplitK) {
  std::mt19937 rng(11);
  const std::vector<Case> cases = {
      {8, 1, 64, 16, KvDtype::kF16, 0, 2, false, 0, {{4000, 1}}},
      {9, 3, 64, 16, KvDtype::kF32, 0, 3, true, 0, {{2500, 1}}},
      {4, 2, 128, 64, KvDtype::kBF16, 0, 2, false, 0, {{3100, 3}}},
      {4, 2, 32, 16, KvDtype::kF16, 1000, 2, false, 0, {{3500, 2}}},
      {9, 3, 80, 2, KvDtype::kF32, 0, 4, false, 8, {{1800, 1}, {20, 1}}},
      // Decode rows that take every KV head in one tile: single thread (no
      // split), a window, and a batch mixing merged and per-head tiles.
      {12, 4, 64, 16, KvDtype::kF16, 0, 1, false, 0, {{1500, 1}, {700, 1}, {100, 1}}},
      {6, 2, 64, 1, KvDtype::kBF16, 600, 2, true, 0, {{2000, 1}}},
      {9, 3, 64, 16, KvDtype::kF16, 0, 2, false, 0, {{4200, 1}, {530, 1}, {40, 5}}},
  };
  for (const Case& c : cases) {
    run_case(c, rng, false);
    if (HasFailure()) return;
  }
}

// The AVX-512 f16 decode kernel (run_case runs it as the avx512 cap) on
// decode batches: GQA 1..8 (more than 4 q heads per KV head: sub-groups),
// head_dim 16..256, block sizes 1..64, head- and slot-major rows with
// padding, lengths around the 4/8/16-key q.K steps and the 32-key chunk,
// split-K (> 512 keys), every KV head in one tile (>= 1024 keys), windows.
TEST(PagedAttention, Avx512F16DecodeMatchesDirectSoftmax) {
  if (const char* why = avx512_f16_missing(Isa::kAvx512)) {
    GTEST_SKIP() << "avx512-f16 decode not run: " << why;
  }
  std::mt19937 rng(23);
  const int kHeads[][2] = {{9, 3}, {4, 4}, {8, 1}, {10, 2}, {14, 2}, {12, 4}, {6, 2}, {5, 1}};
  const int kDims[] = {16, 48, 64, 128, 256, 64, 32, 80};
  const int kBlocks[] = {16, 1, 2, 64, 16, 32, 16, 2};
  const std::vector<SeqSpec> short_seqs = {{0, 1},  {3, 1},  {14, 1}, {15, 1}, {16, 1},
                                           {30, 1}, {31, 1}, {32, 1}, {46, 1}, {63, 1},
                                           {64, 1}, {65, 1}, {99, 1}, {300, 1}};
  const std::vector<SeqSpec> long_seqs = {{511, 1}, {512, 1}, {1100, 1}, {2100, 1}, {40, 1}};
  int n_cases = 0;
  for (int i = 0; i < 8; ++i) {
    for (bool is_long : {false, true}) {
      Case c{kHeads[i][0],       kHeads[i][1],
             kDims[i],           kBlocks[i],
             KvDtype::kF16,      is_long && i % 3 == 1 ? 700 : (i == 5 ? 37 : 0),
             1 + i % 3,          i % 2 == 1,
             i % 4 == 3 ? 8 : 0, is_long ? long_seqs : short_seqs};
      SCOPED_TRACE(describe(c));
      run_case(c, rng, false);
      if (HasFailure()) return;
      ++n_cases;
    }
  }
  std::printf("[ paths    ] avx512-f16 decode ran on %d batches (scalar and avx2 beside it)\n",
              n_cases);
}

// Window 1 sees only the query's own position: the output is V at that
// position exactly (up to rounding), whatever the scores.
TEST(PagedAttention, WindowOfOneReturnsOwnValue) {
  std::mt19937 rng(5);
  Case c{6, 2, 32, 16, KvDtype::kF16, 1, 2, false, 0, {{50, 1}, {10, 20}}};
  World w = build_world(c, rng);
  std::vector<std::vector<float>> out;
  std::vector<AttnSeq> seqs = make_seqs(c, w, out);
  ASSERT_TRUE(paged_attention(w.view, w.params, seqs, nullptr).ok());
  for (size_t si = 0; si < c.seqs.size(); ++si) {
    const int n_tokens = c.seqs[si].n_past + c.seqs[si].n_new;
    for (int r = 0; r < c.seqs[si].n_new; ++r) {
      const int t = c.seqs[si].n_past + r;
      for (int h = 0; h < c.n_q_heads; ++h) {
        const int kvh = h / 3;
        for (int i = 0; i < c.head_dim; ++i) {
          const float want = w.v[si][(static_cast<size_t>(kvh) * n_tokens + t) * c.head_dim + i];
          const float got = out[si][(static_cast<size_t>(r) * c.n_q_heads + h) * c.head_dim + i];
          ASSERT_NEAR(got, want, 4 * kU * std::fabs(want)) << "seq " << si << " row " << r;
        }
      }
    }
  }
}

// A window layer releases the blocks that fell out of the window; their
// table entries become kNullBlock (-1) and must not be touched.
TEST(PagedAttention, WindowSkipsReleasedBlocks) {
  std::mt19937 rng(9);
  Case c{9, 3, 64, 16, KvDtype::kF16, 40, 2, false, 0, {{200, 1}, {150, 30}}};
  World w = build_world(c, rng);
  std::vector<Expected> ref;
  for (size_t si = 0; si < c.seqs.size(); ++si) ref.push_back(direct_attention(c, w, si));
  for (size_t si = 0; si < c.seqs.size(); ++si) {
    const int first = std::max(0, c.seqs[si].n_past - c.window + 1);
    for (int b = 0; b < first / c.block_size; ++b) w.tables[si][b] = -1;
  }
  ThreadPool pool(2);
  for (Isa isa : test_isas()) {
    set_isa_override(isa);
    std::vector<std::vector<float>> out;
    std::vector<AttnSeq> seqs = make_seqs(c, w, out);
    const Status st = paged_attention(w.view, w.params, seqs, &pool);
    ASSERT_TRUE(st.ok()) << st.error().message;
    expect_close(c, ref, out, isa_name(isa), false);
  }
  set_isa_override(Isa::kAvx512);
  // One block more released than allowed is an error, not a silent read.
  std::vector<std::vector<float>> out;
  std::vector<AttnSeq> seqs = make_seqs(c, w, out);
  std::vector<int32_t> table = w.tables[0];
  table[(200 - 40 + 1) / 16] = -1;
  seqs[0].block_table = table.data();
  const Status st = paged_attention(w.view, w.params, seqs, &pool);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.error().message.find("entry 10 is -1"), std::string::npos) << st.error().message;
}

TEST(PagedAttention, RejectsBadArguments) {
  std::mt19937 rng(3);
  Case c{6, 2, 32, 16, KvDtype::kF32, 0, 1, false, 0, {{20, 2}}};
  World w = build_world(c, rng);
  std::vector<std::vector<float>> out;
  auto expect_error = [&](AttnParams p, std::vector<AttnSeq> seqs, const char* needle) {
    const Status st = paged_attention(w.view, p, seqs, nullptr);
    ASSERT_FALSE(st.ok()) << needle;
    EXPECT_EQ(st.error().code, Errc::kInvalidArgument);
    EXPECT_NE(st.error().message.find(needle), std::string::npos) << st.error().message;
    EXPECT_EQ(out[0][0], -12345.0f) << "output written on error";
  };
  std::vector<AttnSeq> good = make_seqs(c, w, out);
  AttnParams p = w.params;
  p.n_q_heads = 5;
  expect_error(p, good, "not a multiple");
  p = w.params;
  p.n_kv_heads = 3;
  p.n_q_heads = 6;
  expect_error(p, good, "n_kv_heads 3");
  p = w.params;
  p.head_dim = 64;
  expect_error(p, good, "head_dim 64");
  p = w.params;
  p.window = -1;
  expect_error(p, good, "window");
  std::vector<AttnSeq> bad = good;
  bad[0].n_blocks = 1;  // 22 tokens need 2 blocks of 16
  expect_error(w.params, bad, "need 2 blocks");
  bad = good;
  std::vector<int32_t> table = w.tables[0];
  table[1] = -4;
  bad[0].block_table = table.data();
  expect_error(w.params, bad, "entry 1 is -4");
  bad = good;
  bad[0].n_past = -1;
  expect_error(w.params, bad, "negative");
  bad = good;
  bad[0].q = nullptr;
  expect_error(w.params, bad, "null");
  // Nothing to do is fine.
  bad = good;
  bad[0].n_new = 0;
  EXPECT_TRUE(paged_attention(w.view, w.params, bad, nullptr).ok());
}

// Batch invariance (the server's greedy output must not depend on what else
// is batched): a sequence's output is bitwise the same computed alone on one
// thread and inside a mixed batch of decode rows and prefill chunks of other
// lengths on any number of threads, for every kernel ISA.
TEST(PagedAttention, OutputIsBitwiseIndependentOfBatchAndThreads) {
  std::mt19937 rng(99);
  for (KvDtype dtype : {KvDtype::kF16, KvDtype::kF32}) {
    Case c{.n_q_heads = 9,
           .n_kv_heads = 3,
           .head_dim = 64,
           .block_size = 16,
           .dtype = dtype,
           .window = 0,
           .n_threads = 1,
           .slot_major = false,
           .slot_pad = 0,
           .seqs = {{3000, 1}, {5000, 3}, {37, 1}, {700, 1}, {1500, 40}, {0, 70}, {9000, 1}}};
    const World w = build_world(c, rng);
    for (Isa isa : test_isas()) {
      set_isa_override(isa);
      std::vector<std::vector<float>> batch_out;
      for (int n_threads : {1, 2, 3}) {
        ThreadPool pool(n_threads);
        std::vector<std::vector<float>> out;
        std::vector<AttnSeq> seqs = make_seqs(c, w, out);
        ASSERT_TRUE(paged_attention(w.view, w.params, seqs, &pool).ok());
        for (size_t i = 0; i < seqs.size(); ++i) {
          std::vector<float> alone(out[i].size(), -1.0f);
          AttnSeq one = seqs[i];
          one.out = alone.data();
          ASSERT_TRUE(
              paged_attention(w.view, w.params, std::span<const AttnSeq>(&one, 1), nullptr).ok());
          EXPECT_EQ(std::memcmp(alone.data(), out[i].data(), alone.size() * sizeof(float)), 0)
              << isa_name(isa) << " dtype " << static_cast<int>(dtype) << " seq " << i << " ("
              << c.seqs[i].n_past << "+" << c.seqs[i].n_new << ") threads " << n_threads;
        }
      }
    }
    set_isa_override(Isa::kAvx512);
  }
}

// The AVX-512 prefill tiles (the AVX2 tiles' q . K and p . V on 16-lane
// vectors) give the AVX2 tiles' bits: prefill rows only (decode rows run
// different kernels at the two caps), every float format, head dims with
// 64-, 16- and 8-wide remainders, last chunks of at most 16 keys, windows
// and split-K lengths.
TEST(PagedAttention, Avx512PrefillBitwiseEqualsAvx2) {
  if (!cpu_features().avx512f || !cpu_features().avx2) {
    GTEST_SKIP() << "avx512 prefill not run: no AVX-512 F on this CPU";
  }
  set_isa_override(Isa::kAvx512);
  const std::string name = attention_kernel_name(KvDtype::kF32, KvDtype::kF32, 64);
  if (name.find("avx512 prefill") == std::string::npos) {
    GTEST_SKIP() << "avx512 prefill not run: capped (KVSTACK_ISA / KVSTACK_ATTN_ISA): " << name;
  }
  std::mt19937 rng(2312);
  const int kHeads[][2] = {{9, 3}, {4, 4}, {8, 1}, {5, 1}, {12, 4}, {6, 2}, {7, 7}};
  const int kDims[] = {8, 16, 24, 48, 64, 80, 128, 136, 256};
  const KvDtype kTypes[] = {KvDtype::kF32, KvDtype::kF16, KvDtype::kBF16};
  int n_cases = 0;
  for (int i = 0; i < 27; ++i) {
    Case c{.n_q_heads = kHeads[i % 7][0],
           .n_kv_heads = kHeads[i % 7][1],
           .head_dim = kDims[i % 9],
           .block_size = i % 4 == 0 ? 1 : 16 << (i % 3),
           .dtype = kTypes[i % 3],
           .window = i % 5 == 2 ? 1 + static_cast<int>(rng() % 90) : 0,
           .n_threads = 1 + i % 3,
           .slot_major = i % 2 == 1,
           .slot_pad = i % 6 == 5 ? 8 : 0,
           .seqs = {{0, 2 + static_cast<int>(rng() % 70)},
                    {static_cast<int>(rng() % 300), 2 + static_cast<int>(rng() % 40)},
                    {i % 2 == 0 ? 1200 : 17, 5},
                    {31, 33}}};
    SCOPED_TRACE(describe(c));
    const World w = build_world(c, rng);
    ThreadPool pool(c.n_threads);
    std::vector<std::vector<float>> out[2];
    for (int k = 0; k < 2; ++k) {
      set_isa_override(k == 0 ? Isa::kAvx2 : Isa::kAvx512);
      std::vector<AttnSeq> seqs = make_seqs(c, w, out[k]);
      ASSERT_TRUE(paged_attention(w.view, w.params, seqs, &pool).ok());
    }
    set_isa_override(Isa::kAvx512);
    for (size_t si = 0; si < c.seqs.size(); ++si) {
      ASSERT_EQ(out[0][si].size(), out[1][si].size());
      EXPECT_EQ(
          std::memcmp(out[0][si].data(), out[1][si].data(), out[0][si].size() * sizeof(float)), 0)
          << "seq " << si << " (" << c.seqs[si].n_past << "+" << c.seqs[si].n_new << ")";
    }
    if (HasFailure()) return;
    ++n_cases;
  }
  std::printf("[ paths    ] avx512 prefill ran on %d batches, bitwise equal to avx2\n", n_cases);
}

}  // namespace
}  // namespace kvstack
