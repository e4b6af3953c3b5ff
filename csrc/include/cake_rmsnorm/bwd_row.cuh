/* The per-row backward shared by every backward form (pair, single, column_task).
 *
 * One row group (RowLayout L: kTPR threads) handles one row:
 *   x̂ = x·rstd, g = dy·w (FP32), c = (1/H)·Σ g·x̂ (fixed-order group_sum),
 *   dx = bf16(rstd·(g − x̂·c) + dresidual_out)
 * and hands each element's dw term (dy·x)·rstd and its TwoProduct rounding error to
 * `on_term(i, term, err)` (i = column slot of this thread,
 * 0..kCols-1: slot k*8+e is column 8*(k*kTPR + t) + e), so each form accumulates dw its own way.
 * `active` = the row exists; inactive rows still take part in the group reduction (barriers).
 */
#ifndef CAKE_RMSNORM_BWD_ROW_CUH
#define CAKE_RMSNORM_BWD_ROW_CUH

#include "cake_rmsnorm/common.cuh"

namespace cake {

template <int H, class L, class W, bool kRes, class OnTerm>
__device__ __forceinline__ void bwd_row(const bf16* __restrict__ dy, const bf16* __restrict__ x,
                                        const bf16* __restrict__ dres, const W* __restrict__ w,
                                        float rstd, bf16* __restrict__ dx, bool active, int t,
                                        float* scratch, int warp, int warp0, OnTerm&& on_term) {
  uint4 vdy[L::kVPT], vx[L::kVPT];
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    if (active && L::valid(k, t)) {
      vdy[k] = ld_vec(dy, L::vec(k, t));
      vx[k] = ld_vec(x, L::vec(k, t));
    } else {
      vdy[k] = make_uint4(0, 0, 0, 0);
      vx[k] = make_uint4(0, 0, 0, 0);
    }
  }
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    if (!(active && L::valid(k, t))) continue;
    float fdy[kVec], fx[kVec], fw[kVec];
    unpack8(vdy[k], fdy);
    unpack8(vx[k], fx);
    ld_w8(w, L::vec(k, t), fw);
#pragma unroll
    for (int e = 0; e < kVec; ++e) dot += (fdy[e] * fw[e]) * (fx[e] * rstd);
  }
  const float c = group_sum<L::kWarps>(dot, scratch, warp, warp0) / static_cast<float>(H);
  if (!active) return;
  const bool has_dres = kRes && dres != nullptr;
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    if (!L::valid(k, t)) continue;
    float fdy[kVec], fx[kVec], fw[kVec], fo[kVec];
    unpack8(vdy[k], fdy);
    unpack8(vx[k], fx);
    ld_w8(w, L::vec(k, t), fw);
    if (has_dres) {
      unpack8(ld_vec(dres, L::vec(k, t)), fo);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) fo[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float g = fdy[e] * fw[e];
      const float xh = fx[e] * rstd;
      fo[e] = rstd * (g - xh * c) + fo[e];
      const float term = dw_term(fdy[e], fx[e], rstd);
      on_term(k * kVec + e, term, dw_term_err(fdy[e], fx[e], rstd, term));  // err unused: dead code
    }
    st_vec(dx, L::vec(k, t), pack8(fo));
  }
}

}  // namespace cake

#endif  // CAKE_RMSNORM_BWD_ROW_CUH
