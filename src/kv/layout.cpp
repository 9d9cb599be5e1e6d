#include "kv/layout.h"

#include <string>

#include "kv/kivi_codec.h"
#include "kv/kv_codec.h"

namespace kvstack {

const char* kv_dtype_name(KvDtype t) {
  switch (t) {
    case KvDtype::kF32:
      return "f32";
    case KvDtype::kF16:
      return "f16";
    case KvDtype::kBF16:
      return "bf16";
    case KvDtype::kFp8:
      return "fp8";
    case KvDtype::kInt8:
      return "int8";
    case KvDtype::kInt4:
      return "int4";
    case KvDtype::kKivi2:
      return "kivi2";
    case KvDtype::kKivi4:
      return "kivi4";
  }
  return "unknown";
}

Result<KvDtype> parse_kv_dtype(std::string_view name) {
  if (name == "f32") return KvDtype::kF32;
  if (name == "f16") return KvDtype::kF16;
  if (name == "bf16") return KvDtype::kBF16;
  if (name == "fp8") return KvDtype::kFp8;
  if (name == "int8") return KvDtype::kInt8;
  if (name == "int4") return KvDtype::kInt4;
  if (name == "kivi2") return kKvDtypeKivi2;
  if (name == "kivi4") return kKvDtypeKivi4;
  return make_error(Errc::kInvalidArgument,
                    "unknown KV dtype '" + std::string(name) +
                        "' (expected f32, f16, bf16, fp8, int8, int4, kivi2 or kivi4)");
}

namespace {

constexpr int kMaxHeads = 1 << 12;
constexpr int kMaxDim = 1 << 16;
constexpr int kMaxLayers = 1 << 12;

int64_t align_up(int64_t x, int64_t a) {
  return (x + a - 1) / a * a;
}

bool valid_dtype(KvDtype t) {
  return static_cast<uint8_t>(t) <= static_cast<uint8_t>(KvDtype::kInt4) || kv_dtype_is_kivi(t);
}

Error layer_error(Errc code, int l, const std::string& what) {
  return make_error(code, "KV layout: layer " + std::to_string(l) + ": " + what);
}

}  // namespace

Result<KvLayout> KvLayout::create(std::vector<KvLayerSpec> layers, int block_size,
                                  KvLayoutOptions options) {
  if (block_size < 1 || block_size > kMaxBlockSize || (block_size & (block_size - 1)) != 0) {
    return make_error(Errc::kInvalidArgument, "KV layout: block size " +
                                                  std::to_string(block_size) +
                                                  " must be a power of two in [1, 256]");
  }
  if (layers.empty() || static_cast<int64_t>(layers.size()) > kMaxLayers) {
    return make_error(
        Errc::kInvalidArgument,
        "KV layout: layer count " + std::to_string(layers.size()) + " must be in [1, 4096]");
  }
  KvLayout out;
  out.block_size_ = block_size;
  for (const KvLayerSpec& s : layers) {
    if (kv_dtype_is_kivi(s.dtype) || kv_dtype_is_kivi(s.value_dtype())) {
      out.kivi_group_ = kivi_group_size(block_size);
    }
  }
  if (out.kivi_group_ > 0) {
    if (options.kivi_residual < 0 || options.kivi_residual % out.kivi_group_ != 0 ||
        options.kivi_residual > (1 << 20)) {
      return make_error(Errc::kInvalidArgument,
                        "KV layout: KIVI residual " + std::to_string(options.kivi_residual) +
                            " must be a multiple of the key group size G = " +
                            std::to_string(out.kivi_group_) + " in [0, 1048576]");
    }
    out.kivi_residual_ = options.kivi_residual;
  }
  int64_t offset = 0;
  for (int l = 0; l < static_cast<int>(layers.size()); ++l) {
    const KvLayerSpec& s = layers[l];
    if (!valid_dtype(s.dtype) || !valid_dtype(s.value_dtype())) {
      return layer_error(Errc::kInvalidArgument, l, "invalid dtype");
    }
    if (s.window < 0) {
      return layer_error(Errc::kInvalidArgument, l,
                         "window " + std::to_string(s.window) + " must be >= 0 (0 = full)");
    }
    KvLayerPlacement p;
    int64_t payload = 0;
    if (s.kind == KvLayerKind::kStandard) {
      if (s.n_kv_heads < 1 || s.n_kv_heads > kMaxHeads) {
        return layer_error(Errc::kInvalidArgument, l,
                           "n_kv_heads " + std::to_string(s.n_kv_heads) + " must be in [1, 4096]");
      }
      if (s.head_dim_k < 1 || s.head_dim_k > kMaxDim || s.head_dim_v < 1 ||
          s.head_dim_v > kMaxDim) {
        return layer_error(Errc::kInvalidArgument, l,
                           "head dims k=" + std::to_string(s.head_dim_k) +
                               " v=" + std::to_string(s.head_dim_v) + " must be in [1, 65536]");
      }
      if (s.head_dim_k != s.head_dim_v) {
        return layer_error(Errc::kUnsupported, l,
                           "head_dim_k " + std::to_string(s.head_dim_k) + " != head_dim_v " +
                               std::to_string(s.head_dim_v) + " is not supported yet");
      }
      if (s.latent_dim != 0 || s.rope_dim != 0) {
        return layer_error(Errc::kInvalidArgument, l,
                           "latent_dim/rope_dim are only for MLA layers");
      }
      auto gk = kv_dtype_is_kivi(s.dtype) ? kivi_key_geometry(s.dtype, s.head_dim_k, block_size)
                                          : kv_row_geometry(s.dtype, s.head_dim_k);
      if (!gk) return layer_error(Errc::kUnsupported, l, "K: " + gk.error().message);
      auto gv = kv_dtype_is_kivi(s.value_dtype())
                    ? kivi_value_geometry(s.value_dtype(), s.head_dim_v)
                    : kv_row_geometry(s.value_dtype(), s.head_dim_v);
      if (!gv) return layer_error(Errc::kUnsupported, l, "V: " + gv.error().message);
      // Per KV head: its P K rows, then its P V rows (see layout.h).
      const int64_t h = s.n_kv_heads;
      p.slot_stride = gk->row_bytes;
      p.v_slot_stride = gv->row_bytes;
      const int64_t k_tile = p.slot_stride * block_size;
      const int64_t v_tile = p.v_slot_stride * block_size;
      p.head_stride = p.v_head_stride = k_tile + v_tile;
      p.k_bytes = k_tile * h;
      p.v_bytes = v_tile * h;
      p.k_offset = offset;
      p.v_offset = offset + k_tile;
      // Same padded size as separate K and V regions would take, so the
      // planner's block_bytes formula is unchanged.
      int64_t end = offset + align_up(p.k_bytes, kAlign) + align_up(p.v_bytes, kAlign);
      p.k_meta_slot_stride = gk->meta_row_bytes;
      p.k_meta_block_bytes = gk->meta_block_bytes;
      p.k_meta_head_stride = gk->meta_row_bytes * block_size + gk->meta_block_bytes;
      if (p.k_meta_head_stride > 0) {
        p.k_meta_offset = end;
        end += align_up(p.k_meta_head_stride * h, kAlign);
      }
      p.v_meta_slot_stride = gv->meta_row_bytes;
      p.v_meta_block_bytes = gv->meta_block_bytes;
      p.v_meta_head_stride = gv->meta_row_bytes * block_size + gv->meta_block_bytes;
      if (p.v_meta_head_stride > 0) {
        p.v_meta_offset = end;
        end += align_up(p.v_meta_head_stride * h, kAlign);
      }
      p.end_offset = end;
      payload = h * (gk->row_bytes + gk->meta_row_bytes + gv->row_bytes + gv->meta_row_bytes);
      out.block_meta_bytes_ += h * (gk->meta_block_bytes + gv->meta_block_bytes);
    } else if (s.kind == KvLayerKind::kMlaLatent) {
      if (s.latent_dim < 1 || s.latent_dim > kMaxDim || s.rope_dim < 0 || s.rope_dim > kMaxDim) {
        return layer_error(Errc::kInvalidArgument, l,
                           "MLA latent_dim " + std::to_string(s.latent_dim) + " / rope_dim " +
                               std::to_string(s.rope_dim) + " must be in [1, 65536] / [0, 65536]");
      }
      if (s.n_kv_heads != 0 || s.head_dim_k != 0 || s.head_dim_v != 0) {
        return layer_error(Errc::kInvalidArgument, l,
                           "MLA layers take latent_dim/rope_dim, not n_kv_heads/head_dim");
      }
      if ((kv_dtype_is_quantized(s.dtype) && s.dtype != KvDtype::kInt8) || s.dtype_v.has_value()) {
        return layer_error(Errc::kUnsupported, l,
                           "MLA latent layers support only f32/f16/bf16/int8 and no V dtype");
      }
      // int8: d codes per row, then (after the codes region) one f16 scale
      // per row, as a standard int8 K head (kv_codec.h).
      const int d = s.latent_dim + s.rope_dim;
      auto g = kv_row_geometry(s.dtype, d);
      if (!g) return layer_error(Errc::kUnsupported, l, "latent: " + g.error().message);
      p.slot_stride = g->row_bytes;
      p.head_stride = 0;
      p.k_bytes = p.slot_stride * block_size;
      p.v_bytes = 0;
      p.k_offset = offset;
      p.v_offset = -1;
      p.end_offset = offset + align_up(p.k_bytes, kAlign);
      if (g->meta_row_bytes > 0) {
        p.k_meta_offset = p.end_offset;
        p.k_meta_slot_stride = g->meta_row_bytes;
        p.k_meta_head_stride = g->meta_row_bytes * block_size;
        p.end_offset += align_up(p.k_meta_head_stride, kAlign);
      }
      payload = g->row_bytes + g->meta_row_bytes;
    } else {
      return layer_error(Errc::kInvalidArgument, l, "unknown layer kind");
    }
    offset = p.end_offset;
    out.payload_per_token_ += payload;
    out.placements_.push_back(p);
  }
  out.block_bytes_ = offset;  // multiple of kAlign: every region end is aligned
  out.layers_ = std::move(layers);
  return out;
}

Result<KvLayout> KvLayout::uniform(int n_layers, int n_kv_heads, int head_dim, KvDtype dtype,
                                   int block_size, std::optional<KvDtype> dtype_v,
                                   KvLayoutOptions options) {
  if (n_layers < 1 || n_layers > kMaxLayers) {
    return make_error(Errc::kInvalidArgument, "KV layout: layer count " + std::to_string(n_layers) +
                                                  " must be in [1, 4096]");
  }
  std::vector<KvLayerSpec> layers(n_layers, KvLayerSpec{.kind = KvLayerKind::kStandard,
                                                        .n_kv_heads = n_kv_heads,
                                                        .head_dim_k = head_dim,
                                                        .head_dim_v = head_dim,
                                                        .dtype = dtype,
                                                        .dtype_v = dtype_v});
  return create(std::move(layers), block_size, options);
}

int64_t KvLayout::layer_payload_bytes_per_token(int l) const {
  KV_CHECK(l >= 0 && l < n_layers(), "layer index out of range");
  const KvLayerSpec& s = layers_[l];
  const KvLayerPlacement& p = placements_[l];
  if (s.kind == KvLayerKind::kMlaLatent) return p.slot_stride + p.k_meta_slot_stride;
  return static_cast<int64_t>(s.n_kv_heads) *
         (p.slot_stride + p.k_meta_slot_stride + p.v_slot_stride + p.v_meta_slot_stride);
}

int64_t KvLayout::payload_bytes(int64_t n_tokens) const {
  const int64_t n_blocks = (n_tokens + block_size_ - 1) / block_size_;
  return n_tokens * payload_per_token_ + n_blocks * block_meta_bytes_;
}

PagedKvLayerView KvLayout::layer_view(int l, uint8_t* pool_base) const {
  KV_CHECK(l >= 0 && l < n_layers(), "layer index out of range");
  KV_CHECK(reinterpret_cast<uintptr_t>(pool_base) % kAlign == 0, "pool base not 64-byte aligned");
  const KvLayerSpec& s = layers_[l];
  const KvLayerPlacement& p = placements_[l];
  PagedKvLayerView v;
  v.k = pool_base + p.k_offset;
  v.v = p.v_offset >= 0 ? pool_base + p.v_offset : nullptr;
  v.block_stride = block_bytes_;
  v.head_stride = p.head_stride;
  v.slot_stride = p.slot_stride;
  v.dtype = s.dtype;
  v.block_size = block_size_;
  v.kivi_group = kivi_group_;
  v.v_distinct = s.value_dtype() != s.dtype;
  v.v_dtype = s.value_dtype();
  v.v_head_stride = p.v_head_stride;
  v.v_slot_stride = p.v_slot_stride;
  if (p.k_meta_offset >= 0) {
    v.k_meta = pool_base + p.k_meta_offset;
    v.k_meta_head_stride = p.k_meta_head_stride;
    v.k_meta_slot_stride = p.k_meta_slot_stride;
  }
  if (p.v_meta_offset >= 0) {
    v.v_meta = pool_base + p.v_meta_offset;
    v.v_meta_head_stride = p.v_meta_head_stride;
    v.v_meta_slot_stride = p.v_meta_slot_stride;
  }
  if (s.kind == KvLayerKind::kMlaLatent) {
    v.n_kv_heads = 1;
    v.head_dim = s.latent_dim + s.rope_dim;
  } else {
    v.n_kv_heads = s.n_kv_heads;
    v.head_dim = s.head_dim_k;
  }
  return v;
}

bool KvLayout::same_format(const KvLayout& o) const {
  if (block_size_ != o.block_size_ || block_bytes_ != o.block_bytes_ ||
      kivi_group_ != o.kivi_group_ || kivi_residual_ != o.kivi_residual_ ||
      layers_.size() != o.layers_.size()) {
    return false;
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    const KvLayerSpec& a = layers_[l];
    const KvLayerSpec& b = o.layers_[l];
    if (a.kind != b.kind || a.n_kv_heads != b.n_kv_heads || a.head_dim_k != b.head_dim_k ||
        a.head_dim_v != b.head_dim_v || a.latent_dim != b.latent_dim || a.rope_dim != b.rope_dim ||
        a.dtype != b.dtype || a.value_dtype() != b.value_dtype() || a.window != b.window) {
      return false;
    }
  }
  return true;
}

Result<KvLayout> KvLayout::padded_to(int64_t block_bytes) const {
  if (block_bytes < block_bytes_ || block_bytes % kAlign != 0) {
    return make_error(Errc::kInvalidArgument, "KV layout: cannot pad a " +
                                                  std::to_string(block_bytes_) + "-byte block to " +
                                                  std::to_string(block_bytes) + " bytes");
  }
  KvLayout out = *this;
  out.block_bytes_ = block_bytes;
  return out;
}

}  // namespace kvstack
