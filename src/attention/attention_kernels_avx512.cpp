// AVX-512 VNNI decode kernel for int8 and int4 K/V: integer dot products on
// the stored codes. Every function that uses these instructions carries the
// target attribute; the file is compiled for generic x86-64 and only entered
// after select_kernels() has checked the CPU (AVX-512 F/BW/VL/DQ + VNNI +
// VBMI).
//
// q . K: the query (times the attention scale) is rounded to q^, int8 codes
// per group of 32 elements (round_query_int8, as the int4 AVX2 path does).
// Sixteen keys at a time, each key's code row is loaded 64 codes at a time
// and transposed, so that lane j of dword vector c holds codes 4c..4c+3 (in
// the query's packed order) of key j (int8: 64 code bytes, a 16 x 16 dword
// transpose; int4: the 32 code bytes as 16 x 8 dwords, split into low and
// high nibbles after the transpose); vpdpbusd with q^'s dword c broadcast
// then gives every key's group dot in its own lane, with no horizontal
// sums. int8 codes
// are signed, so they are offset by 128 (xor 0x80) into vpdpbusd's unsigned
// operand and 128 * sum(q^ codes) is taken off once per query; int4 codes are
// unsigned already and their group minimum enters through sum(q^) as in the
// AVX2 kernel. Group sums are scaled by q^'s group scale (and int4's key
// group scale) in float, int8's per-token scale once per key.
//
// p . V: the softmax weights of a chunk of 64 keys, times V's per-token scale
// (int8) or group scale (int4), are rounded per (query vector, chunk, V
// group) to int16 codes w^ = nearbyint(w * 32767 / max w) (weights are >= 0,
// so the largest is 32767 and the rest keep 15 bits relative to it). The V
// codes of two keys are paired as int16 words (v_j, v_j+1) in element order
// by one VBMI vpermt2b per 16 elements (int4: and the nibble split), and
// vpdpwssd adds w^_j v_j + w^_j+1 v_j+1 per column in int32 (at most 32
// pairs: no overflow); the chunk's sum is scaled back once per column.
// int4's minimum enters as sum_j w_j min_j per group, in float, kept as 16
// lane sums rescaled with the accumulator and summed across lanes once per
// tile, as the softmax sum is. The float softmax state is the AVX2 kernel's
// (running max, sum) with a degree-6 exp and the sum in lanes.
//
// u8 weights (vpdpbusd on four keys per instruction instead of vpdpwssd on
// two) were tried and dropped: 1/255 of a chunk's largest weight puts up to
// 0.05 of error on outputs of magnitude ~1 (int4 V; 0.016 int8 V), 100 times
// the int16 rounding's and more than the int8 / int4 V quantization itself,
// and at 32K they were no faster (benchmarks.md).
//
// So, against the float kernels, scores carry q^'s rounding (as int4 keys
// already do on every path) and the p . V sum a relative rounding of at
// most 2^-16 of the chunk's largest weight per weight; paged_attention_quant
// _reference models q^ (QuantReferenceOptions) but not the weight rounding,
// which the tests bound.
// GCC 12's AVX-512 intrinsics pass _mm512_undefined_*() as the merge source
// of unmasked operations, which -W(maybe-)uninitialized reports inside the
// system header (GCC bug 105593, as in ops/matmul_avx512.cpp); the values
// are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "attention/attention_kernels.h"
#include "attention/attention_quant.h"
#include "ops/simd_avx512.h"

#define KV_AVX512                                                                 \
  __attribute__((                                                                 \
      target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma," \
             "f16c")))

namespace kvstack::attn_detail {
namespace {

constexpr int kChunk = 64;  // keys per chunk: four blocks of 16
static_assert(kChunk == kMassChunkVnni, "key-mass records are per decode chunk");
constexpr int kVecs = kChunk / 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kMaxSub = 4;  // query vectors per q.K / p.V pass

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Software prefetch of the next unit's K/V lines, spread over the current
// unit's work as the AVX2 kernel's KvPrefetch does (a burst of tens of
// prefetches fills the miss buffers and the kernel stalls behind them):
// add() queues lines, pace(heavy, light) pads the queue so that the steps,
// each with its returned count, read queued (or padding) entries, step(k) issues
// the next k, flush() the queued rest. The hot loops (p . V) issue their
// share from a local cursor (cursor(), advance()): no member stores and no
// bound check per line, which in session 14's build cost the p . V pair loop
// a store per line and a copy of all its accumulators per key pair.
class LinePrefetch {
 public:
  void clear() {
    n_ = 0;
    next_ = 0;
  }
  // Queues the rows and metadata of the chunk's positions (base, slot) in
  // one stream of KV head hh: one range per stretch of consecutive slots of
  // a block.
  KV_AVX512 void add(const TileArgs& a, const HeadStream& s, int hh, const int64_t* base,
                     const int32_t* slot, int n, int row_bytes) {
    const uint8_t* data = s.data + hh * s.head_stride;
    const uint8_t* meta = s.meta + hh * s.meta_head_stride;
    for (int j0 = 0; j0 < n;) {
      const int j1 = std::min(n, j0 + a.block_size - slot[j0]);
      const int32_t s0 = slot[j0], s1 = slot[j1 - 1];
      push(data + base[j0] + s0 * s.slot_stride, data + base[j0] + s1 * s.slot_stride + row_bytes);
      push(meta + base[j0] + s0 * s.meta_slot_stride,
           meta + base[j0] + (s1 + 1) * s.meta_slot_stride);
      j0 = j1;
    }
  }
  // Lines per step over the queue for `heavy` steps (a q . K call on 16
  // keys, a softmax or weight rounding of one query vector, a metadata
  // gather) and `light` ones (a p . V key pair), a heavy step taking
  // kHeavy times a light step's share; the queue padded with a dummy line
  // up to the steps' total. Equal shares per step issued most lines in the
  // short p . V steps, faster than the miss buffers drain (the prefetches
  // stalled there) and left them idle over the rest of the unit
  // (benchmarks.md, session 17).
  static constexpr int kHeavy = 2;  // a heavy step's share, in light steps' shares
  struct Pace {
    int heavy;
    int light;
  };
  Pace pace(int heavy, int light) {
    KV_CHECK(heavy >= 1 && light >= 0 && heavy * kHeavy + light <= kMaxPad,
             "LinePrefetch: too many steps per unit");
    const int slots = heavy * kHeavy + light;
    const int per = (queued() + slots - 1) / slots;
    const Pace p{kHeavy * per, per};
    for (int i = n_; i < next_ + slots * per; ++i) lines_[i] = dummy_;
    return p;
  }
  KV_AVX512 void step(int k) {
    for (int t = 0; t < k; ++t) _mm_prefetch(lines_[next_ + t], _MM_HINT_T0);
    next_ += k;
  }
  const char* const* cursor() const { return lines_ + next_; }
  void advance(const char* const* p) { next_ = static_cast<int>(p - lines_); }
  KV_AVX512 void flush() {
    for (; next_ < n_; ++next_) _mm_prefetch(lines_[next_], _MM_HINT_T0);
  }
  int queued() const { return std::max(0, n_ - next_); }

 private:
  // The 64-byte lines of [p, end), eight pointers per vector store.
  KV_AVX512 void push(const uint8_t* p, const uint8_t* end) {
    const auto x = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63};
    const auto e = reinterpret_cast<uintptr_t>(end);
    if (e <= x) return;
    const int nl = std::min(static_cast<int>((e - x + 63) / 64), kMaxLines - n_);
    __m512i v = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(x)),
                                 _mm512_setr_epi64(0, 64, 128, 192, 256, 320, 384, 448));
    for (int i = 0; i < nl; i += 8) {
      const __mmask8 k = nl - i >= 8 ? 0xFF : static_cast<__mmask8>((1u << (nl - i)) - 1);
      _mm512_mask_storeu_epi64(lines_ + n_ + i, k, v);
      v = _mm512_add_epi64(v, _mm512_set1_epi64(512));
    }
    n_ += nl;
  }
  // K and V of one chunk of 8 KV heads: 2 x 32 rows of at most 4 lines
  // (int8, d = 256) and each stretch's metadata lines; lines past it (more
  // heads) are not prefetched. Then the padding of pace(): fewer than one
  // entry per light-step slot.
  static constexpr int kMaxLines = 8 * (2 * kChunk * 4 + 4 * kChunk);
  static constexpr int kMaxPad = 64 * (kChunk / 16 + kChunk / 2);
  alignas(64) static inline const char dummy_[64] = {};
  const char* lines_[kMaxLines + kMaxPad];
  int n_ = 0;
  int next_ = 0;
};

// ----------------------------------------------------------- transpose --

// r[x] (x < 16): 16 dwords of key x. Afterwards r[c] holds dword c of keys
// 0..15 in lanes 0..15.
KV_AVX512 inline void transpose16x16(__m512i* r) {
  __m512i u[16], v[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    u[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    u[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // v[4i + k], 128-bit lane L: keys 4i..4i+3, dword 4L + k.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    v[4 * i + 0] = _mm512_unpacklo_epi64(u[4 * i], u[4 * i + 2]);
    v[4 * i + 1] = _mm512_unpackhi_epi64(u[4 * i], u[4 * i + 2]);
    v[4 * i + 2] = _mm512_unpacklo_epi64(u[4 * i + 1], u[4 * i + 3]);
    v[4 * i + 3] = _mm512_unpackhi_epi64(u[4 * i + 1], u[4 * i + 3]);
  }
  // Dword 4L + k: lane i of it is lane L of v[4i + k].
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512i x0 = _mm512_shuffle_i32x4(v[k], v[4 + k], 0x44);
    const __m512i x1 = _mm512_shuffle_i32x4(v[k], v[4 + k], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(v[8 + k], v[12 + k], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(v[8 + k], v[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// -------------------------------------------------------------- query --

// q^ of one query vector in the order qk reads it: for each 64-element block
// b, the 64 int8 codes in the order of the block's 16 dwords (int8 keys:
// elements in order; int4 keys: int4_position's order), and per
// block the two group scales; corr = 128 * sum_g scale_g * sum(codes_g)
// (int8 keys' offset) and qsum[g] = scale_g * sum(codes_g) (int4 minimum).
struct PackedQuery {
  int8_t* codes;  // [d]
  float* gscale;  // [d / 32]
  float* qsum;    // [d / 32]
  float* corr;    // [1]
};

// int4 keys' code order within a 64-element block (qk16): a block is 32
// code bytes, byte i of 32-element group g holding elements 32g + i (low
// nibble) and 32g + 16 + i (high nibble), i < 16. qk16 transposes the bytes
// as dwords (dword k = bytes 4k..4k+3, k < 8) and then splits the nibbles,
// so its code vector c = 2k + u holds the low (u = 0) or high (u = 1)
// nibbles of dword k; int4_position(r) is the position of block-relative
// element r (0..63) in that order (4 c + byte within the dword).
inline int int4_position(int r) {
  const int g = r / 32, i = r % 16, u = r % 32 / 16;
  const int k = 4 * g + i / 4;
  return 4 * (2 * k + u) + i % 4;
}

// kInt4Order.idx[p] = r with int4_position(r) == p: the vpermb indices that
// put a 64-element block's codes from element order into int4 keys' order.
struct Int4Order {
  alignas(64) uint8_t idx[64];
  Int4Order() {
    for (int r = 0; r < 64; ++r) idx[int4_position(r)] = static_cast<uint8_t>(r);
  }
};
const Int4Order kInt4Order;

// q^ of the query q [d] times scale: round_query_int8's codes and scales
// bit for bit (the same float products, max |x| / 127, 127 / max |x|,
// nearest-even rounding, a non-finite group gets scale NaN and zero codes),
// 32 elements per group in two vectors.
KV_AVX512 void pack_query(const float* q, float scale, int d, bool int4_order, PackedQuery pq) {
  const __m512 sc = _mm512_set1_ps(scale);
  const __m512i lim = _mm512_set1_epi32(127);
  double corr = 0.0;
  for (int b = 0; b < d / 64; ++b) {
    alignas(64) int8_t nat[64];  // the block's codes in element order
    for (int half = 0; half < 2; ++half) {
      const int g = 2 * b + half;
      const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(q + 32 * g), sc);
      const __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(q + 32 * g + 16), sc);
      constexpr int kNonFinite = 0x01 | 0x08 | 0x10 | 0x80;  // QNaN, +inf, -inf, SNaN
      float gs;
      int sum = 0;
      if ((_mm512_fpclass_ps_mask(x0, kNonFinite) | _mm512_fpclass_ps_mask(x1, kNonFinite)) != 0) {
        gs = std::numeric_limits<float>::quiet_NaN();
        std::memset(nat + 32 * half, 0, 32);
      } else {
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        gs = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i r0 =
            _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), lim),
                             _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        const __m512i r1 =
            _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv)), lim),
                             _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        _mm_store_si128(reinterpret_cast<__m128i*>(nat + 32 * half), _mm512_cvtepi32_epi8(r0));
        _mm_store_si128(reinterpret_cast<__m128i*>(nat + 32 * half + 16), _mm512_cvtepi32_epi8(r1));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(r0, r1));
      }
      pq.gscale[g] = gs;
      pq.qsum[g] = gs * static_cast<float>(sum);
      corr += 128.0 * gs * sum;
    }
    __m512i v = _mm512_load_si512(nat);
    if (int4_order) v = _mm512_permutexvar_epi8(_mm512_load_si512(kInt4Order.idx), v);
    _mm512_storeu_si512(pq.codes + 64 * b, v);
  }
  // NaN scales (a non-finite query) propagate into corr and the scores.
  *pq.corr = static_cast<float>(corr);
}

// ---------------------------------------------------------------- q.K --

// Metadata of a chunk's keys (or values), widened once per chunk and KV
// head and shared by its query vectors: f[x][j] = f16 field x of key j's
// record (int8: x = 0 the scale; int4: x = 2g the scale and 2g + 1 the
// minimum of group g), 0 for j past the chunk.
struct ChunkMeta {
  alignas(64) float f[16][kChunk];
};

// Fills cm for keys [0, n) with n_fields f16 fields each (records of
// 2 n_fields bytes at metas0[j] + off). Sixteen keys whose records lie back to back
// (one block) are read with vector loads.
KV_AVX512 void gather_meta(const uint8_t* const* metas0, int64_t off, int n, int n_fields,
                           ChunkMeta* cm) {
  const uint8_t* metas[kChunk];
  for (int j = 0; j < n; ++j) metas[j] = metas0[j] + off;
  for (int j0 = 0; j0 < kChunk; j0 += 16) {
    const int rec = 2 * n_fields;
    const bool contiguous =
        j0 + 16 <= n && metas[j0 + 15] == metas[j0] + 15 * rec && (n_fields == 1 || n_fields == 4);
    if (contiguous && n_fields == 1) {
      _mm512_store_ps(
          cm->f[0] + j0,
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(metas[j0]))));
    } else if (contiguous) {  // 16 records of 4 fields: 64 words in two vectors
      const __m512i a = _mm512_loadu_si512(metas[j0]);
      const __m512i b = _mm512_loadu_si512(metas[j0] + 64);
      for (int x = 0; x < 4; ++x) {
        alignas(64) int16_t idx[32];
        for (int j = 0; j < 32; ++j) idx[j] = static_cast<int16_t>(4 * (j % 16) + x);
        const __m512i w = _mm512_permutex2var_epi16(a, _mm512_load_si512(idx), b);
        _mm512_store_ps(cm->f[x] + j0, _mm512_cvtph_ps(_mm512_castsi512_si256(w)));
      }
    } else {
      alignas(32) uint16_t h[16];
      for (int x = 0; x < n_fields; ++x) {
        for (int j = 0; j < 16; ++j) h[j] = j0 + j < n ? load_u16(metas[j0 + j] + 2 * x) : 0;
        _mm512_store_ps(cm->f[x] + j0,
                        _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h))));
      }
    }
  }
}

// Transposes rows r[i] = [key i | key i + 8] (8 dwords in each 256-bit
// half) so that out[k] lane j = dword k of key j (the transpose of
// ops/matmul_avx512.cpp's weight panels).
KV_AVX512 inline void transpose16x8(const __m512i* r, __m512i* out) {
  __m512i t[8], s[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {  // rows 0..3, then 4..7
    const __m512i* th = t + 4 * h;
    s[4 * h + 0] = _mm512_unpacklo_epi64(th[0], th[2]);  // k = 0 | 4
    s[4 * h + 1] = _mm512_unpackhi_epi64(th[0], th[2]);  // k = 1 | 5
    s[4 * h + 2] = _mm512_unpacklo_epi64(th[1], th[3]);  // k = 2 | 6
    s[4 * h + 3] = _mm512_unpackhi_epi64(th[1], th[3]);  // k = 3 | 7
  }
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    out[k] = _mm512_permutex2var_epi64(s[k], lo, s[4 + k]);
    out[k + 4] = _mm512_permutex2var_epi64(s[k], hi, s[4 + k]);
  }
}

// r[c] (c < 16), lane j: the int4 codes of block b of key j (rows at
// kp[j] + koff) at int4_position order positions 4c..4c+3, one per byte.
// The 32 packed code bytes are transposed as 8 dwords first and split into
// nibbles after, so each nibble split serves 16 keys.
KV_AVX512 inline void int4_blocks16(const uint8_t* const* kp, int64_t koff, int b, __m512i* r) {
  __m512i rows[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp[i] + koff + 32 * b));
    const __m256i c =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp[i + 8] + koff + 32 * b));
    rows[i] = _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
  }
  transpose16x8(rows, t);
  const __m512i m = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    r[2 * k] = _mm512_and_si512(t[k], m);
    r[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(t[k], 4), m);
  }
}

// s[h * kChunk + j0 + j] = q^[h] . K_{j0 + j} for 16 keys (kp[j0 ..]
// valid, padded; s and kp start at key j0; rows at kp[x] + koff) and SG
// query vectors; K int8 or int4, its metadata in km.
template <KvDtype F, int SG>
KV_AVX512 void qk16(const PackedQuery* q, int d, const uint8_t* const* kp, int64_t koff,
                    const ChunkMeta* km, int j0, float* s) {
  __m512 facc[SG];
#pragma GCC unroll 4
  for (int h = 0; h < SG; ++h) facc[h] = _mm512_setzero_ps();
  for (int b = 0; b < d / 64; ++b) {
    __m512i r[16];
    if constexpr (F == KvDtype::kInt8) {
      const __m512i off = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 16
      for (int x = 0; x < 16; ++x)
        r[x] = _mm512_xor_si512(_mm512_loadu_si512(kp[x] + koff + 64 * b), off);
      transpose16x16(r);
    } else {
      int4_blocks16(kp, koff, b, r);
    }
    // Code vectors 0..7 are group 2b, 8..15 group 2b + 1 (both formats).
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      __m512i ia[SG];
#pragma GCC unroll 4
      for (int h = 0; h < SG; ++h) ia[h] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < 8; ++k) {
        const int c = 8 * half + k;
#pragma GCC unroll 4
        for (int h = 0; h < SG; ++h) {
          ia[h] = _mm512_dpbusd_epi32(ia[h], r[c],
                                      _mm512_set1_epi32(load_i32(q[h].codes + 64 * b + 4 * c)));
        }
      }
      const int g = 2 * b + half;
      if constexpr (F == KvDtype::kInt8) {
#pragma GCC unroll 4
        for (int h = 0; h < SG; ++h) {
          facc[h] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[h]), _mm512_set1_ps(q[h].gscale[g]), facc[h]);
        }
      } else {  // fma(scale_key * scale_q, dot, min_key * qsum)
        const __m512 ks = _mm512_load_ps(km->f[2 * g] + j0);
        const __m512 kmin = _mm512_load_ps(km->f[2 * g + 1] + j0);
#pragma GCC unroll 4
        for (int h = 0; h < SG; ++h) {
          facc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[h]),
                                    _mm512_mul_ps(ks, _mm512_set1_ps(q[h].gscale[g])), facc[h]);
          facc[h] = _mm512_fmadd_ps(kmin, _mm512_set1_ps(q[h].qsum[g]), facc[h]);
        }
      }
    }
  }
  if constexpr (F == KvDtype::kInt8) {
    const __m512 ks = _mm512_load_ps(km->f[0] + j0);
#pragma GCC unroll 4
    for (int h = 0; h < SG; ++h) {
      facc[h] = _mm512_mul_ps(_mm512_sub_ps(facc[h], _mm512_set1_ps(*q[h].corr)), ks);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < SG; ++h) _mm512_storeu_ps(s + h * kChunk, facc[h]);
}

// ---------------------------------------------------------------- p.V --

// The largest lane of v in every lane (no trip through a scalar register).
KV_AVX512 inline __m512 broadcast_max(__m512 v) {
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_max_ps(v, _mm512_permute_ps(v, 0x4E));
  return _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
}

// Online-softmax update of one query vector over a chunk of n scores at s
// (padded to kChunk in place): leaves p = exp(s - m_new) in s (0 past n),
// returns the rescale alpha of the old state. The running sum is kept as 16
// lane sums lsum (lsum = alpha lsum + p, summed across lanes once at the end).
// The max stays broadcast in a vector and alpha = exp(m - m_new) comes from
// the same exp16_nonpos as p (exactly 1 when the max is unchanged, 0 from
// m = -inf): no trip through scalar code and libm between q . K and p . V.
KV_AVX512 float softmax_update(float* s, int n, float* m, float* lsum) {
  for (int j = n; j < kChunk; ++j) s[j] = kNegInf;
  __m512 mx = _mm512_loadu_ps(s);
  for (int x = 1; x < kVecs; ++x) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + 16 * x));
  const __m512 mo = _mm512_set1_ps(*m);
  const __m512 mv = _mm512_max_ps(broadcast_max(mx), mo);
  const float m_new = _mm512_cvtss_f32(mv);
  if (m_new == kNegInf) {
    std::memset(s, 0, sizeof(float) * kChunk);
    return 1.0f;
  }
  const __m512 al = simd::exp16_nonpos(_mm512_sub_ps(mo, mv));
  __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(lsum), al);
#pragma GCC unroll 4
  for (int x = 0; x < kVecs; ++x) {
    const __m512 px = simd::exp16_nonpos(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * x), mv));
    _mm512_storeu_ps(s + 16 * x, px);
    sum = _mm512_add_ps(sum, px);
  }
  _mm512_storeu_ps(lsum, sum);
  *m = m_new;
  return _mm512_cvtss_f32(al);
}

// int16 weight codes of one query vector and chunk: wq[g][j] for V group g
// (int8 V: one group), scale ws[g] (value = code * ws).
struct ChunkWeights {
  alignas(64) int16_t wq[8][kChunk];  // up to d = 256 for int4 V
  __m512 msum[8];  // int4 V: lane sums of p_j min_{j,g} (summed across lanes at the end)
  float ws[8];
};

// Rounds the weights wv [kVecs x 16] (>= 0, 0 past the chunk) to wq, scale
// ws: codes nearbyint(w * 32767 / max w); all zero gives zero codes.
KV_AVX512 inline void round_weights(const __m512* wv, int16_t* wq, float* ws) {
  __m512 mxv = wv[0];
#pragma GCC unroll 4
  for (int x = 1; x < kVecs; ++x) mxv = _mm512_max_ps(mxv, wv[x]);
  mxv = broadcast_max(mxv);
  const __m512 inv =
      _mm512_div_ps(_mm512_set1_ps(32767.0f), _mm512_max_ps(mxv, _mm512_set1_ps(1e-30f)));
  const __m512i lim = _mm512_set1_epi32(32767);
#pragma GCC unroll 4
  for (int x = 0; x < kVecs; ++x) {
    const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(wv[x], inv));  // nearest, ties to even
    _mm256_store_si256(reinterpret_cast<__m256i*>(wq + 16 * x),
                       _mm512_cvtepi32_epi16(_mm512_min_epi32(c, lim)));
  }
  *ws = _mm512_cvtss_f32(mxv) * (1.0f / 32767.0f);
}

// acc + the int16 pair products of a and b (vpdpwssd) in place. GCC 12
// does not keep the intrinsic's accumulator in its register across the p . V
// pair loop: it kept two copies of all SG x 4 accumulators and moved every
// one of them per key pair (24 extra moves per pair on 3 query vectors);
// the tied operand of the asm keeps each in one register.
KV_AVX512 inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// Byte-permute indices that pair two keys' V codes as int16 words for
// vpdpwssd: dword i of the result holds (code e of key j, code e of key
// j + 1) for 16 consecutive elements e, in element order. vpermt2b picks
// the bytes from the two keys' rows (a = indices 0..63, b = 64..127) and
// zeroes the rest (mask), so each word is one code byte, zero-extended
// (int4: low byte, its nibbles split afterwards) or in the high byte (int8:
// sign-extended afterwards by an arithmetic shift of 8).
//   int4, sel 0 / 1: row bytes 0..15 / 16..31 of the 32-byte block (the
//     two 32-element groups; each byte's low nibble is element i, its high
//     nibble element 16 + i of the group);
//   int8, sel 0..3: row bytes 16 sel .. 16 sel + 15 of the 64-byte block.
template <KvDtype F>
KV_AVX512 inline __m512i pair_index(int sel) {
  alignas(64) uint8_t idx[64] = {};
  for (int i = 0; i < 16; ++i) {
    const int lo = F == KvDtype::kInt8 ? 1 : 0;  // byte of the word that holds the code
    idx[4 * i + lo] = static_cast<uint8_t>(16 * sel + i);
    idx[4 * i + 2 + lo] = static_cast<uint8_t>(64 + 16 * sel + i);
  }
  return _mm512_load_si512(idx);
}

// acc[h] = alpha[h] acc[h] + sum_j w_hj V_j for SG query vectors over a
// chunk of n keys (rows at vp[j] + voff; vp[n] valid filler when n is odd),
// weights from cw[h]. Per key pair and 64-element block: two (int4) or four
// (int8) byte permutes build the four word vectors of elements 16k..16k+15
// (k < 4), each of which feeds SG vpdpwssd against the pair's weights.
template <KvDtype F, int SG>
KV_AVX512 void pv_chunk(const ChunkWeights* cw, const uint8_t* const* vp, int64_t voff, int n,
                        const float* alpha, float* acc, int d, const char* const* pf,
                        int per_step) {
  const int n2 = (n + 1) / 2 * 2;
  constexpr bool k4 = F == KvDtype::kInt4;
  constexpr __mmask64 kWordMask = k4 ? 0x5555555555555555ull : 0xAAAAAAAAAAAAAAAAull;
  __m512i ix[4];
#pragma GCC unroll 4
  for (int s = 0; s < (k4 ? 2 : 4); ++s) ix[s] = pair_index<F>(s);
  const __m512i nib = _mm512_set1_epi16(0x0f);
  for (int b = 0; b < d / 64; ++b) {
    const int ps = b == 0 ? per_step : 0;  // prefetches per key pair (first block only)
    __m512i ia[SG][4];                     // ia[h][k]: elements 64 b + 16 k + (0..15)
#pragma GCC unroll 4
    for (int h = 0; h < SG; ++h) {
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) ia[h][k] = _mm512_setzero_si512();
    }
    // A do-while (n >= 1): with a loop that may run zero times GCC 12 kept
    // two register copies of the accumulators and moved all SG x 4 of them
    // every key pair.
    int j = 0;
    do {
      for (int t = 0; t < ps; ++t) _mm_prefetch(pf[t], _MM_HINT_T0);
      pf += ps;
      __m512i v[4];
      if constexpr (k4) {
        const __m512i x = _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp[j] + voff + 32 * b)));
        const __m512i y = _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp[j + 1] + voff + 32 * b)));
#pragma GCC unroll 2
        for (int s = 0; s < 2; ++s) {
          const __m512i p = _mm512_maskz_permutex2var_epi8(kWordMask, x, ix[s], y);
          v[2 * s] = _mm512_and_si512(p, nib);
          v[2 * s + 1] = _mm512_srli_epi16(p, 4);
        }
      } else {
        const __m512i x = _mm512_loadu_si512(vp[j] + voff + 64 * b);
        const __m512i y = _mm512_loadu_si512(vp[j + 1] + voff + 64 * b);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
          v[s] = _mm512_srai_epi16(_mm512_maskz_permutex2var_epi8(kWordMask, x, ix[s], y), 8);
        }
      }
#pragma GCC unroll 4
      for (int h = 0; h < SG; ++h) {
        // int8 V: one weight per key; int4: group 2b for k < 2, 2b + 1 after.
        const __m512i w0 = _mm512_set1_epi32(load_i32(&cw[h].wq[k4 ? 2 * b : 0][j]));
        const __m512i w1 = k4 ? _mm512_set1_epi32(load_i32(&cw[h].wq[2 * b + 1][j])) : w0;
        ia[h][0] = dpwssd(ia[h][0], v[0], w0);
        ia[h][1] = dpwssd(ia[h][1], v[1], w0);
        ia[h][2] = dpwssd(ia[h][2], v[2], w1);
        ia[h][3] = dpwssd(ia[h][3], v[3], w1);
      }
      j += 2;
    } while (j < n2);
    // Back to float, scaled once per chunk and group.
#pragma GCC unroll 4
    for (int h = 0; h < SG; ++h) {
      float* ah = acc + static_cast<size_t>(h) * d + 64 * b;
      const __m512 al = _mm512_set1_ps(alpha[h]);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const int g = k4 ? 2 * b + k / 2 : 0;
        __m512 y = _mm512_mul_ps(_mm512_loadu_ps(ah + 16 * k), al);
        y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[h][k]), _mm512_set1_ps(cw[h].ws[g]), y);
        _mm512_storeu_ps(ah + 16 * k, y);
      }
    }
  }
}

// Weights of one query vector's chunk (p [kChunk], 0 past the chunk) for
// V format F, V metadata in vm: int8: p_j * scale_j; int4: per group
// p_j * scale_{j,g}, and the lane sums of p_j min_{j,g}.
template <KvDtype F>
KV_AVX512 void chunk_weights(const float* p, const ChunkMeta* vm, int d, ChunkWeights* cw) {
  __m512 px[kVecs], w[kVecs];
#pragma GCC unroll 4
  for (int x = 0; x < kVecs; ++x) px[x] = _mm512_loadu_ps(p + 16 * x);
  if constexpr (F == KvDtype::kInt8) {
#pragma GCC unroll 4
    for (int x = 0; x < kVecs; ++x) w[x] = _mm512_mul_ps(px[x], _mm512_load_ps(vm->f[0] + 16 * x));
    round_weights(w, cw->wq[0], &cw->ws[0]);
  } else {
    for (int g = 0; g < d / 32; ++g) {
      const float* sc = vm->f[2 * g];
      const float* mn = vm->f[2 * g + 1];
      __m512 msum = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int x = 0; x < kVecs; ++x) {
        w[x] = _mm512_mul_ps(px[x], _mm512_load_ps(sc + 16 * x));
        msum = _mm512_fmadd_ps(px[x], _mm512_load_ps(mn + 16 * x), msum);
      }
      round_weights(w, cw->wq[g], &cw->ws[g]);
      cw->msum[g] = msum;
    }
  }
}

using QkFn = void (*)(const PackedQuery*, int, const uint8_t* const*, int64_t, const ChunkMeta*,
                      int, float*);
using PvFn = void (*)(const ChunkWeights*, const uint8_t* const*, int64_t, int, const float*,
                      float*, int, const char* const*, int);

template <KvDtype F>
QkFn qk_fn(int sg) {
  switch (sg) {
    case 1:
      return qk16<F, 1>;
    case 2:
      return qk16<F, 2>;
    case 3:
      return qk16<F, 3>;
    default:
      return qk16<F, 4>;
  }
}

template <KvDtype F>
PvFn pv_fn(int sg) {
  switch (sg) {
    case 1:
      return pv_chunk<F, 1>;
    case 2:
      return pv_chunk<F, 2>;
    case 3:
      return pv_chunk<F, 3>;
    default:
      return pv_chunk<F, 4>;
  }
}

// Row and (per-row) metadata addresses of the chunk's keys in one stream of
// KV head hh (eight keys per step: pointers are 64-bit lanes).
KV_AVX512 void stream_rows(const HeadStream& s, int hh, const int64_t* base, const int32_t* slot,
                           int n, const uint8_t** rows, const uint8_t** metas) {
  const __m512i data = _mm512_set1_epi64(reinterpret_cast<intptr_t>(s.data + hh * s.head_stride));
  const __m512i meta =
      _mm512_set1_epi64(reinterpret_cast<intptr_t>(s.meta + hh * s.meta_head_stride));
  const __m512i ss = _mm512_set1_epi64(s.slot_stride);
  const __m512i ms = _mm512_set1_epi64(s.meta_slot_stride);
  for (int j = 0; j < n; j += 8) {
    const __mmask8 k = n - j >= 8 ? 0xFF : static_cast<__mmask8>((1u << (n - j)) - 1);
    const __m512i b = _mm512_maskz_loadu_epi64(k, base + j);
    const __m512i sl = _mm512_cvtepi32_epi64(_mm256_maskz_loadu_epi32(k, slot + j));
    _mm512_mask_storeu_epi64(
        rows + j, k, _mm512_add_epi64(_mm512_add_epi64(data, b), _mm512_mullo_epi64(sl, ss)));
    _mm512_mask_storeu_epi64(
        metas + j, k, _mm512_add_epi64(_mm512_add_epi64(meta, b), _mm512_mullo_epi64(sl, ms)));
  }
}

}  // namespace

bool avx512_vnni_decode_serves(KvDtype k, KvDtype v, int head_dim) {
  const bool k_ok = k == KvDtype::kInt8 || k == KvDtype::kInt4;
  const bool v_ok = v == KvDtype::kInt8 || v == KvDtype::kInt4;
  return k_ok && v_ok && head_dim > 0 && head_dim % 64 == 0 && head_dim <= 256;
}

KV_AVX512 void decode_tile_avx512_vnni(const TileArgs& a) {
  const int d = a.head_dim;
  const int g = a.group;
  const int n_vec = g * a.n_heads;
  KV_CHECK(avx512_vnni_decode_serves(a.k.dtype, a.v.dtype, d) && a.n_rows == 1,
           "decode_tile_avx512_vnni: unsupported tile");
  KV_CHECK(a.round_query, "decode_tile_avx512_vnni: keys are read with q^ only");
  const bool k4 = a.k.dtype == KvDtype::kInt4;
  const bool v4 = a.v.dtype == KvDtype::kInt4;
  // Scratch (floats): acc [n_vec, d], s [n_vec, kChunk], m, l, alpha,
  // corr [n_vec], gscale, qsum [n_vec, d / 32], lsum [n_vec, 16] (softmax
  // lane sums), wmin [n_vec, d / 32, 16] (int4 V: lane sums of p min per
  // group, rescaled as acc is), codes [n_vec, d / 4].
  const size_t ng = static_cast<size_t>(d) / 32;
  float* acc = thread_scratch().get(static_cast<size_t>(n_vec) *
                                    (d + kChunk + 4 + 2 * ng + 16 + 16 * ng + d / 4));
  float* s = acc + static_cast<size_t>(n_vec) * d;
  float* m = s + static_cast<size_t>(n_vec) * kChunk;
  float* l = m + n_vec;
  float* alpha = l + n_vec;
  float* corr = alpha + n_vec;
  float* gscale = corr + n_vec;
  float* qsum = gscale + n_vec * ng;
  float* lsum = qsum + n_vec * ng;
  float* wmin = lsum + static_cast<size_t>(n_vec) * 16;
  auto* codes = reinterpret_cast<int8_t*>(wmin + n_vec * ng * 16);
  thread_local std::vector<PackedQuery> tl_pq;
  if (tl_pq.size() < static_cast<size_t>(n_vec)) tl_pq.resize(static_cast<size_t>(n_vec));
  PackedQuery* pq = tl_pq.data();
  const int n_sub = (g + kMaxSub - 1) / kMaxSub;
  const int32_t t_begin = std::max(a.key_begin, first_visible(a.pos0, a.window));
  const int32_t t_end = std::min(a.key_end, a.pos0 + 1);
  const int k_row_bytes = k4 ? d / 2 : d;
  const int v_row_bytes = v4 ? d / 2 : d;
  const int n_kfields = k4 ? d / 16 : 1;  // f16 metadata fields per row
  const int n_vfields = v4 ? d / 16 : 1;
  int64_t base[2][kChunk];  // this chunk's and the next one's slots (a ring)
  int32_t slot[2][kChunk];
  const uint8_t* kp[kChunk];
  const uint8_t* km[kChunk];
  const uint8_t* vp[kChunk + 1];
  const uint8_t* vm[kChunk];
  ChunkMeta kmeta, vmeta;
  ChunkWeights cw[kMaxSub];
  const QkFn qk_sub[2] = {
      k4 ? qk_fn<KvDtype::kInt4>(g / n_sub) : qk_fn<KvDtype::kInt8>(g / n_sub),
      k4 ? qk_fn<KvDtype::kInt4>(g / n_sub + 1) : qk_fn<KvDtype::kInt8>(g / n_sub + 1)};
  const PvFn pv_sub[2] = {
      v4 ? pv_fn<KvDtype::kInt4>(g / n_sub) : pv_fn<KvDtype::kInt8>(g / n_sub),
      v4 ? pv_fn<KvDtype::kInt4>(g / n_sub + 1) : pv_fn<KvDtype::kInt8>(g / n_sub + 1)};
  int cur = 0;
  thread_local LinePrefetch pf;  // 66 KiB: not on the stack
  // Prefetch distance in (chunk, KV head) units: enough units that about
  // 8 KiB of K/V is in flight (int8 K and V at d = 64: one unit of 8.4 KiB;
  // int4: two of 5 KiB), at most the tile's heads (the next chunk's slots
  // are the only ones computed ahead).
  const int unit_bytes = kChunk * (k_row_bytes + v_row_bytes + 2 * (n_kfields + n_vfields));
  const int ahead = std::clamp((8192 + unit_bytes - 1) / unit_bytes, 1, a.n_heads);
  // The first units' lines are requested before the queries are packed,
  // so that the packing overlaps their latency.
  if (t_begin < t_end) {
    const int n0 = std::min<int32_t>(kChunk, t_end - t_begin);
    chunk_slots(a, t_begin, n0, base[0], slot[0]);
    pf.clear();
    for (int hh = 0; hh < ahead; ++hh) {
      pf.add(a, a.k, hh, base[0], slot[0], n0, k_row_bytes);
      pf.add(a, a.v, hh, base[0], slot[0], n0, v_row_bytes);
    }
    pf.flush();
  }
  for (int h = 0; h < n_vec; ++h) {
    pq[h] =
        PackedQuery{codes + static_cast<size_t>(h) * d, gscale + h * ng, qsum + h * ng, corr + h};
    pack_query(a.q + static_cast<size_t>(h) * d, a.scale, d, k4, pq[h]);
    std::memset(acc + static_cast<size_t>(h) * d, 0, sizeof(float) * d);
    m[h] = kNegInf;
    std::memset(lsum + h * 16, 0, sizeof(float) * 16);
    std::memset(wmin + h * ng * 16, 0, sizeof(float) * 16 * ng);
  }
  for (int32_t c0 = t_begin; c0 < t_end; c0 += kChunk) {
    const int n = std::min<int32_t>(kChunk, t_end - c0);
    const int32_t c1 = c0 + kChunk;
    const int nn = c1 < t_end ? std::min<int32_t>(kChunk, t_end - c1) : 0;
    const int nxt = cur ^ 1;
    // Rows of KV head 0; head hh's are at + hh * head_stride (meta likewise).
    stream_rows(a.k, 0, base[cur], slot[cur], n, kp, km);
    stream_rows(a.v, 0, base[cur], slot[cur], n, vp, vm);
    for (int j = n; j < kChunk; ++j) kp[j] = kp[0];  // finite filler, scores dropped
    vp[n] = vp[0];                                   // odd n: the pair's second key (weight 0)
    if (nn > 0) chunk_slots(a, c1, nn, base[nxt], slot[nxt]);
    for (int hh = 0; hh < a.n_heads; ++hh) {
      const int64_t koff = hh * a.k.head_stride, voff = hh * a.v.head_stride;
      // Prefetch distance: `ahead` (chunk, KV head) units. While KV head hh
      // of this chunk is computed, head hh + ahead of it (or of the next
      // chunk) is requested, a share per step (pace(): a double share per 16
      // keys of q . K, per query vector's softmax and weights and per
      // metadata gather, a single one per key pair of p . V): the lines in flight
      // stay in L1 beside the unit in use. A whole chunk of every head ahead
      // (this kernel's earlier distance) measured int8 at 0.64 of f16's time
      // at 32K against 0.60 with one unit; int4's unit is 5 KiB, too little
      // in flight to cover the memory latency at the stream rate, so it runs
      // two units ahead (benchmarks.md, session 15). Tried and slower: prefetching each
      // row from the chunk's row pointers instead of this list (a chunk or a
      // unit ahead), and software-pipelining q . K of the next unit before
      // p . V of this one (benchmarks.md, "VNNI kernel, session 14").
      pf.flush();
      pf.clear();
      if (hh + ahead < a.n_heads) {
        pf.add(a, a.k, hh + ahead, base[cur], slot[cur], n, k_row_bytes);
        pf.add(a, a.v, hh + ahead, base[cur], slot[cur], n, v_row_bytes);
      } else if (nn > 0) {
        pf.add(a, a.k, hh + ahead - a.n_heads, base[nxt], slot[nxt], nn, k_row_bytes);
        pf.add(a, a.v, hh + ahead - a.n_heads, base[nxt], slot[nxt], nn, v_row_bytes);
      }
      // The steps below: heavy, one per q . K call, the K and the V
      // metadata gathers, and per query vector its softmax and its weights;
      // light, one per p . V key pair and sub-group.
      const int heavy_steps = n_sub * ((n + 15) / 16) + 2 + 2 * g;
      const LinePrefetch::Pace pc = pf.pace(heavy_steps, n_sub * ((n + 1) / 2));
      pf.step(pc.heavy);
      gather_meta(km, hh * a.k.meta_head_stride, n, n_kfields, &kmeta);
      const int v0 = hh * g;
      for (int sub = 0, h0 = v0; sub < n_sub; ++sub) {
        const int big = sub < g % n_sub ? 1 : 0;
        const int sg = g / n_sub + big;
        for (int j0 = 0; j0 < n; j0 += 16) {
          pf.step(pc.heavy);
          qk_sub[big](pq + h0, d, kp + j0, koff, &kmeta, j0, s + h0 * kChunk + j0);
        }
        h0 += sg;
      }
      for (int h = v0; h < v0 + g; ++h) {
        pf.step(pc.heavy);
        alpha[h] = softmax_update(s + h * kChunk, n, m + h, lsum + h * 16);
      }
      if (a.mass_p != nullptr) {  // H2O key mass: this chunk's p (0-padded) and max
        uint16_t* mp = a.mass_p + (c0 / kChunk) * a.mass_stride;
        for (int h = v0; h < v0 + g; ++h) {
#pragma GCC unroll 4
          for (int x = 0; x < kVecs; ++x) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(mp + h * kChunk + 16 * x),
                                _mm512_cvtps_ph(_mm512_loadu_ps(s + h * kChunk + 16 * x),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
          }
          a.mass_m[(c0 / kChunk) * a.mass_m_stride + h] = m[h];
        }
      }
      pf.step(pc.heavy);
      gather_meta(vm, hh * a.v.meta_head_stride, n, n_vfields, &vmeta);
      for (int sub = 0, h0 = v0; sub < n_sub; ++sub) {
        const int big = sub < g % n_sub ? 1 : 0;
        const int sg = g / n_sub + big;
        for (int x = 0; x < sg; ++x) {
          pf.step(pc.heavy);
          if (v4) {
            chunk_weights<KvDtype::kInt4>(s + (h0 + x) * kChunk, &vmeta, d, cw + x);
          } else {
            chunk_weights<KvDtype::kInt8>(s + (h0 + x) * kChunk, &vmeta, d, cw + x);
          }
        }
        pv_sub[big](cw, vp, voff, n, alpha + h0, acc + static_cast<size_t>(h0) * d, d, pf.cursor(),
                    pc.light);
        pf.advance(pf.cursor() + (n + 1) / 2 * pc.light);
        if (v4) {
          for (int x = 0; x < sg; ++x) {
            float* wm = wmin + (h0 + x) * ng * 16;
            const __m512 al = _mm512_set1_ps(alpha[h0 + x]);
            for (size_t gi = 0; gi < ng; ++gi) {
              _mm512_storeu_ps(wm + 16 * gi,
                               _mm512_fmadd_ps(_mm512_loadu_ps(wm + 16 * gi), al, cw[x].msum[gi]));
            }
          }
        }
        h0 += sg;
      }
    }
    pf.flush();
    cur = nxt;
  }
  for (int i = 0; i < n_vec; ++i) {
    float* ai = acc + static_cast<size_t>(i) * d;
    l[i] = _mm512_reduce_add_ps(_mm512_loadu_ps(lsum + i * 16));
    if (v4) {  // sum_j p_j min_{j,g}, once per group
      for (int c = 0; c < d; c += 32) {
        const float mn = _mm512_reduce_add_ps(_mm512_loadu_ps(wmin + (i * ng + c / 32) * 16));
        for (int e = c; e < c + 32; ++e) ai[e] += mn;
      }
    }
  }
  finish_tile(a, n_vec, acc, m, l);
}

}  // namespace kvstack::attn_detail
