// Orthogonal rotation of queries, keys and values per head (issue 7,
// --kv-rotate): R = H D / sqrt(d), where H is the d x d Sylvester-Hadamard
// matrix (entries +-1, H H^T = d I) and D a fixed diagonal of pseudo-random
// signs. Applied to every query and key head vector after RoPE and to every
// value head vector, before K and V are quantized:
//  - scores: (R q).(R k) = q.k (R^T R = I);
//  - outputs: sum_j p_j (R v_j) = R sum_j p_j v_j, so the attention output
//    of each query head is mapped back with R^T before the output projection.
// Both are exact in real arithmetic (an f32 cache gives the same logits to
// float error), but channels with outliers are spread over all d channels,
// so a per-row or per-group quantizer sees a flatter, more Gaussian
// distribution in K and in V.
//
// The sign vector is a pure function of the channel index (fixed seed), so a
// cache written with rotation is readable by any process that uses the same
// rotation; kv_rotation_key() names it in the cache identity.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/result.h"

namespace kvstack {

enum class KvRotation : uint8_t {
  kNone,
  kHadamard,  // normalized Walsh-Hadamard with the fixed random signs, on Q, K and V
};

const char* kv_rotation_name(KvRotation r);  // "none", "hadamard"

// The rotation's part of the cache identity ("" for kNone: an unrotated
// cache keeps its former identity). Names what is rotated (Q/K and V), so
// caches written by the former K-only rotation never match.
std::string kv_rotation_key(KvRotation r);

// kInvalidArgument unless the rotation can act on vectors of head_dim
// elements (kHadamard: a power of two, 2..16384).
Status kv_rotation_check(KvRotation r, int head_dim);

// Sign of channel i (+1 or -1) of the fixed diagonal D.
float kv_rotation_sign(int i);

// In place, for each of n_vecs vectors of head_dim floats:
// x <- H D x / sqrt(head_dim). x: [n_vecs, head_dim] row-major.
// REQUIRES kv_rotation_check(kHadamard, head_dim) passed.
void hadamard_rotate(float* x, int64_t n_vecs, int head_dim);

// The inverse x <- D H x / sqrt(head_dim) (R^T; H is symmetric).
void hadamard_unrotate(float* x, int64_t n_vecs, int head_dim);

// Unnormalized fast Walsh-Hadamard transform of one vector: x <- H x.
// REQUIRES n a power of two.
void fwht(float* x, int n);

// Applies `r` to [n_vecs, head_dim] (no-op for kNone).
inline void kv_rotate(KvRotation r, float* x, int64_t n_vecs, int head_dim) {
  if (r == KvRotation::kHadamard) hadamard_rotate(x, n_vecs, head_dim);
}

// Applies the inverse of `r` (R^T) to [n_vecs, head_dim] (no-op for kNone):
// maps attention outputs computed over rotated values back.
inline void kv_unrotate(KvRotation r, float* x, int64_t n_vecs, int head_dim) {
  if (r == KvRotation::kHadamard) hadamard_unrotate(x, n_vecs, head_dim);
}

}  // namespace kvstack
