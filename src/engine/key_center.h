// Key centering (issue 7, --kv-center): a fixed vector mu per layer and KV
// head, subtracted from every key after RoPE and before --kv-rotate, so the
// cache stores (quantized) k - mu instead of k.
//
// Exactness: for one query q, q.(k_j - mu) = q.k_j - q.mu for every key j of
// the same head; softmax is invariant to adding one constant to all of a
// query's scores, so attention outputs are unchanged in real arithmetic (an
// f32 cache gives the same logits to float error). Values are untouched.
//
// Why: this model's keys carry large per-channel offsets after RoPE (a few
// channels sit far from zero for every token). A per-token quantizer with
// groups along the head dimension (int4: 32 channels share a scale and min)
// spends most of its range on those offsets; with the offsets removed the
// same 4-bit codes resolve the part of k that varies from key to key.
//
// mu is the mean of the post-RoPE keys over a calibration text (a built-in
// text unless the user gives one), computed once at engine start with an
// f32 cache, rounded to multiples of 2^-8 so that small float-order
// differences (other thread counts) do not change it. mu is part of the
// cache identity (key()), so blocks written with one mu are never read by a
// process that subtracts another.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "core/thread_pool.h"
#include "engine/model.h"

namespace kvstack {

struct KeyCenter {
  int n_layers = 0;
  int kv_dim = 0;           // n_kv_heads * head_dim
  int64_t n_tokens = 0;     // calibration tokens the mean was taken over
  std::vector<float> mean;  // [n_layers, kv_dim], multiples of kKeyCenterStep

  // mu of layer l: [kv_dim] (KV head h at h * head_dim).
  const float* layer(int l) const { return mean.data() + static_cast<int64_t>(l) * kv_dim; }

  // The cache-identity part: names the transform, the grid and a 64-bit
  // FNV-1a hash of the rounded means.
  std::string key() const;
};

inline constexpr float kKeyCenterStep = 1.0f / 256.0f;

// A few hundred words of ordinary English prose (narrative, instructions,
// a recipe, numbers), written for this purpose; the default calibration text.
std::string_view key_center_builtin_text();

// Runs `tokens` through the model with an f32 cache (prefill chunks of
// `chunk` tokens) and returns the per-layer, per-channel mean of the keys
// after RoPE. Errors: kInvalidArgument when tokens is empty or longer than
// the model's context; a forward-pass error otherwise.
Result<KeyCenter> calibrate_key_center(const Model& model, ThreadPool& threads,
                                       std::span<const int32_t> tokens, int64_t chunk = 512);

}  // namespace kvstack
