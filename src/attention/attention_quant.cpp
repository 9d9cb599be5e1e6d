// Validation and entry points of paged_attention_quant() (planning, threads
// and kernels are shared with the float path: attention_kernels.h); its
// double-precision reference.
#include "attention/attention_quant.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention/attention_kernels.h"
#include "kv/kv_codec.h"

namespace kvstack {
namespace {

using attn_detail::first_visible;
using attn_detail::HeadStream;
using attn_detail::TileArgs;

Error bad(const std::string& what) {
  return make_error(Errc::kInvalidArgument, "paged_attention: " + what);
}

}  // namespace

Status validate_quant_attention_args(const PagedKvLayerView& kv, const AttnParams& p,
                                     std::span<const AttnSeq> seqs) {
  for (int which = 0; which < 2; ++which) {
    const KvDtype t = which == 0 ? kv.dtype : kv.value_dtype();
    const char* name = which == 0 ? "K" : "V";
    if (static_cast<uint8_t>(t) > static_cast<uint8_t>(KvDtype::kInt4)) {
      return bad(std::string(name) + " dtype " + std::to_string(static_cast<int>(t)) +
                 " is unknown");
    }
    auto geo = kv_row_geometry(t, kv.head_dim);
    if (!geo) return bad(std::string(name) + ": " + geo.error().message);
    const bool has_meta = (which == 0 ? kv.k_meta : kv.v_meta) != nullptr;
    if (kv_dtype_is_quantized(t) && !has_meta) {
      return bad(std::string(name) + " dtype " + kv_dtype_name(t) + " needs a metadata pointer");
    }
  }
  // The remaining checks do not depend on the element format.
  PagedKvLayerView plain = kv;
  plain.dtype = KvDtype::kF16;
  plain.v_distinct = false;
  return validate_attention_args(plain, p, seqs);
}

void round_query_int8(const float* qs, int d, int8_t* codes, float* group_scale) {
  for (int g = 0; g * kQueryGroup < d; ++g) {
    const float* x = qs + g * kQueryGroup;
    float amax = 0.0f;
    bool finite = true;  // std::max would skip a NaN
    for (int i = 0; i < kQueryGroup; ++i) {
      finite = finite && std::isfinite(x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    int8_t* c = codes + g * kQueryGroup;
    if (!finite) {
      group_scale[g] = std::numeric_limits<float>::quiet_NaN();
      std::fill(c, c + kQueryGroup, int8_t{0});
      continue;
    }
    group_scale[g] = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < kQueryGroup; ++i) {
      const float r = std::nearbyint(x[i] * inv);
      c[i] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
    }
  }
}

Status paged_attention_quant_isa(Isa isa, const PagedKvLayerView& kv, const AttnParams& p,
                                 std::span<const AttnSeq> seqs, ThreadPool* pool) {
  KV_TRY_STATUS(validate_quant_attention_args(kv, p, seqs));
  attn_detail::run_attention(
      attn_detail::select_kernels(isa, kv.dtype, kv.value_dtype(), p.head_dim), kv, p, seqs, pool);
  return {};
}

Status paged_attention_quant(const PagedKvLayerView& kv, const AttnParams& p,
                             std::span<const AttnSeq> seqs, ThreadPool* pool) {
  return paged_attention_quant_isa(best_isa(), kv, p, seqs, pool);
}

Status paged_attention_quant_reference(const PagedKvLayerView& kv, const AttnParams& p,
                                       std::span<const AttnSeq> seqs,
                                       const QuantReferenceOptions& opt) {
  KV_TRY_STATUS(validate_quant_attention_args(kv, p, seqs));
  const int g = p.n_q_heads / p.n_kv_heads;
  const int d = p.head_dim;
  std::vector<double> scores;
  std::vector<double> acc(d);
  std::vector<float> row(d);
  std::vector<double> qd(d);  // the query the scores use (times the scale)
  std::vector<float> qs(d);
  std::vector<int8_t> codes(d);
  std::vector<float> gscale(d / kQueryGroup + 1);
  TileArgs a;  // addressing only
  a.block_stride = kv.block_stride;
  a.block_size = kv.block_size;
  for (const AttnSeq& s : seqs) {
    a.block_table = s.block_table;
    for (int32_t r = 0; r < s.n_new; ++r) {
      const int32_t pos = s.n_past + r;
      const int32_t lo = first_visible(pos, p.window);
      scores.assign(pos + 1 - lo, 0.0);
      for (int h = 0; h < p.n_q_heads; ++h) {
        const HeadStream ks = attn_detail::k_stream(kv, h / g);
        const HeadStream vs = attn_detail::v_stream(kv, h / g);
        const float* q = s.q + (int64_t{r} * p.n_q_heads + h) * d;
        const bool round =
            kv.dtype == KvDtype::kInt4 || (kv.dtype == KvDtype::kInt8 && opt.round_int8_query);
        if (s.n_new == 1 && round) {  // q^: round_query_int8
          for (int i = 0; i < d; ++i) qs[i] = q[i] * p.scale;
          round_query_int8(qs.data(), d, codes.data(), gscale.data());
          for (int i = 0; i < d; ++i) qd[i] = double{gscale[i / kQueryGroup]} * codes[i];
        } else {
          for (int i = 0; i < d; ++i) qd[i] = double{q[i]} * p.scale;
        }
        double mx = -std::numeric_limits<double>::infinity();
        for (int32_t t = lo; t <= pos; ++t) {
          kv_decode_row(ks.dtype, attn_detail::stream_row(a, ks, t),
                        attn_detail::stream_meta(a, ks, t), d, row.data());
          double dot = 0.0;
          for (int i = 0; i < d; ++i) dot += qd[i] * row[i];
          scores[t - lo] = dot;
          mx = std::max(mx, scores[t - lo]);
        }
        double sum = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int32_t t = lo; t <= pos; ++t) {
          const double w = std::exp(scores[t - lo] - mx);
          sum += w;
          kv_decode_row(vs.dtype, attn_detail::stream_row(a, vs, t),
                        attn_detail::stream_meta(a, vs, t), d, row.data());
          for (int i = 0; i < d; ++i) acc[i] += w * row[i];
        }
        float* out = s.out + (int64_t{r} * p.n_q_heads + h) * d;
        for (int i = 0; i < d; ++i) out[i] = static_cast<float>(acc[i] / sum);
        if (s.key_mass != nullptr) {
          for (int32_t t = lo; t <= pos; ++t) {
            s.key_mass[t] += static_cast<float>(std::exp(scores[t - lo] - mx) / sum);
          }
        }
      }
    }
  }
  return {};
}

}  // namespace kvstack
