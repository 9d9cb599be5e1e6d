// Internal tile kernels and the shared work planner behind paged_attention()
// and paged_attention_quant(); not part of the public API.
//
// Every K/V format (f32, f16, bf16, fp8, int8, int4, and K and V in different
// formats) goes through the same planner (run_attention) and the same three
// kernels; the format-specific part is the inner per-chunk code of the AVX2
// kernels (a table indexed by format) and the row decoder of the scalar one.
//
// A tile is the work of one (sequence, KV head, run of query rows, key range)
// (decode tiles may take several consecutive KV heads, see TileArgs::n_heads):
// its "query vectors" are the n_rows x group (row, q head) pairs that share
// that KV head, vector i = row i / group, q head kv_head * group + i % group.
// A tile either writes the normalised output, or (split-K) its unnormalised
// partial state (running max, running sum, accumulator) for a later merge.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>

#include "attention/paged_attention.h"
#include "core/check.h"
#include "core/cpu_features.h"
#include "kv/kv_view.h"

namespace kvstack::attn_detail {

// One stream (K or V) of one KV head.
struct HeadStream {
  const uint8_t* data = nullptr;  // view.k + kv_head * head_stride (or V's)
  const uint8_t* meta = nullptr;  // k_meta + kv_head * k_meta_head_stride; null for floats
  int64_t slot_stride = 0;        // bytes between positions of one block
  int64_t meta_slot_stride = 0;   // bytes between metadata records (0: per-block metadata)
  int64_t head_stride = 0;        // bytes from this KV head to the next (data)
  int64_t meta_head_stride = 0;   // same for the metadata
  KvDtype dtype = KvDtype::kF32;
  // Slots sharing one metadata record: slot s's record is s / meta_group
  // (1 for the per-row formats; G for a KIVI K, whose record is the d
  // (scale, min) pairs of its key group, meta_slot_stride = 4 d bytes).
  int meta_group = 1;
};

struct TileArgs {
  HeadStream k;
  HeadStream v;
  const int32_t* block_table = nullptr;
  int64_t block_stride = 0;  // bytes
  int block_size = 0;
  int head_dim = 0;
  const float* q = nullptr;  // vector (r, g) at q + r * row_stride + g * head_dim
  float* out = nullptr;      // same layout as q; used when part_acc is null
  int64_t row_stride = 0;    // floats between query rows: n_q_heads * head_dim
  int n_rows = 0;
  int group = 0;          // q heads per KV head
  int32_t pos0 = 0;       // logical position of row 0
  int window = 0;         // 0: full causal
  int32_t key_begin = 0;  // keys [key_begin, key_end) of this piece (split-K)
  int32_t key_end = 0;    // each row additionally sees only its causal/window range
  float scale = 0.0f;
  // Attend with q^ (round_query_int8, attention_quant.h): set for the rows of
  // a decode sequence (n_new == 1) over int4 keys, and over int8 keys on the
  // AVX-512 VNNI decode kernel; the AVX2 decode kernel reads int4 keys and
  // the VNNI kernel every key only this way.
  bool round_query = false;
  // Decode tiles (n_rows == 1) may cover n_heads consecutive KV heads: head j
  // reads k/v data (and meta) + j * head_stride (meta_head_stride) and its q
  // heads are vectors j * group .. j * group + group - 1 (consecutive q heads,
  // so vector i is at q + i * head_dim). Other tiles take n_heads == 1.
  int n_heads = 1;
  // Split-K partial output, [n_vec] entries each, n_vec = n_rows * group *
  // n_heads, or all null.
  float* part_m = nullptr;
  float* part_l = nullptr;
  float* part_acc = nullptr;  // [n_vec, head_dim]
  // Key mass (AttnSeq::key_mass; decode tiles only, window 0), or null:
  // chunk-major records, so that one chunk's writes are one contiguous
  // run. For vector i and every key t it reads, with chunk c = t / C, C =
  // decode_mass_chunk(its path) (chunks start at multiples of C: split-K
  // pieces start at multiples of 512 and the window is 0), the kernel stores
  // mass_p[c * mass_stride + i * C + t % C] = exp(s_it - m) as f16 (rounded
  // to nearest even: a relative error of at most 2^-11 for values of at
  // least 2^-14, an absolute one of at most 2^-25 below), m the running max
  // after chunk c, and mass_m[c * mass_m_stride + i] = that m (float). The
  // kernel may also write the chunk's C - (keys it reads) padding slots
  // (with 0): the buffer has whole chunks.
  uint16_t* mass_p = nullptr;
  float* mass_m = nullptr;
  int64_t mass_stride = 0;
  int64_t mass_m_stride = 0;
};

// First position visible to a query at position `pos`.
inline int32_t first_visible(int32_t pos, int window) {
  if (window <= 0) return 0;
  const int64_t lo = static_cast<int64_t>(pos) - window + 1;
  return lo < 0 ? 0 : static_cast<int32_t>(lo);
}

// Row and metadata addresses of logical position t in one stream.
inline const uint8_t* stream_row(const TileArgs& a, const HeadStream& s, int32_t t) {
  return s.data + a.block_table[t / a.block_size] * a.block_stride +
         (t % a.block_size) * s.slot_stride;
}
inline const uint8_t* stream_meta(const TileArgs& a, const HeadStream& s, int32_t t) {
  if (s.meta == nullptr) return nullptr;
  return s.meta + a.block_table[t / a.block_size] * a.block_stride +
         (t % a.block_size) / s.meta_group * s.meta_slot_stride;
}

// Block base offset (bytes, base[j]) and slot (slot[j]) of logical positions
// [t0, t0 + n): a block table walk shared by the SIMD kernels (defined in a
// TU without ISA flags, attention_kernels_scalar.cpp).
void chunk_slots(const TileArgs& a, int32_t t0, int n, int64_t* base, int32_t* slot);

// Streams of KV head h of a view (K and V each in their own format; a KIVI
// K gets its key-group metadata records).
HeadStream k_stream(const PagedKvLayerView& kv, int h);
HeadStream v_stream(const PagedKvLayerView& kv, int h);

// The kernel family a tile runs on.
enum class KernelPath : uint8_t { kScalar, kAvx2, kAvx512Vnni, kAvx512F16, kAvx512 };
// "scalar", "avx2", "avx512-vnni", "avx512-f16", "avx512" (the prefill tiles'
// AVX-512 F products).
const char* kernel_path_name(KernelPath path);

// Keys per running-max record of a decode kernel's key-mass output
// (TileArgs::mass_m): its chunk (1 for the scalar kernel, which updates the
// max per key).
constexpr int kMassChunkAvx2 = 32;
constexpr int kMassChunkVnni = 64;
constexpr int kMassChunkAvx512F16 = 32;
inline int decode_mass_chunk(KernelPath path) {
  return path == KernelPath::kAvx2         ? kMassChunkAvx2
         : path == KernelPath::kAvx512Vnni ? kMassChunkVnni
         : path == KernelPath::kAvx512F16  ? kMassChunkAvx512F16
                                           : 1;
}

// The kernels of one call: for decode rows (a sequence with n_new == 1) and
// for prefill rows (n_new > 1).
struct KernelChoice {
  KernelPath decode = KernelPath::kScalar;
  KernelPath prefill = KernelPath::kScalar;
  bool operator==(const KernelChoice&) const = default;
};

// The one place that decides which kernels paged_attention() (and its
// quantized and KIVI entry points) run for keys in k, values in v and
// head_dim at the ISA cap `isa` (clamped to best_isa() and the CPU's
// features); attention_kernel_name() reports it. AVX2 needs AVX2+FMA+F16C
// and head_dim % 8 == 0; the AVX-512 VNNI decode kernel serves int8 K with
// int8 V and int4 K with int4 V (see avx512_vnni_decode_serves).
KernelChoice select_kernels(Isa isa, KvDtype k, KvDtype v, int head_dim);

// Whether decode rows attend with q^ (TileArgs::round_query) on kc's decode
// kernel: over int4 keys on every path, over int8 keys on the VNNI kernel.
inline bool decode_rounds_query(const KernelChoice& kc, KvDtype k) {
  return k == KvDtype::kInt4 || (k == KvDtype::kInt8 && kc.decode == KernelPath::kAvx512Vnni);
}

// Plans and runs attention for a validated batch: tiles, split-K, threads,
// merge, on the kernels `kc` names (select_kernels: the caller has checked
// that the CPU has them).
//
// Batch invariance: how a sequence is cut into tiles and split-K pieces
// depends only on its own n_past, n_new, the shape and fixed constants (not
// on the other sequences, nor the thread count), each piece is computed by
// one thread in a fixed order and the pieces are merged in a fixed order, so
// a sequence's output is bitwise the same alone, in any batch, and on any
// number of threads.
void run_attention(const KernelChoice& kc, const PagedKvLayerView& kv, const AttnParams& p,
                   std::span<const AttnSeq> seqs, ThreadPool* pool);

// Writes a tile's result from its accumulators acc [n_vec, head_dim] and
// online-softmax state m, l [n_vec]: the split-K partial state when
// a.part_acc is set, else acc / l (0 where l == 0) to a.out, vector i being
// q head i of the tile for one query row (any n_heads), else q head i % group
// of row i / group. Shared by every tile kernel.
void finish_tile(const TileArgs& a, int n_vec, const float* acc, const float* m, const float* l);

// Generic kernel for any tile shape and format (kv_decode_row per row);
// float accumulation, std::exp. REQUIRES n_heads == 1.
void tile_scalar(const TileArgs& a);
// AVX2+FMA+F16C kernels. REQUIRES: head_dim % 8 == 0 and a CPU with them.
// The decode kernel also reads KIVI K and V (kivi_codec.h; head_dim % 32 ==
// 0), for the blocks of attention_kivi.cpp's decode rows.
void decode_tile_avx2(const TileArgs& a);   // REQUIRES: n_rows == 1
void prefill_tile_avx2(const TileArgs& a);  // any n_rows; REQUIRES n_heads == 1
// The same tile with its two products (q . K, p . V) on AVX-512 F vectors:
// the same bits as prefill_tile_avx2. REQUIRES AVX-512 F, n_heads == 1.
void prefill_tile_avx512(const TileArgs& a);
// The prefill tile of select_kernels' prefill path (kAvx512 or kAvx2).
inline void prefill_tile_on(KernelPath path, const TileArgs& a) {
  if (path == KernelPath::kAvx512) {
    prefill_tile_avx512(a);
  } else {
    prefill_tile_avx2(a);
  }
}

// Key-mass reduction (run_attention's last pass): dst[j] += sum over r <
// n_rows, in order, of f16 rows[r][j] * f[r] (fused multiply-adds from 0),
// for j < n. REQUIRES AVX2+FMA+F16C.
void mass_add_rows_avx2(const uint16_t* const* rows, const float* f, int n_rows, int n, float* dst);

// AVX-512 F/BW/VL/DQ + VNNI decode kernel (attention_kernels_avx512.cpp):
// integer dot products on int8/int4 codes, q . K against q^ (round_query
// must be set) and p . V with int16-rounded weights. REQUIRES n_rows == 1,
// avx512_vnni_decode_serves(k, v, head_dim) and a CPU with those features.
void decode_tile_avx512_vnni(const TileArgs& a);
// K and V formats (each int8 or int4) and head_dim (a multiple of 64, at
// most 256) the VNNI decode kernel reads.
bool avx512_vnni_decode_serves(KvDtype k, KvDtype v, int head_dim);

// AVX-512 F decode kernel for f16 K and f16 V (attention_kernels_avx512_f16
// .cpp): the AVX2 f16 decode path on 16 lanes, float arithmetic (results
// differ from the AVX2 kernel's in summation order only). Writes the key
// mass (TileArgs::mass_p/mass_m) with chunk kMassChunkAvx512F16. REQUIRES
// n_rows == 1, avx512_f16_decode_serves(k, v, head_dim) and a CPU with
// AVX-512 F.
void decode_tile_avx512_f16(const TileArgs& a);
// f16 K with f16 V, head_dim a multiple of 16.
bool avx512_f16_decode_serves(KvDtype k, KvDtype v, int head_dim);

// Growable 64-byte-aligned float buffer for per-thread scratch: it only
// grows, so steady-state calls do not allocate.
class ScratchBuffer {
 public:
  float* get(size_t n_floats) {
    if (n_floats > capacity_) {
      const size_t cap = (n_floats + 15) / 16 * 16;
      data_.reset(static_cast<float*>(std::aligned_alloc(64, cap * sizeof(float))));
      KV_CHECK(data_ != nullptr, "attention scratch allocation failed");
      capacity_ = cap;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> data_;
  size_t capacity_ = 0;
};

// The calling thread's kernel scratch.
ScratchBuffer& thread_scratch();

// Combines the split-K pieces of query vector v, in piece order, into its
// normalised output dst [head_dim]. Piece k is at parts + k * part_floats,
// laid out [m: n_vec][l: n_vec][acc: n_vec, head_dim]; a piece that saw no
// key (m = -inf) is skipped.
void merge_split_k(const float* parts, int n_parts, int64_t part_floats, int n_vec, int v,
                   int head_dim, float* dst);

}  // namespace kvstack::attn_detail
