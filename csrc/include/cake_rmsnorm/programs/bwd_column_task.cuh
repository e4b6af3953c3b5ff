/* det backward, column-task form (small T): cake::BwdColumnTask<H, WeightT, kResidual,
 * kReduction, kColsPerBlock, kRowSplits>  (reduction twosum or fp64_fold)
 *
 * One launch of tasks of two roles (grid-stride over tasks when grid_cap is smaller):
 *  - column tasks 0 .. ceil(H/kColsPerBlock)-1: task c owns dw columns [c*kColsPerBlock, ...).
 *    Warp s (< kRowSplits) walks the contiguous row segment s (rows [s*seg, (s+1)*seg),
 *    seg = ceil(T / kRowSplits)) in row order; lane l holds kColsPerBlock/32 adjacent columns and
 *    keeps, per column, a TwoSum pair (twosum: FP32 sum + FP32 compensation, which also takes the
 *    TwoProduct error of (dy·x)·rstd) or an FP64 sum (fp64_fold). Warp 0 then combines the
 *    kRowSplits sums in split order (TwoSum, or FP64) and writes dw (one rounding to the weight
 *    dtype).
 *  - row tasks: kGroups row groups per block compute dx for one row each (bwd_row, shared with the
 *    other backward forms; the dw terms are ignored there).
 * Every order is fixed by T and compile-time constants: bitwise reproducible, independent of SM
 * count and grid. workspace_bytes = 0.
 */
#ifndef CAKE_RMSNORM_PROGRAMS_BWD_COLUMN_TASK_CUH
#define CAKE_RMSNORM_PROGRAMS_BWD_COLUMN_TASK_CUH

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/bwd_row.cuh"
#include "cake_rmsnorm/common.cuh"

namespace cake {

template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks) bwd_column_task_kernel(const cake_bwd_args_t a) {
  P::run(a);
}

template <int H, class W, bool kRes, Reduction kR, int kColsPerBlock, int kRowSplits>
struct BwdColumnTask {
  static_assert(kR == Reduction::kTwoSum || kR == Reduction::kFp64Fold,
                "column_task: reduction must be twosum or fp64_fold");
  static constexpr int kCPL = kColsPerBlock / kWarpSize;  // columns per lane
  static_assert(kColsPerBlock % kWarpSize == 0 && (kCPL == 1 || kCPL == 2 || kCPL == 4 || kCPL == 8),
                "cols_per_block must be 32, 64, 128 or 256");
  static_assert(kRowSplits >= 1 && kRowSplits <= 32, "row_splits must be 1..32");
  using L = RowLayout<H, 512>;
  static constexpr int kThreads = cmax(kRowSplits * kWarpSize, L::kTPR);
  static_assert(kThreads <= 1024, "block too large");
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * 128));  // <= 128 registers
  static constexpr int kGroups = kThreads / L::kTPR;  // row groups of a row task
  static constexpr int kColTasks = ceil_div(H, kColsPerBlock);
  static constexpr int kColSmem = kRowSplits * kColsPerBlock * 8;  // a TwoSum float pair or a double
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kSmemBytes = cmax(kReduceScratchBytes, kColSmem);

  static size_t workspace_bytes(int64_t /*T*/, int /*sm_count*/) { return 0; }

  template <int N>
  static __device__ __forceinline__ void ld_cols(const bf16* p, float (&f)[N]) {
    if constexpr (N == 1) {
      f[0] = __bfloat162float(p[0]);
    } else if constexpr (N == 2) {
      const uint32_t u = __ldg(reinterpret_cast<const unsigned int*>(p));
      f[0] = bf_lo(u); f[1] = bf_hi(u);
    } else if constexpr (N == 4) {
      const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
      f[0] = bf_lo(u.x); f[1] = bf_hi(u.x); f[2] = bf_lo(u.y); f[3] = bf_hi(u.y);
    } else {
      unpack8(__ldg(reinterpret_cast<const uint4*>(p)), f);
    }
  }

  static __device__ __forceinline__ void column_task(const cake_bwd_args_t& a, int task) {
    // [kRowSplits][kColsPerBlock]: float2 (sum, compensation) for twosum, double for fp64_fold
    float2* pairs = reinterpret_cast<float2*>(dyn_smem());
    double* fold = reinterpret_cast<double*>(dyn_smem());
    const int lane = threadIdx.x % kWarpSize;
    const int s = threadIdx.x / kWarpSize;
    const int cl = lane * kCPL;                       // first column of this lane in the task
    const int col = task * kColsPerBlock + cl;
    if (s < kRowSplits) {
      float sum[kCPL], comp[kCPL];
      double dsum[kCPL];
#pragma unroll
      for (int e = 0; e < kCPL; ++e) {
        sum[e] = comp[e] = 0.f;
        dsum[e] = 0.0;
      }
      if (col < H) {
        const int64_t seg = (a.T + kRowSplits - 1) / kRowSplits;
        const int64_t r0 = s * seg;
        const int64_t r1 = r0 + seg < a.T ? r0 + seg : a.T;
        const bf16* dy = static_cast<const bf16*>(a.dy) + col;
        const bf16* x = static_cast<const bf16*>(a.x) + col;
        for (int64_t row = r0; row < r1; ++row) {
          const float rstd = __ldg(a.rstd + row);
          float fdy[kCPL], fx[kCPL];
          ld_cols<kCPL>(dy + row * H, fdy);
          ld_cols<kCPL>(x + row * H, fx);
#pragma unroll
          for (int e = 0; e < kCPL; ++e) {
            const float term = dw_term(fdy[e], fx[e], rstd);
            if constexpr (kR == Reduction::kTwoSum) {
              two_sum_add(sum[e], comp[e], term, dw_term_err(fdy[e], fx[e], rstd, term));
            } else {
              dsum[e] += static_cast<double>(term);
            }
          }
        }
      }
#pragma unroll
      for (int e = 0; e < kCPL; ++e) {
        if constexpr (kR == Reduction::kTwoSum) {
          pairs[s * kColsPerBlock + cl + e] = make_float2(sum[e], comp[e]);
        } else {
          fold[s * kColsPerBlock + cl + e] = dsum[e];
        }
      }
    }
    __syncthreads();
    if (s == 0 && col < H) {
#pragma unroll
      for (int e = 0; e < kCPL; ++e) {
        double v;
        if constexpr (kR == Reduction::kTwoSum) {
          float S = pairs[cl + e].x, C = pairs[cl + e].y;
          for (int i = 1; i < kRowSplits; ++i) {
            two_sum_add(S, C, pairs[i * kColsPerBlock + cl + e].x, pairs[i * kColsPerBlock + cl + e].y);
          }
          v = static_cast<double>(S) + static_cast<double>(C);
        } else {
          v = fold[cl + e];
          for (int i = 1; i < kRowSplits; ++i) v += fold[i * kColsPerBlock + cl + e];
        }
        st_dw(static_cast<W*>(a.dw), col + e, v);
      }
    }
    __syncthreads();
  }

  static __device__ __forceinline__ void row_task(const cake_bwd_args_t& a, int64_t task) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const int g = threadIdx.x / L::kTPR;
    const int t = threadIdx.x % L::kTPR;
    const int warp = threadIdx.x / kWarpSize;
    const int64_t row = task * kGroups + g;
    const bool active = g < kGroups && row < a.T;  // threads past kGroups*kTPR idle (barriers only)
    const int64_t off = active ? row * H : 0;
    const bf16* dres = kRes && a.dresidual_out ? static_cast<const bf16*>(a.dresidual_out) + off : nullptr;
    bwd_row<H, L, W, kRes>(static_cast<const bf16*>(a.dy) + off, static_cast<const bf16*>(a.x) + off, dres,
                           static_cast<const W*>(a.weight), active ? __ldg(a.rstd + row) : 0.f,
                           static_cast<bf16*>(a.dx) + off, active, t, scratch, warp,
                           g < kGroups ? g * L::kWarps : 0, [](int, float, float) {});
  }

  static __device__ __forceinline__ void run(const cake_bwd_args_t& a) {
    const int64_t tasks = kColTasks + (a.T + kGroups - 1) / kGroups;
    for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {  // block-uniform
      if (task < kColTasks) {
        column_task(a, static_cast<int>(task));
      } else {
        row_task(a, task - kColTasks);
      }
    }
  }

  static cudaError_t launch(const cake_bwd_args_t& a, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    const int64_t tasks = kColTasks + (a.T + kGroups - 1) / kGroups;
    const int64_t want = tasks < 0x7fffffffLL ? tasks : 0x7fffffffLL;
    bwd_column_task_kernel<BwdColumnTask><<<grid_capped(want, a.grid_cap), kThreads, kSmemBytes, st>>>(a);
    return cudaSuccess;
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_BWD_COLUMN_TASK_CUH
