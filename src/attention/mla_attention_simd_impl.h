// The MLA latent tile functions (mla_attention_kernels.h) once, as templates
// over an ISA traits struct I (mla_attention_simd.cpp: Avx2Ops, Avx512Ops):
//   I::V, I::W             the float vector type and its lanes (8, 16)
//   zero, load, store, set1, fma, mul, reduce_add (I's own horizontal order)
//   load_f16, load_bf16, load_i8 (W stored elements -> W floats)
//   store_f16              W floats -> W f16, round to nearest even
//   kAccVecs, kGemmVecs    vectors of columns per accum / gemm register block
// Deliberately without an include guard: mla_attention_simd.cpp includes it
// once per ISA, each time inside its own namespace and with MLA_TARGET
// defined as that ISA's target attribute, so every instantiation is compiled
// for its own instruction set and the two copies are distinct entities (no
// ODR clash). Not for any other use.
//
// Needs, from the including namespace: kMlaTile, kMlaGemmCols, KvDtype,
// decode_one(), int8_row_scale().

// buf[j][0 .. dpad) = decoded row j, zero past d (the fused dequant).
template <class I>
MLA_TARGET void decode(KvDtype dt, const uint8_t* const* rows, const uint8_t* const* metas, int n,
                       int d, int dpad, float* buf) {
  constexpr int W = I::W;
  const int dv = d / W * W;
  for (int j = 0; j < n; ++j) {
    const uint8_t* r = rows[j];
    float* o = buf + static_cast<int64_t>(j) * dpad;
    const float sc = int8_row_scale(dt, metas[j]);
    int i = 0;
    switch (dt) {
      case KvDtype::kF32:
        for (; i < dv; i += W) I::store(o + i, I::load(reinterpret_cast<const float*>(r) + i));
        break;
      case KvDtype::kF16:
        for (; i < dv; i += W) I::store(o + i, I::load_f16(r + 2 * static_cast<int64_t>(i)));
        break;
      case KvDtype::kBF16:
        for (; i < dv; i += W) I::store(o + i, I::load_bf16(r + 2 * static_cast<int64_t>(i)));
        break;
      case KvDtype::kInt8: {
        const typename I::V sv = I::set1(sc);
        for (; i < dv; i += W) I::store(o + i, I::mul(sv, I::load_i8(r + i)));
        break;
      }
      default:
        break;
    }
    for (; i < d; ++i) o[i] = decode_one(dt, r, i, sc);
    for (; i < dpad; ++i) o[i] = 0.0f;
  }
}

// HB heads x KB keys of scores; each loaded key vector feeds HB heads.
template <class I, int HB, int KB>
MLA_TARGET inline void scores_block(const float* q, const float* buf, int dpad, float scale,
                                    float* s) {
  typename I::V acc[HB][KB];
  for (int a = 0; a < HB; ++a) {
    for (int b = 0; b < KB; ++b) acc[a][b] = I::zero();
  }
  for (int i = 0; i < dpad; i += I::W) {
    typename I::V kv[KB];
    for (int b = 0; b < KB; ++b) kv[b] = I::load(buf + static_cast<int64_t>(b) * dpad + i);
    for (int a = 0; a < HB; ++a) {
      const typename I::V qv = I::load(q + static_cast<int64_t>(a) * dpad + i);
      for (int b = 0; b < KB; ++b) acc[a][b] = I::fma(qv, kv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < HB; ++a) {
    for (int b = 0; b < KB; ++b) s[a * kMlaTile + b] = scale * I::reduce_add(acc[a][b]);
  }
}

template <class I, int HB>
MLA_TARGET inline void scores_heads(const float* qh, const float* buf, int n, int dpad, float scale,
                                    float* sh) {
  int j = 0;
  for (; j + 4 <= n; j += 4)
    scores_block<I, HB, 4>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
  for (; j < n; ++j)
    scores_block<I, HB, 1>(qh, buf + static_cast<int64_t>(j) * dpad, dpad, scale, sh + j);
}

template <class I>
MLA_TARGET void scores(const float* q, const float* buf, int H, int n, int dpad, float scale,
                       float* s) {
  int h = 0;
  for (; h + 2 <= H; h += 2) {
    scores_heads<I, 2>(q + static_cast<int64_t>(h) * dpad, buf, n, dpad, scale,
                       s + static_cast<int64_t>(h) * kMlaTile);
  }
  for (; h < H; ++h) {
    scores_heads<I, 1>(q + static_cast<int64_t>(h) * dpad, buf, n, dpad, scale,
                       s + static_cast<int64_t>(h) * kMlaTile);
  }
}

// HB heads x IC vectors of columns starting at column i, in registers over
// the tile.
template <class I, int HB, int IC>
MLA_TARGET inline void accum_block(const float* w, const float* buf, int n, int dpad, int dcpad,
                                   const float* f, float* acc, int i) {
  constexpr int W = I::W;
  typename I::V a[HB][IC];
  for (int x = 0; x < HB; ++x) {
    const typename I::V fv = I::set1(f[x]);
    for (int c = 0; c < IC; ++c) {
      a[x][c] = I::mul(fv, I::load(acc + static_cast<int64_t>(x) * dcpad + i + W * c));
    }
  }
  for (int j = 0; j < n; ++j) {
    typename I::V cv[IC];
    for (int c = 0; c < IC; ++c) cv[c] = I::load(buf + static_cast<int64_t>(j) * dpad + i + W * c);
    for (int x = 0; x < HB; ++x) {
      const typename I::V wv = I::set1(w[x * kMlaTile + j]);
      for (int c = 0; c < IC; ++c) a[x][c] = I::fma(wv, cv[c], a[x][c]);
    }
  }
  for (int x = 0; x < HB; ++x) {
    for (int c = 0; c < IC; ++c)
      I::store(acc + static_cast<int64_t>(x) * dcpad + i + W * c, a[x][c]);
  }
}

template <class I, int HB>
MLA_TARGET inline void accum_heads(const float* w, const float* buf, int n, int dpad, int dcpad,
                                   const float* f, float* acc) {
  constexpr int kCols = I::kAccVecs * I::W;
  int i = 0;
  for (; i + kCols <= dcpad; i += kCols) {
    accum_block<I, HB, I::kAccVecs>(w, buf, n, dpad, dcpad, f, acc, i);
  }
  for (; i < dcpad; i += I::W) accum_block<I, HB, 1>(w, buf, n, dpad, dcpad, f, acc, i);
}

template <class I>
MLA_TARGET void accum(const float* w, const float* buf, int H, int n, int dpad, int dcpad,
                      const float* f, float* acc) {
  int h = 0;
  for (; h + 4 <= H; h += 4) {
    accum_heads<I, 4>(w + h * kMlaTile, buf, n, dpad, dcpad, f + h,
                      acc + static_cast<int64_t>(h) * dcpad);
  }
  for (; h < H; ++h) {
    accum_heads<I, 1>(w + h * kMlaTile, buf, n, dpad, dcpad, f + h,
                      acc + static_cast<int64_t>(h) * dcpad);
  }
}

// TB rows x kGemmVecs vectors of columns from column o, over the whole k.
template <class I, int TB>
MLA_TARGET inline void gemm_block(const float* c, int k, const float* wt, int ldw, float* out,
                                  int o) {
  constexpr int W = I::W, NV = I::kGemmVecs;
  typename I::V a[TB][NV];
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < NV; ++v) a[t][v] = I::zero();
  }
  for (int i = 0; i < k; ++i) {
    const float* w = wt + static_cast<int64_t>(i) * ldw + o;
    typename I::V wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = I::load(w + W * v);
    for (int t = 0; t < TB; ++t) {
      const typename I::V cv = I::set1(c[static_cast<int64_t>(t) * k + i]);
      for (int v = 0; v < NV; ++v) a[t][v] = I::fma(cv, wv[v], a[t][v]);
    }
  }
  for (int t = 0; t < TB; ++t) {
    for (int v = 0; v < NV; ++v) I::store(out + static_cast<int64_t>(t) * ldw + o + W * v, a[t][v]);
  }
}

template <class I>
MLA_TARGET void gemm(const float* c, int m, int k, const float* wt, int ldw, int o0, int o1,
                     float* out) {
  constexpr int kStep = I::kGemmVecs * I::W;
  static_assert(kMlaGemmCols % kStep == 0);
  for (int ob = o0; ob < o1; ob += kMlaGemmCols) {
    for (int o = ob; o < ob + kMlaGemmCols; o += kStep) {
      int t = 0;
      for (; t + 6 <= m; t += 6) {
        gemm_block<I, 6>(c + static_cast<int64_t>(t) * k, k, wt, ldw,
                         out + static_cast<int64_t>(t) * ldw, o);
      }
      for (; t < m; ++t) {
        gemm_block<I, 1>(c + static_cast<int64_t>(t) * k, k, wt, ldw,
                         out + static_cast<int64_t>(t) * ldw, o);
      }
    }
  }
}

template <class I>
MLA_TARGET void to_f16(const float* x, int n, uint16_t* out) {
  int i = 0;
  for (; i + I::W <= n; i += I::W) I::store_f16(out + i, I::load(x + i));
  for (; i < n; ++i) out[i] = f32_to_f16(x[i]);
}
