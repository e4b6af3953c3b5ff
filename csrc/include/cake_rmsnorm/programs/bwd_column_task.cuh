/* det backward, column-task form (small T): cake::BwdColumnTask<H, WeightT, kResidual,
 * kColsPerBlock, kRowSplits>  (reduction twosum)
 *
 * One launch of tasks of two roles (grid-stride over tasks when grid_cap is smaller):
 *  - column tasks 0 .. ceil(H/kColsPerBlock)-1: task c owns dw columns [c*kColsPerBlock, ...).
 *    Warp s (< kRowSplits) walks the contiguous row segment s (rows [s*seg, (s+1)*seg),
 *    seg = ceil(T / kRowSplits)) in row order; lane l holds kColsPerBlock/32 adjacent columns and
 *    keeps a TwoSum pair (FP32 sum + FP32 compensation, which also takes the TwoProduct error of
 *    (dy·x)·rstd). Warp 0 then combines the kRowSplits pairs in split order with TwoSum and writes
 *    dw = round(sum + comp) (FP64 add, one rounding to the weight dtype).
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

template <int H, class W, bool kRes, int kColsPerBlock, int kRowSplits>
struct BwdColumnTask {
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
  static constexpr int kColSmem = kRowSplits * kColsPerBlock * 2 * sizeof(float);
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
    float* sm = reinterpret_cast<float*>(dyn_smem());  // [kRowSplits][kColsPerBlock][2]
    const int lane = threadIdx.x % kWarpSize;
    const int s = threadIdx.x / kWarpSize;
    const int cl = lane * kCPL;                       // first column of this lane in the task
    const int col = task * kColsPerBlock + cl;
    if (s < kRowSplits) {
      float sum[kCPL], comp[kCPL];
#pragma unroll
      for (int e = 0; e < kCPL; ++e) sum[e] = comp[e] = 0.f;
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
            const float perr = dw_term_err(fdy[e], fx[e], rstd, term);
            float ns, err;
            two_sum(sum[e], term, ns, err);
            sum[e] = ns;
            comp[e] += err + perr;
          }
        }
      }
#pragma unroll
      for (int e = 0; e < kCPL; ++e) {
        sm[(s * kColsPerBlock + cl + e) * 2 + 0] = sum[e];
        sm[(s * kColsPerBlock + cl + e) * 2 + 1] = comp[e];
      }
    }
    __syncthreads();
    if (s == 0 && col < H) {
#pragma unroll
      for (int e = 0; e < kCPL; ++e) {
        float S = sm[(cl + e) * 2 + 0];
        float C = sm[(cl + e) * 2 + 1];
        for (int i = 1; i < kRowSplits; ++i) {
          float ns, err;
          two_sum(S, sm[(i * kColsPerBlock + cl + e) * 2 + 0], ns, err);
          S = ns;
          C += err + sm[(i * kColsPerBlock + cl + e) * 2 + 1];
        }
        st_dw(static_cast<W*>(a.dw), col + e, static_cast<double>(S) + static_cast<double>(C));
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
                           g < kGroups ? g * L::kWarps : 0, [](int, float) {});
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
