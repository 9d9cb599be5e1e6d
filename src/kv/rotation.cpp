#include "kv/rotation.h"

#include <immintrin.h>

#include <cmath>
#include <vector>

#include "core/cpu_features.h"

namespace kvstack {
namespace {

constexpr int kMaxDim = 16384;

// splitmix64 finalizer: a fixed, well-mixed function of the channel index.
uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kSignSeed = 0x6b7673746b2d726fULL;  // fixed: part of the format

// Strides 1, 2 and 4 of one 8-float vector in registers: lane j of the
// butterfly pair (j, j + h) gets a + b, lane j + h gets a - b, from the
// vector and its lanes swapped at distance h (the same two operands as the
// scalar loop: a + b commutes exactly, and a - b is formed as written).
__attribute__((target("avx2,fma,f16c"))) inline __m256 fwht8_avx2(__m256 v) {
  __m256 s = _mm256_permute_ps(v, 0xB1);                                // lanes 1,0,3,2,...
  v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xAA);  // odd lanes: a - b
  s = _mm256_permute_ps(v, 0x4E);                                       // lanes 2,3,0,1,...
  v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xCC);
  s = _mm256_permute2f128_ps(v, v, 0x01);  // the two 128-bit halves swapped
  return _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xF0);
}

// Strides 1, 2, 4 within each 8-float vector (fwht8_avx2), then the
// butterflies with stride >= 8 on whole vectors; n < 8 runs the scalar loop.
__attribute__((target("avx2,fma,f16c"))) void fwht_avx2(float* x, int n) {
  if (n < 8) {
    for (int h = 1; h < n; h *= 2) {
      for (int i = 0; i < n; i += 2 * h) {
        for (int j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
      }
    }
    return;
  }
  if (n == 64) {  // the common head size: all six stages in registers
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = fwht8_avx2(_mm256_loadu_ps(x + 8 * i));
    for (int h = 1; h < 8; h *= 2) {
      for (int i = 0; i < 8; i += 2 * h) {
        for (int j = i; j < i + h; ++j) {
          const __m256 a = r[j], b = r[j + h];
          r[j] = _mm256_add_ps(a, b);
          r[j + h] = _mm256_sub_ps(a, b);
        }
      }
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(x + 8 * i, r[i]);
    return;
  }
  for (int i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, fwht8_avx2(_mm256_loadu_ps(x + i)));
  for (int h = 8; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(x + j);
        const __m256 b = _mm256_loadu_ps(x + j + h);
        _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
      }
    }
  }
}

void fwht_scalar(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

// Both paths perform the same additions in the same order, so they agree
// bit for bit.
bool use_avx2() {
  return best_isa() >= Isa::kAvx2;
}

}  // namespace

const char* kv_rotation_name(KvRotation r) {
  return r == KvRotation::kHadamard ? "hadamard" : "none";
}

std::string kv_rotation_key(KvRotation r) {
  return r == KvRotation::kHadamard ? "qkv-hadamard-signs-v2" : "";
}

Status kv_rotation_check(KvRotation r, int head_dim) {
  if (r == KvRotation::kNone) return {};
  if (head_dim < 2 || head_dim > kMaxDim || (head_dim & (head_dim - 1)) != 0) {
    return make_error(Errc::kInvalidArgument,
                      "--kv-rotate needs a head dimension that is a power of two in [2, " +
                          std::to_string(kMaxDim) + "] (this model's is " +
                          std::to_string(head_dim) + ")");
  }
  return {};
}

float kv_rotation_sign(int i) {
  return (mix64(kSignSeed ^ static_cast<uint64_t>(i)) >> 63) != 0 ? -1.0f : 1.0f;
}

namespace {

// sign(i) / sqrt(head_dim) for i < head_dim, built once per thread and size
// (the forward pass rotates a few vectors per call, many calls per step).
const float* scaled_signs(int head_dim) {
  thread_local std::vector<float> sign;
  thread_local int built_for = 0;
  if (built_for != head_dim) {
    const float norm = 1.0f / std::sqrt(static_cast<float>(head_dim));
    sign.resize(static_cast<size_t>(head_dim));
    for (int i = 0; i < head_dim; ++i) sign[i] = kv_rotation_sign(i) * norm;
    built_for = head_dim;
  }
  return sign.data();
}

}  // namespace

void fwht(float* x, int n) {
  if (use_avx2()) return fwht_avx2(x, n);
  fwht_scalar(x, n);
}

void hadamard_rotate(float* x, int64_t n_vecs, int head_dim) {
  const float* sign = scaled_signs(head_dim);
  for (int64_t v = 0; v < n_vecs; ++v) {
    float* row = x + v * head_dim;
    for (int i = 0; i < head_dim; ++i) row[i] *= sign[i];
    fwht(row, head_dim);
  }
}

void hadamard_unrotate(float* x, int64_t n_vecs, int head_dim) {
  const float* sign = scaled_signs(head_dim);
  for (int64_t v = 0; v < n_vecs; ++v) {
    float* row = x + v * head_dim;
    fwht(row, head_dim);
    for (int i = 0; i < head_dim; ++i) row[i] *= sign[i];
  }
}

}  // namespace kvstack
