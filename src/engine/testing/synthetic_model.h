// Test helper: a small random-weight llama-architecture GGUF written to a
// temporary file, plus a straightforward double-precision reference forward
// with no cache (every step recomputes the whole prefix).
#pragma once

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "kv/kv_view.h"
#include "model/tools/gguf_builder.h"

namespace kvstack::testing {

struct SyntheticSpec {
  int n_layers = 2;
  int n_embd = 64;
  int n_heads = 4;
  int n_kv_heads = 2;
  int n_ff = 96;
  int n_vocab = 50;
  int n_ctx = 512;
  float rope_base = 10000.0f;
  bool neox = false;  // qwen2-style rope and qkv bias when true
  uint32_t seed = 1;
  // Per-layer attention window (empty: full attention everywhere). Not in
  // the GGUF: load_synthetic_model applies it (Model::set_layer_windows),
  // and the reference masks keys j < t - w + 1 as the kernels do.
  std::vector<int> layer_window = {};
  // Cross-layer KV sharing: the last N layers read the K/V of the last storing
  // layer with their window (written as <arch>.attention.shared_kv_layers).
  int shared_kv_layers = 0;
  int head_dim() const { return n_embd / n_heads; }
  int kv_source(int l) const {
    const int first_shared = n_layers - shared_kv_layers;
    if (l < first_shared) return l;
    int src = first_shared - 1;
    while (src > 0 && window(src) != window(l)) --src;
    return src;
  }
  int window(int l) const {
    return layer_window.empty() ? 0 : layer_window[static_cast<size_t>(l)];
  }
};

// Weights as float64 copies (for the reference) of what the file stores (f32).
struct SyntheticWeights {
  SyntheticSpec spec;
  std::vector<double> embd;  // [n_vocab, n_embd]
  std::vector<double> out_norm;
  struct Layer {
    std::vector<double> attn_norm, wq, wk, wv, wo, bq, bk, bv, ffn_norm, gate, up, down;
  };
  std::vector<Layer> layers;
  std::string path;  // the written GGUF
};

inline std::vector<double> random_vec(std::mt19937& rng, size_t n, double scale,
                                      double offset = 0) {
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<double> v(n);
  // Values are stored in f32, so keep the float-rounded value for the reference.
  for (auto& x : v) x = static_cast<float>(offset + scale * d(rng));
  return v;
}

inline Bytes f32_tensor(const std::vector<double>& v) {
  Bytes b(v.size() * 4);
  for (size_t i = 0; i < v.size(); ++i) {
    const auto f = static_cast<float>(v[i]);
    std::memcpy(b.data() + 4 * i, &f, 4);
  }
  return b;
}

// Writes the model to a unique file under /tmp (deleted by the caller).
inline SyntheticWeights make_synthetic_model(const SyntheticSpec& s) {
  SyntheticWeights w;
  w.spec = s;
  std::mt19937 rng(s.seed);
  const int hd = s.head_dim();
  const size_t q_dim = static_cast<size_t>(s.n_heads) * hd;
  const size_t kv_dim = static_cast<size_t>(s.n_kv_heads) * hd;
  const double ws = 1.0 / std::sqrt(static_cast<double>(s.n_embd));
  w.embd = random_vec(rng, static_cast<size_t>(s.n_vocab) * s.n_embd, 1.0);
  w.out_norm = random_vec(rng, s.n_embd, 0.1, 1.0);
  GgufBuilder b;
  const std::string arch = s.neox ? "qwen2" : "llama";
  b.add_string("general.architecture", arch);
  b.add_u32(arch + ".block_count", s.n_layers);
  b.add_u32(arch + ".embedding_length", s.n_embd);
  b.add_u32(arch + ".attention.head_count", s.n_heads);
  b.add_u32(arch + ".attention.head_count_kv", s.n_kv_heads);
  b.add_u32(arch + ".feed_forward_length", s.n_ff);
  b.add_u32(arch + ".context_length", s.n_ctx);
  b.add_u32(arch + ".vocab_size", s.n_vocab);
  b.add_scalar<float>(arch + ".rope.freq_base", kVF32, s.rope_base);
  b.add_scalar<float>(arch + ".attention.layer_norm_rms_epsilon", kVF32, 1e-5f);
  if (s.shared_kv_layers > 0) b.add_u32(arch + ".attention.shared_kv_layers", s.shared_kv_layers);
  b.add_tensor("token_embd.weight",
               {static_cast<uint64_t>(s.n_embd), static_cast<uint64_t>(s.n_vocab)}, 0,
               f32_tensor(w.embd));
  b.add_tensor("output_norm.weight", {static_cast<uint64_t>(s.n_embd)}, 0, f32_tensor(w.out_norm));
  auto mat = [&](const std::string& name, size_t n_in, size_t n_out, double scale) {
    auto v = random_vec(rng, n_in * n_out, scale);
    b.add_tensor(name, {n_in, n_out}, 0, f32_tensor(v));
    return v;
  };
  auto vec = [&](const std::string& name, size_t n, double scale, double offset) {
    auto v = random_vec(rng, n, scale, offset);
    b.add_tensor(name, {n}, 0, f32_tensor(v));
    return v;
  };
  for (int l = 0; l < s.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    SyntheticWeights::Layer L;
    L.attn_norm = vec(p + "attn_norm.weight", s.n_embd, 0.1, 1.0);
    L.wq = mat(p + "attn_q.weight", s.n_embd, q_dim, 2 * ws);
    L.wk = mat(p + "attn_k.weight", s.n_embd, kv_dim, 2 * ws);
    L.wv = mat(p + "attn_v.weight", s.n_embd, kv_dim, ws);
    L.wo = mat(p + "attn_output.weight", q_dim, s.n_embd, ws);
    if (s.neox) {
      L.bq = vec(p + "attn_q.bias", q_dim, 0.1, 0);
      L.bk = vec(p + "attn_k.bias", kv_dim, 0.1, 0);
      L.bv = vec(p + "attn_v.bias", kv_dim, 0.1, 0);
    }
    L.ffn_norm = vec(p + "ffn_norm.weight", s.n_embd, 0.1, 1.0);
    L.gate = mat(p + "ffn_gate.weight", s.n_embd, s.n_ff, ws);
    L.up = mat(p + "ffn_up.weight", s.n_embd, s.n_ff, ws);
    L.down =
        mat(p + "ffn_down.weight", s.n_ff, s.n_embd, 1.0 / std::sqrt(static_cast<double>(s.n_ff)));
    w.layers.push_back(std::move(L));
  }
  const Bytes img = b.build();
  char tmpl[] = "/tmp/kvstack_synth_XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd >= 0) {
    const ssize_t n = ::write(fd, img.data(), img.size());
    (void)n;
    ::close(fd);
  }
  w.path = tmpl;
  return w;
}

// Rounds a value as the KV cache's dtype stores it.
inline double kv_round(double x, KvDtype t) {
  const auto f = static_cast<float>(x);
  switch (t) {
    case KvDtype::kF32:
      return f;
    case KvDtype::kF16:
      return f16_to_f32(f32_to_f16(f));
    case KvDtype::kBF16:
      return bf16_to_f32(f32_to_bf16(f));
    default:
      break;  // quantized formats: see forward_quant_test.cpp
  }
  return f;
}

// Logits [n_vocab] of the last token of `tokens`, recomputing everything in
// float64 with no cache; K/V are rounded to `kv_dtype` before attention, as
// the cache stores them.
// Replaces the K and V rows ([n_kv_heads * head_dim] each, after RoPE) of
// position `pos` in layer `layer` by what the cache stores for them.
using KvRowHook =
    std::function<void(int layer, int pos, std::vector<double>& k, std::vector<double>& v)>;

// Logits [n_vocab] of the last token of `tokens`, recomputing everything in
// float64 with no cache; K/V rows pass through `store` before attention
// (quantized formats: forward_quant_test.cpp decodes the cache's codes).
inline std::vector<double> reference_last_logits(const SyntheticWeights& w,
                                                 const std::vector<int32_t>& tokens,
                                                 const KvRowHook& store);

inline std::vector<double> reference_last_logits(const SyntheticWeights& w,
                                                 const std::vector<int32_t>& tokens,
                                                 KvDtype kv_dtype) {
  return reference_last_logits(
      w, tokens, [kv_dtype](int, int, std::vector<double>& k, std::vector<double>& v) {
        for (double& x : k) x = kv_round(x, kv_dtype);
        for (double& x : v) x = kv_round(x, kv_dtype);
      });
}

// Retention references (forward_retention_test.cpp): visible(layer, t, j)
// says whether query position t attends to key position j <= t (on top of
// the layer's window); rope_pos(t) is the position RoPE rotates token t's q
// and k by (the token index unless given).
using KeyVisible = std::function<bool(int layer, int t, int j)>;
using RopePosition = std::function<int(int t)>;
inline std::vector<double> reference_last_logits(const SyntheticWeights& w,
                                                 const std::vector<int32_t>& tokens,
                                                 const KvRowHook& store, const KeyVisible& visible,
                                                 const RopePosition& rope_pos = {});

inline std::vector<double> reference_last_logits(const SyntheticWeights& w,
                                                 const std::vector<int32_t>& tokens,
                                                 const KvRowHook& store) {
  return reference_last_logits(w, tokens, store, KeyVisible{});
}

inline std::vector<double> reference_last_logits(const SyntheticWeights& w,
                                                 const std::vector<int32_t>& tokens,
                                                 const KvRowHook& store, const KeyVisible& visible,
                                                 const RopePosition& rope_pos) {
  const SyntheticSpec& s = w.spec;
  const int hd = s.head_dim();
  const int n = static_cast<int>(tokens.size());
  const int q_dim = s.n_heads * hd, kv_dim = s.n_kv_heads * hd;
  std::vector<std::vector<double>> x(n, std::vector<double>(s.n_embd));
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < s.n_embd; ++i)
      x[t][i] = w.embd[static_cast<size_t>(tokens[t]) * s.n_embd + i];
  }
  auto norm = [&](const std::vector<double>& v, const std::vector<double>& g) {
    double ss = 0;
    for (double a : v) ss += a * a;
    const double sc = 1.0 / std::sqrt(ss / static_cast<double>(v.size()) + 1e-5);
    std::vector<double> o(v.size());
    for (size_t i = 0; i < v.size(); ++i) o[i] = v[i] * sc * g[i];
    return o;
  };
  auto matvec = [](const std::vector<double>& W, const std::vector<double>& v, size_t n_out) {
    std::vector<double> o(n_out, 0.0);
    const size_t n_in = v.size();
    for (size_t r = 0; r < n_out; ++r) {
      double acc = 0;
      for (size_t i = 0; i < n_in; ++i) acc += W[r * n_in + i] * v[i];
      o[r] = acc;
    }
    return o;
  };
  auto rope = [&](std::vector<double>& v, int n_h, int pos) {
    for (int h = 0; h < n_h; ++h) {
      for (int i = 0; i < hd / 2; ++i) {
        const double theta = pos * std::pow(static_cast<double>(s.rope_base), -2.0 * i / hd);
        const int a = s.neox ? h * hd + i : h * hd + 2 * i;
        const int b2 = s.neox ? h * hd + i + hd / 2 : h * hd + 2 * i + 1;
        const double x0 = v[a], x1 = v[b2];
        v[a] = x0 * std::cos(theta) - x1 * std::sin(theta);
        v[b2] = x0 * std::sin(theta) + x1 * std::cos(theta);
      }
    }
  };
  int layer_index = -1;
  // Every layer's K/V rows as stored: a shared layer (s.kv_source(l) != l)
  // computes none and attends over its source's.
  std::vector<std::vector<std::vector<double>>> layer_k(w.layers.size()), layer_v(w.layers.size());
  for (const auto& L : w.layers) {
    ++layer_index;
    const int src = s.kv_source(layer_index);
    std::vector<std::vector<double>> q(n);
    std::vector<std::vector<double>>& k = layer_k[static_cast<size_t>(layer_index)];
    std::vector<std::vector<double>>& v = layer_v[static_cast<size_t>(layer_index)];
    k.resize(n), v.resize(n);
    for (int t = 0; t < n; ++t) {
      const auto h = norm(x[t], L.attn_norm);
      q[t] = matvec(L.wq, h, q_dim);
      if (!L.bq.empty()) {
        for (int i = 0; i < q_dim; ++i) q[t][i] += L.bq[i];
      }
      const int rp = rope_pos ? rope_pos(t) : t;
      rope(q[t], s.n_heads, rp);
      if (src != layer_index) {
        k[t] = layer_k[static_cast<size_t>(src)][t];
        v[t] = layer_v[static_cast<size_t>(src)][t];
        continue;
      }
      k[t] = matvec(L.wk, h, kv_dim);
      v[t] = matvec(L.wv, h, kv_dim);
      if (!L.bq.empty()) {
        for (int i = 0; i < kv_dim; ++i) k[t][i] += L.bk[i], v[t][i] += L.bv[i];
      }
      rope(k[t], s.n_kv_heads, rp);
      store(layer_index, t, k[t], v[t]);
    }
    for (int t = 0; t < n; ++t) {
      std::vector<double> att(q_dim, 0.0);
      for (int h = 0; h < s.n_heads; ++h) {
        const int kvh = h / (s.n_heads / s.n_kv_heads);
        std::vector<double> sc(t + 1);
        double mx = -1e300;
        const int w_l = s.window(layer_index);
        const int j0 = w_l > 0 ? std::max(0, t - w_l + 1) : 0;  // first visible key
        for (int j = 0; j < j0; ++j) sc[j] = -1e300;
        for (int j = j0; j <= t; ++j) {
          if (visible && !visible(layer_index, t, j)) {
            sc[j] = -1e300;
            continue;
          }
          double d = 0;
          for (int i = 0; i < hd; ++i) d += q[t][h * hd + i] * k[j][kvh * hd + i];
          sc[j] = d / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, sc[j]);
        }
        double sum = 0;
        for (double& e : sc) sum += (e = e <= -1e300 ? 0.0 : std::exp(e - mx));
        for (int j = 0; j <= t; ++j) {
          for (int i = 0; i < hd; ++i) att[h * hd + i] += sc[j] / sum * v[j][kvh * hd + i];
        }
      }
      const auto o = matvec(L.wo, att, s.n_embd);
      for (int i = 0; i < s.n_embd; ++i) x[t][i] += o[i];
      const auto h2 = norm(x[t], L.ffn_norm);
      const auto g = matvec(L.gate, h2, s.n_ff);
      const auto u = matvec(L.up, h2, s.n_ff);
      std::vector<double> a(s.n_ff);
      for (int i = 0; i < s.n_ff; ++i) a[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
      const auto d = matvec(L.down, a, s.n_embd);
      for (int i = 0; i < s.n_embd; ++i) x[t][i] += d[i];
    }
  }
  const auto h = norm(x[n - 1], w.out_norm);
  return matvec(w.embd, h, s.n_vocab);
}

}  // namespace kvstack::testing
