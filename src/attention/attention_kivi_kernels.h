// Internal: the primitives of the scalar KIVI attention kernel
// (attention_kivi.cpp drives them; on AVX2 the shared kernels of
// attention_kernels.h read KIVI instead).
#pragma once

#include <cstdint>

namespace kvstack::kivi_detail {

struct KiviOps {
  // n key rows of one KIVI key group: row t's codes at codes + t * code_stride,
  // the group's d (f16 scale, f16 min) pairs at meta. out: [n, d].
  void (*key_rows)(int bits, const uint8_t* codes, int64_t code_stride, const uint8_t* meta, int n,
                   int d, float* out);
  // n KIVI value rows: row t's codes at codes + t * code_stride, its d / 32
  // pairs at meta + t * meta_stride. out: [n, d].
  void (*value_rows)(int bits, const uint8_t* codes, int64_t code_stride, const uint8_t* meta,
                     int64_t meta_stride, int n, int d, float* out);
  // n f16 rows (residual), row t at src + t * stride elements. out: [n, d].
  void (*f16_rows)(const uint16_t* src, int64_t stride, int n, int d, float* out);
  float (*dot)(const float* a, const float* b, int d);
  // x[t] = exp(x[t] - m) for t < n (-inf gives 0).
  void (*exp_shift)(float* x, int n, float m);
  // acc[i] = acc[i] * c + sum_t w[t] * x[t * d + i], t < n, in t order.
  void (*scale_pv)(float* acc, float c, const float* w, const float* x, int n, int d);
};

const KiviOps& scalar_ops();

}  // namespace kvstack::kivi_detail
