/* fast backward, single form:
 *   cake::BwdSingle<H, WeightT, kResidual, kReduction, kBlocksPerSm, kBlockRows>
 *
 * One kernel. grid = min(sm_count * kBlocksPerSm, grid_cap, ceil(T / kGroups)); block b takes the
 * contiguous rows [b*per, (b+1)*per), per = ceil(T / grid). A block holds kGroups row groups
 * (RowLayout, at most 512 threads per row; several groups of 32..128 threads for small H); group g
 * takes rows r0+g, r0+g+kGroups, ... For each row it computes dx (bwd_row, the same code as det)
 * and adds the dw terms of its columns into per-thread sums, in the form kReduction names:
 *   fp32          one FP32 sum per column over all the thread's rows (short ranges: small T);
 *   blocked_fp32  FP32 sums of kBlockRows rows, each folded into an FP64 running total, so no FP32
 *                 sum has more than kBlockRows terms (long ranges stay inside the budget);
 *   twosum        an FP32 TwoSum pair (sum + compensation, the product's TwoProduct error too).
 * kBlockRows > 0 exactly for blocked_fp32. Each group then atomicAdd(double)s its totals into the
 * workspace FP64 accumulator [H]; after a __threadfence the block bumps an atomic counter and the
 * last block to arrive converts the accumulator into dw (weight dtype, rounded once).
 * The order of the FP64 atomics is not fixed: dw is not bitwise reproducible (fast backend); dx is.
 * The library zeroes the workspace (memsetAsync on the stream) before the kernel.
 * workspace_bytes = align256(H * 8) + 256 (accumulator, then the counter), independent of T.
 */
#ifndef CAKE_RMSNORM_PROGRAMS_BWD_SINGLE_CUH
#define CAKE_RMSNORM_PROGRAMS_BWD_SINGLE_CUH

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/bwd_row.cuh"
#include "cake_rmsnorm/common.cuh"

namespace cake {

template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks) bwd_single_kernel(const cake_bwd_args_t a) {
  P::run(a);
}

template <int H, class W, bool kRes, Reduction kR, int kBlocksPerSm, int kBlockRows>
struct BwdSingle {
  static_assert(kBlocksPerSm >= 1, "blocks_per_sm must be positive");
  static_assert(kR == Reduction::kFp32 || kR == Reduction::kBlockedFp32 || kR == Reduction::kTwoSum,
                "single: reduction must be fp32, blocked_fp32 or twosum");
  static_assert((kR == Reduction::kBlockedFp32) == (kBlockRows > 0),
                "single: block_rows > 0 exactly for blocked_fp32");
  using L = RowLayout<H, 512>;
  static constexpr int kGroups = cmax(1, 256 / L::kTPR);
  static constexpr int kThreads = kGroups * L::kTPR;
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * 128));  // <= 128 registers
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kSmemBytes = kReduceScratchBytes;
  static constexpr size_t kCounterOffset = align256(sizeof(double) * H);

  static size_t workspace_bytes(int64_t /*T*/, int /*sm_count*/) { return kCounterOffset + 256; }

  static __device__ __forceinline__ void run(const cake_bwd_args_t& a) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const int g = threadIdx.x / L::kTPR;
    const int t = threadIdx.x % L::kTPR;
    const int warp = threadIdx.x / kWarpSize;
    const W* w = static_cast<const W*>(a.weight);
    double* acc = static_cast<double*>(a.workspace);
    unsigned* counter = reinterpret_cast<unsigned*>(static_cast<char*>(a.workspace) + kCounterOffset);

    const int64_t per = (a.T + gridDim.x - 1) / gridDim.x;
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * per;
    const int64_t r1 = r0 + per < a.T ? r0 + per : a.T;
    const int64_t n = r1 > r0 ? r1 - r0 : 0;
    const int64_t iters = (n + kGroups - 1) / kGroups;

    float blk[L::kCols];   // FP32 sums (the current block's, for blocked_fp32)
    float comp[L::kCols];  // twosum: compensation
    double tot[L::kCols];  // blocked_fp32: FP64 total of the finished blocks
#pragma unroll
    for (int i = 0; i < L::kCols; ++i) {
      blk[i] = comp[i] = 0.f;
      tot[i] = 0.0;
    }
    int in_block = 0;
#pragma unroll 1
    for (int64_t it = 0; it < iters; ++it) {  // block-uniform trip count
      const int64_t row = r0 + it * kGroups + g;
      const bool active = row < r1;
      const int64_t off = row * H;
      const bf16* dres = kRes && a.dresidual_out ? static_cast<const bf16*>(a.dresidual_out) + off
                                                 : nullptr;
      bwd_row<H, L, W, kRes>(static_cast<const bf16*>(a.dy) + off, static_cast<const bf16*>(a.x) + off,
                             dres, w, active ? __ldg(a.rstd + row) : 0.f, static_cast<bf16*>(a.dx) + off,
                             active, t, scratch, warp, g * L::kWarps,
                             [&](int i, float term, float err) {
                               if constexpr (kR == Reduction::kTwoSum) {
                                 two_sum_add(blk[i], comp[i], term, err);
                               } else {
                                 blk[i] += term;
                               }
                             });
      if constexpr (kR == Reduction::kBlockedFp32) {
        if (++in_block == kBlockRows) {
          in_block = 0;
#pragma unroll
          for (int i = 0; i < L::kCols; ++i) {
            tot[i] += static_cast<double>(blk[i]);
            blk[i] = 0.f;
          }
        }
      }
    }
    if (g < n) {  // this group saw at least one row
#pragma unroll
      for (int k = 0; k < L::kVPT; ++k) {
        if (!L::valid(k, t)) continue;
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const int i = k * kVec + e;
          atomicAdd(acc + L::vec(k, t) * kVec + e,
                    tot[i] + static_cast<double>(blk[i]) + static_cast<double>(comp[i]));
        }
      }
    }
    __threadfence();
    __syncthreads();
    int* last = reinterpret_cast<int*>(scratch);
    if (threadIdx.x == 0) *last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (*last) {
      __threadfence();
      for (int j = threadIdx.x; j < H; j += kThreads) st_dw(static_cast<W*>(a.dw), j, __ldcg(acc + j));
    }
  }

  static cudaError_t launch(const cake_bwd_args_t& a, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    int sm = 0;
    cudaError_t e = sm_count(&sm);
    if (e != cudaSuccess) return e;
    e = cudaMemsetAsync(a.workspace, 0, workspace_bytes(a.T, sm), st);
    if (e != cudaSuccess) return e;
    const int64_t groups = (a.T + kGroups - 1) / kGroups;
    const int64_t want = static_cast<int64_t>(sm) * kBlocksPerSm;
    bwd_single_kernel<BwdSingle><<<grid_capped(want < groups ? want : groups, a.grid_cap), kThreads, kSmemBytes, st>>>(a);
    return cudaSuccess;
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_BWD_SINGLE_CUH
