#include "attention/mla_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kv/kv_codec.h"

namespace kvstack {

Status mla_attention(const PagedKvLayerView& view, const MlaAttnParams& p,
                     std::span<const AttnSeq> seqs, ThreadPool* pool) {
  const int d = p.latent_dim + p.rope_dim;
  if (view.v != nullptr || view.n_kv_heads != 1 || view.head_dim != d || p.n_heads < 1 ||
      p.latent_dim < 1) {
    return make_error(Errc::kInvalidArgument,
                      "mla_attention: the view is not an MLA latent layer of " + std::to_string(d) +
                          " elements per token");
  }
  if (kv_dtype_is_quantized(view.dtype)) {
    return make_error(Errc::kUnsupported, std::string("mla_attention: latent dtype ") +
                                              kv_dtype_name(view.dtype) +
                                              " is not supported (f32, f16, bf16)");
  }
  // Work items: (sequence, query row).
  std::vector<std::pair<int32_t, int32_t>> items;
  for (size_t s = 0; s < seqs.size(); ++s) {
    for (int32_t r = 0; r < seqs[s].n_new; ++r) items.emplace_back(static_cast<int32_t>(s), r);
  }
  const int H = p.n_heads, dc = p.latent_dim;
  auto run = [&](int64_t begin, int64_t end) {
    std::vector<float> row(static_cast<size_t>(d)), acc(static_cast<size_t>(H) * dc);
    std::vector<float> m(static_cast<size_t>(H)), l(static_cast<size_t>(H));
    for (int64_t it = begin; it < end; ++it) {
      const AttnSeq& s = seqs[static_cast<size_t>(items[static_cast<size_t>(it)].first)];
      const int32_t r = items[static_cast<size_t>(it)].second;
      const float* q = s.q + static_cast<int64_t>(r) * H * d;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.0f);
      const int32_t n_keys = s.n_past + r + 1;
      for (int32_t j = 0; j < n_keys; ++j) {
        const int32_t blk = s.block_table[j / view.block_size];
        const uint8_t* src = view.k + static_cast<int64_t>(blk) * view.block_stride +
                             static_cast<int64_t>(j % view.block_size) * view.slot_stride;
        kv_decode_row(view.dtype, src, nullptr, d, row.data());
        for (int h = 0; h < H; ++h) {
          const float* qh = q + static_cast<int64_t>(h) * d;
          float dot = 0.0f;
          for (int i = 0; i < d; ++i) dot += qh[i] * row[static_cast<size_t>(i)];
          const float sc = dot * p.scale;
          float* a = acc.data() + static_cast<size_t>(h) * dc;
          // Online softmax: rescale the running sum when the max grows.
          if (sc > m[static_cast<size_t>(h)]) {
            const float f = std::exp(m[static_cast<size_t>(h)] - sc);
            l[static_cast<size_t>(h)] *= f;
            for (int i = 0; i < dc; ++i) a[i] *= f;
            m[static_cast<size_t>(h)] = sc;
          }
          const float w = std::exp(sc - m[static_cast<size_t>(h)]);
          l[static_cast<size_t>(h)] += w;
          for (int i = 0; i < dc; ++i) a[i] += w * row[static_cast<size_t>(i)];
        }
      }
      float* out = s.out + static_cast<int64_t>(r) * H * dc;
      for (int h = 0; h < H; ++h) {
        const float inv = 1.0f / l[static_cast<size_t>(h)];
        for (int i = 0; i < dc; ++i) {
          out[static_cast<int64_t>(h) * dc + i] = acc[static_cast<size_t>(h) * dc + i] * inv;
        }
      }
    }
  };
  const auto n = static_cast<int64_t>(items.size());
  if (pool != nullptr && n > 1) {
    pool->parallel_for(n, 1, run);
  } else {
    run(0, n);
  }
  return {};
}

}  // namespace kvstack
