// Row-wise and element-wise float32 ops of the llama forward pass, with the
// same formulas (and accumulation precision) as ggml's CPU backend.
// All pointers are float32; `out` may alias the first input unless stated.
#pragma once

#include <cstdint>

namespace kvstack {

// out[r, i] = (x[r, i] * s_r) * weight[i], s_r = 1 / sqrt(mean_i(x[r, i]^2) + eps);
// the sum of squares is accumulated in double (as ggml does): sequentially on
// the scalar path, in 16 lanes on the AVX2 path (the two agree to <= 2 ulp
// per output, in practice bit for bit). A row's bits depend only on the row.
// x, out: [n_rows, n]; weight: [n] (nullptr = no weight). out may alias x.
void rms_norm(const float* x, const float* weight, int64_t n_rows, int64_t n, float eps,
              float* out);
// One row: the n_rows = 1 case.
inline void rms_norm(const float* x, const float* weight, int64_t n, float eps, float* out) {
  rms_norm(x, weight, 1, n, eps, out);
}

enum class RopeStyle {
  kNormal,  // llama: rotates adjacent pairs (x[2i], x[2i+1])
  kNeox,    // neox/qwen: rotates (x[i], x[i + n_rot/2])
};

struct RopeParams {
  RopeStyle style = RopeStyle::kNormal;
  int n_rot = 0;  // rotary dims, even, <= head_dim; dims >= n_rot are untouched
  float freq_base = 10000.f;
  float freq_scale = 1.f;  // linear position scaling (1 / scaling factor)
};

// In-place rotary embedding of x: [n_tokens, n_heads, head_dim] (rows
// contiguous), token t at logical position pos[t]. Angle for pair i:
// pos * freq_scale * freq_base^(-2i/n_rot), computed as ggml does (running
// product of theta_scale in float).
// The (cos, sin) table of the last call's positions is kept per thread and
// reused while positions and parameters repeat (Q and K of every layer).
// REQUIRES: n_rot even, 0 < n_rot <= head_dim.
void rope(float* x, const int32_t* pos, int64_t n_tokens, int64_t n_heads, int64_t head_dim,
          const RopeParams& params);

// out[i] = silu(gate[i]) * up[i], silu(v) = v / (1 + exp(-v)). out may alias gate or up.
void swiglu(const float* gate, const float* up, float* out, int64_t n);
// tanh-approximated GELU in float, ggml's formula:
// 0.5f * x * (1 + tanhf(sqrt(2/pi) * x * (1 + 0.044715 * x^2))).
float gelu_tanh(float x);
// GeGLU: out[i] = gelu(gate[i]) * up[i], with the GELU value as llama.cpp's
// CPU backend computes it (GGML_GELU_FP16): gate <= -10 gives 0, gate >= 10
// gives gate itself, otherwise gate is rounded to f16 and GELU is read from a
// table of f16(gelu_tanh(h)) over every f16 value h. So the activation carries
// an f16 rounding (relative error <= 2^-11 plus the input rounding), exactly
// the rounding llama.cpp applies. out may alias gate or up.
void geglu(const float* gate, const float* up, float* out, int64_t n);
// out[i] = a[i] + b[i]  (residual add).
void add(const float* a, const float* b, float* out, int64_t n);
// out[i] = a[i] * b[i].
void mul(const float* a, const float* b, float* out, int64_t n);
// x[i] *= s.
void scale(float* x, float s, int64_t n);

// Index of the first largest x[i] (std::max_element's answer), e.g. the
// greedy token over a logits row (262,144 floats for Gemma 3, where the
// scalar loop cost ~3% of a decode step). Exact: comparisons only.
// REQUIRES: n >= 1, no NaN in x (the result is then unspecified).
int64_t argmax(const float* x, int64_t n);

}  // namespace kvstack
