/* Forward: cake::Forward<H, WeightT, kResidual, kReduction (fp32), kRowsPerBlock>.
 *
 * Mapping: a block holds kRowsPerBlock row groups (RowLayout with at most 1024/kRowsPerBlock threads
 * per row, 16-byte vectors, coalesced); group g of block b normalises row b*kRowsPerBlock + g.
 * grid = ceil(T / kRowsPerBlock).
 * Math (FP32): h = bf16(x + r) (written to residual_out), ss = Σ h² in a fixed order (per thread
 * in index order, xor butterfly, warps in order), rstd = 1 / sqrtf(ss / H + eps) (correctly rounded:
 * built with --prec-div=true --prec-sqrt=true), y = bf16((h·rstd)·w). The order is fixed, so y and
 * rstd are bitwise reproducible and independent of the launch.
 */
#ifndef CAKE_RMSNORM_PROGRAMS_FORWARD_CUH
#define CAKE_RMSNORM_PROGRAMS_FORWARD_CUH

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/common.cuh"

namespace cake {

template <class P>
__global__ void __launch_bounds__(P::kThreads, 1) forward_kernel(const cake_fwd_args_t a) {
  P::run(a);
}

template <int H, class W, bool kRes, Reduction kR, int kRowsPerBlock>
struct Forward {
  static_assert(kR == Reduction::kFp32, "forward: reduction must be fp32");
  static_assert(kRowsPerBlock >= 1 && kRowsPerBlock <= 32, "rows_per_block out of range");
  using L = RowLayout<H, cmax(32, 1024 / kRowsPerBlock / 32 * 32)>;
  static constexpr int kThreads = kRowsPerBlock * L::kTPR;
  static_assert(kThreads <= 1024, "block too large");
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kSmemBytes = kReduceScratchBytes;

  static __device__ __forceinline__ void run(const cake_fwd_args_t& a) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const int g = threadIdx.x / L::kTPR;
    const int t = threadIdx.x % L::kTPR;
    const int warp = threadIdx.x / kWarpSize;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + g;
    const bool active = row < a.T;
    const int64_t off = row * H;
    const bf16* x = static_cast<const bf16*>(a.x) + off;
    const bf16* r = kRes ? static_cast<const bf16*>(a.residual) + off : nullptr;
    const W* w = static_cast<const W*>(a.weight);

    uint4 vh[L::kVPT];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < L::kVPT; ++k) {
      vh[k] = make_uint4(0, 0, 0, 0);
      if (!(active && L::valid(k, t))) continue;
      vh[k] = ld_vec(x, L::vec(k, t));
      float fh[kVec];
      if constexpr (kRes) {
        float fr[kVec];
        unpack8(vh[k], fh);
        unpack8(ld_vec(r, L::vec(k, t)), fr);
#pragma unroll
        for (int e = 0; e < kVec; ++e) fh[e] = fh[e] + fr[e];
        vh[k] = pack8(fh);  // h = bf16(x + r)
      }
      unpack8(vh[k], fh);
#pragma unroll
      for (int e = 0; e < kVec; ++e) ss += fh[e] * fh[e];
    }
    ss = group_sum<L::kWarps>(ss, scratch, warp, g * L::kWarps);
    if (!active) return;
    const float rstd = 1.0f / sqrtf(ss / static_cast<float>(H) + a.eps);
    if (t == 0) a.rstd[row] = rstd;
    bf16* y = static_cast<bf16*>(a.y) + off;
    bf16* ro = kRes ? static_cast<bf16*>(a.residual_out) + off : nullptr;
#pragma unroll
    for (int k = 0; k < L::kVPT; ++k) {
      if (!L::valid(k, t)) continue;
      if constexpr (kRes) st_vec(ro, L::vec(k, t), vh[k]);
      float fh[kVec], fw[kVec], fy[kVec];
      unpack8(vh[k], fh);
      ld_w8(w, L::vec(k, t), fw);
#pragma unroll
      for (int e = 0; e < kVec; ++e) fy[e] = (fh[e] * rstd) * fw[e];
      st_vec(y, L::vec(k, t), pack8(fy));
    }
  }

  static cudaError_t launch(const cake_fwd_args_t& a, cudaStream_t s) {
    if (a.T <= 0) return cudaSuccess;
    const int64_t blocks = (a.T + kRowsPerBlock - 1) / kRowsPerBlock;
    if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
    forward_kernel<Forward><<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, s>>>(a);
    return cudaSuccess;
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_FORWARD_CUH
