// The AVX-512 lanes of asym_quant_fit's (scale, min) search (kv_codec.cpp):
// its kAsymFitCandidates least-squares candidates side by side, one
// candidate per lane, each lane doing the scalar reference's float and
// double operations in the reference's order, so every lane's sums and
// errors equal the reference's bit for bit. Internal to the kv layer.
#pragma once

#include <cstdint>

namespace kvstack {

// Candidates k = -10..10 of the search, padded to three vectors of 8 lanes
// (lanes kAsymFitCandidates.. are computed and ignored).
inline constexpr int kAsymFitCandidates = 21;
inline constexpr int kAsymFitLanes = 24;

// For every lane c, over i = 0..n-1 in order, with
//   l = clamp(nearbyint(iscale[c] * (x[i] - mn)), 0, qmax)   (float)
// the double sums sl[c] = sum l, sll[c] = sum l*l, slx[c] = sum l*x[i].
// x: [n] contiguous; iscale, sl, sll, slx: [kAsymFitLanes].
// REQUIRES: 1 <= n, finite x, iscale finite, the CPU has AVX-512F/VL.
void asym_fit_sums_avx512(const float* x, int n, float mn, const float* iscale, float qmax,
                          double* sl, double* sll, double* slx);

// For every lane c < kAsymFitCandidates, asym_solve's least-squares fit of
// the lane's sums (kv_codec.cpp; sx = sum x[i] in order): bit c of the
// result is set where the fit succeeds, and then s16[c], m16[c] are its f16
// scale and min and s[c], m[c] their float values; elsewhere s[c] = 1,
// m[c] = 0 (a finite placeholder for asym_fit_errors_avx512) and s16[c],
// m16[c] are unspecified. sl, sll, slx, s16, m16, s, m: [kAsymFitLanes].
// REQUIRES: finite sums, the CPU has AVX-512F/VL and F16C.
uint32_t asym_fit_solve_avx512(int n, double sx, const double* sl, const double* sll,
                               const double* slx, uint16_t* s16, uint16_t* m16, float* s, float* m);

// For every lane c, over i = 0..n-1 in order, with
//   q = s[c] > 0 ? clamp(nearbyint((x[i] - m[c]) / s[c]), 0, qmax) : 0
//   e = double(fma(s[c], q, m[c])) - double(x[i])
// the double sum err[c] = sum e*e (asym_codes' error).
// x: [n] contiguous; s, m, err: [kAsymFitLanes]. s[c] >= 0 finite, m[c] finite.
// REQUIRES: the CPU has AVX-512F/VL and FMA.
void asym_fit_errors_avx512(const float* x, int n, const float* s, const float* m, float qmax,
                            double* err);

}  // namespace kvstack
