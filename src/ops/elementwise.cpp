#include "ops/elementwise.h"

#include <cmath>
#include <vector>

#include "core/check.h"

namespace kvstack {

void rms_norm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
              float* out) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(xr[i]) * xr[i];
    const float mean = static_cast<float>(sum / static_cast<double>(n));
    const float s = 1.0f / std::sqrt(mean + eps);
    if (weight) {
      for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * s) * weight[i];
    } else {
      for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * s;
    }
  }
}

void rope(float* x, const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
          const RopeParams& p) {
  KV_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim,
           "rope: n_rot must be even and in (0, head_dim]");
  const int half = p.n_rot / 2;
  const float theta_scale = std::pow(p.freq_base, -2.0f / static_cast<float>(p.n_rot));
  thread_local std::vector<float> cs;  // [half] (cos, sin) pairs for the current token
  if (cs.size() < static_cast<size_t>(p.n_rot)) cs.resize(p.n_rot);
  for (int64_t t = 0; t < n_tokens; ++t) {
    // theta_i = pos * theta_scale^i, as a running float product (as ggml does).
    float theta = static_cast<float>(pos[t]);
    for (int i = 0; i < half; ++i) {
      const float a = theta * p.freq_scale;
      cs[2 * i] = std::cos(a);
      cs[2 * i + 1] = std::sin(a);
      theta *= theta_scale;
    }
    for (int64_t h = 0; h < n_heads; ++h) {
      float* v = x + (t * n_heads + h) * head_dim;
      for (int i = 0; i < half; ++i) {
        const float c = cs[2 * i], s = cs[2 * i + 1];
        float* a = p.style == RopeStyle::kNormal ? v + 2 * i : v + i;
        float* b = p.style == RopeStyle::kNormal ? v + 2 * i + 1 : v + i + half;
        const float x0 = *a, x1 = *b;
        *a = x0 * c - x1 * s;
        *b = x0 * s + x1 * c;
      }
    }
  }
}

void swiglu(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void add(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void mul(const float* a, const float* b, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

void scale(float* x, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace kvstack
