/* Generic H: the programs for the widths that are not prebuilt. H is a RUNTIME argument (any
 * multiple of 8 up to kMaxHidden); the numerical contract is the prebuilt programs' one, the speed
 * is not (plain global loads, one row per block, no pipeline).
 *
 *   cake::GenericForward<WeightT, kResidual, kReduction (fp32), kThreads, kVecsPerThread>
 *   cake::GenericBwdPair<WeightT, kResidual, kReduction (fp64_fold), kThreads, kVecsPerThread>
 *
 * Row layout: a block of kThreads threads is one row group; a row's NV = H/8 16-byte vectors are
 * spread as in common.cuh (vector k of thread t is k*kThreads + t, k < kVecsPerThread), with
 * runtime masks for the vectors past NV. kMaxHidden = kThreads * kVecsPerThread * 8 (the registry
 * declares it as the program's `max_hidden`; the generated source checks the two agree).
 *
 * Forward (grid: min(T, 2^31 - 1) blocks, rows b, b + grid, ...): forward.cuh's math,
 *   h = bf16(x + r), ss = Σ h² (per thread in index order, then group_sum), rstd = 1 / sqrtf(ss / H +
 *   eps), y = bf16((h·rstd)·w).
 * Backward: the pair form of bwd_pair.cuh with reduction fp64_fold, in det's canonical order:
 *   main: rows cut into chunks of kDetChunkRows rows; a block takes chunks b, b + grid, ... and, per
 *     row in row order, computes dx (bwd_row_math's math: x̂ = x·rstd, g = dy·w, c = Σ g·x̂ / H,
 *     dx = bf16(rstd·(g − x̂·c) + dresidual_out)) and adds each of its columns' dw term, the exact
 *     product (dy·x)·rstd, to an FP64 sum started from zero at the chunk's first row (dw_add_fp64);
 *     the chunk's sums go to workspace[chunk][H] as doubles.
 *   reduce: per column, kDetSplits warps fold the chunk segments (chunk_segment) in chunk order in
 *     FP64, combine_splits adds the segment sums in split order and writes dw.
 * Every sum's order depends on T and H only: dw's bits depend only on the inputs (not on SM count,
 * grid or grid_cap), and they are det_pair_c64's bits at a prebuilt H (same chunks, segments and
 * FP64 additions). dx and y/rstd may differ in the last bit from the prebuilt programs (another
 * layout sums the row's dot product and Σ h² in another order). fast runs this backward too.
 * workspace_bytes(T, H) = align256(nchunks · H · 8), nchunks = ceil(T / kDetChunkRows).
 * Offsets are 64-bit (row · H).
 */
#ifndef CAKE_RMSNORM_PROGRAMS_GENERIC_CUH
#define CAKE_RMSNORM_PROGRAMS_GENERIC_CUH

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/bwd_row.cuh"            // dw_add_fp64
#include "cake_rmsnorm/common.cuh"
#include "cake_rmsnorm/programs/bwd_pair.cuh"  // chunk_segment, combine_splits

namespace cake {

template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks)
    generic_forward_kernel(const cake_fwd_args_t a, int H) {
  P::run(a, H);
}
template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks)
    generic_bwd_main(const cake_bwd_args_t a, int H) {
  P::run_main(a, H);
}
template <class P>
__global__ void __launch_bounds__(P::kReduceThreads) generic_bwd_reduce(const cake_bwd_args_t a, int H) {
  P::run_reduce(a, H);
}

// The row group shape both generic programs share.
template <int kThreads_, int kVecsPerThread>
struct GenericRow {
  static_assert(kThreads_ % kWarpSize == 0 && kThreads_ >= kWarpSize && kThreads_ <= 1024,
                "threads must be a multiple of 32, at most 1024");
  static_assert(kVecsPerThread >= 1, "vecs_per_thread must be positive");
  static constexpr int kThreads = kThreads_;
  static constexpr int kVPT = kVecsPerThread;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kMaxHidden = kThreads * kVPT * kVec;
  __host__ __device__ static bool valid_hidden(int H) {
    return H >= kVec && H % kVec == 0 && H <= kMaxHidden;
  }
};

template <class W, bool kRes, Reduction kR, int kThreads_, int kVecsPerThread>
struct GenericForward : GenericRow<kThreads_, kVecsPerThread> {
  static_assert(kR == Reduction::kFp32, "generic forward: reduction must be fp32");
  using Row = GenericRow<kThreads_, kVecsPerThread>;
  using Row::kThreads;
  using Row::kVPT;
  using Row::kWarps;
  static constexpr int kMinBlocks = 2;  // <= 128 registers
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kSmemBytes = kReduceScratchBytes;

  static __device__ __forceinline__ void run(const cake_fwd_args_t& a, int H) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const int t = threadIdx.x;
    const int nv = H / kVec;
    const W* w = static_cast<const W*>(a.weight);
    for (int64_t row = blockIdx.x; row < a.T; row += gridDim.x) {
      const int64_t off = row * H;
      const bf16* x = static_cast<const bf16*>(a.x) + off;
      uint4 vh[kVPT];
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        const int v = k * kThreads + t;
        if (v >= nv) continue;
        float fh[kVec];
        vh[k] = ld_vec(x, v);
        if constexpr (kRes) {
          float fr[kVec];
          unpack8(vh[k], fh);
          unpack8(ld_vec(static_cast<const bf16*>(a.residual) + off, v), fr);
#pragma unroll
          for (int e = 0; e < kVec; ++e) fh[e] = fh[e] + fr[e];
          vh[k] = pack8(fh);  // h = bf16(x + r)
        }
        unpack8(vh[k], fh);
#pragma unroll
        for (int e = 0; e < kVec; ++e) ss += fh[e] * fh[e];
      }
      ss = group_sum<kWarps>(ss, scratch, t / kWarpSize, 0);
      const float rstd = 1.0f / sqrtf(ss / static_cast<float>(H) + a.eps);
      if (t == 0) a.rstd[row] = rstd;
      bf16* y = static_cast<bf16*>(a.y) + off;
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        const int v = k * kThreads + t;
        if (v >= nv) continue;
        if constexpr (kRes) st_vec(static_cast<bf16*>(a.residual_out) + off, v, vh[k]);
        float fh[kVec], fw[kVec], fy[kVec];
        unpack8(vh[k], fh);
        ld_w8(w, v, fw);
#pragma unroll
        for (int e = 0; e < kVec; ++e) fy[e] = (fh[e] * rstd) * fw[e];
        st_vec(y, v, pack8(fy));
      }
    }
  }

  static cudaError_t launch(const cake_fwd_args_t& a, int H, cudaStream_t s) {
    if (a.T <= 0) return cudaSuccess;
    const int grid = static_cast<int>(a.T < 0x7fffffffLL ? a.T : 0x7fffffffLL);
    generic_forward_kernel<GenericForward><<<grid, kThreads, kSmemBytes, s>>>(a, H);
    return cudaSuccess;
  }
};

template <class W, bool kRes, Reduction kR, int kThreads_, int kVecsPerThread>
struct GenericBwdPair : GenericRow<kThreads_, kVecsPerThread> {
  static_assert(kR == Reduction::kFp64Fold, "generic pair: reduction must be fp64_fold");
  using Row = GenericRow<kThreads_, kVecsPerThread>;
  using Row::kThreads;
  using Row::kVPT;
  using Row::kWarps;
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * 128));  // <= 128 registers
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kChunkRows = kDetChunkRows;
  static constexpr int kSplits = kDetSplits;
  static constexpr int kReduceThreads = kSplits * kWarpSize;
  static constexpr int kReduceSmem = kSplits * kWarpSize * 8;  // one double per (split, column)
  static constexpr int kMainSmem = kReduceScratchBytes;
  static constexpr int kSmemBytes = cmax(kMainSmem, kReduceSmem);

  __host__ __device__ static int64_t nchunks(int64_t T) { return (T + kChunkRows - 1) / kChunkRows; }
  static size_t workspace_bytes(int64_t T, int H) {
    return align256(static_cast<size_t>(nchunks(T)) * static_cast<size_t>(H) * sizeof(double));
  }

  static __device__ __forceinline__ void run_main(const cake_bwd_args_t& a, int H) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const int t = threadIdx.x;
    const int warp = t / kWarpSize;
    const int nv = H / kVec;
    const bf16* dy = static_cast<const bf16*>(a.dy);
    const bf16* x = static_cast<const bf16*>(a.x);
    const bf16* dres = kRes ? static_cast<const bf16*>(a.dresidual_out) : nullptr;
    const bool has_res = kRes && dres != nullptr;
    const W* w = static_cast<const W*>(a.weight);
    bf16* dx = static_cast<bf16*>(a.dx);
    double* part = static_cast<double*>(a.workspace);
    const int64_t nch = nchunks(a.T);
    for (int64_t ch = blockIdx.x; ch < nch; ch += gridDim.x) {
      double acc[kVPT * kVec];
#pragma unroll
      for (int i = 0; i < kVPT * kVec; ++i) acc[i] = 0.0;
      const int64_t r0 = ch * kChunkRows;
      const int64_t r1 = r0 + kChunkRows < a.T ? r0 + kChunkRows : a.T;
      for (int64_t row = r0; row < r1; ++row) {
        const float rstd = __ldg(a.rstd + row);
        const int64_t off = row * H;
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < kVPT; ++k) {
          const int v = k * kThreads + t;
          if (v >= nv) continue;
          float fdy[kVec], fx[kVec], fw[kVec];
          unpack8(ld_vec(dy + off, v), fdy);
          unpack8(ld_vec(x + off, v), fx);
          ld_w8(w, v, fw);
#pragma unroll
          for (int e = 0; e < kVec; ++e) dot += (fdy[e] * fw[e]) * (fx[e] * rstd);
        }
        const float c = group_sum<kWarps>(dot, scratch, warp, 0) / static_cast<float>(H);
#pragma unroll
        for (int k = 0; k < kVPT; ++k) {
          const int v = k * kThreads + t;
          if (v >= nv) continue;
          // dy and x again (L1): holding them across the reduction would cost the dw sums' registers
          float fdy[kVec], fx[kVec], fw[kVec], fo[kVec];
          unpack8(ld_vec(dy + off, v), fdy);
          unpack8(ld_vec(x + off, v), fx);
          ld_w8(w, v, fw);
          if (has_res) {
            unpack8(ld_vec(dres + off, v), fo);
          } else {
#pragma unroll
            for (int e = 0; e < kVec; ++e) fo[e] = 0.f;
          }
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const float g = fdy[e] * fw[e];
            const float xh = fx[e] * rstd;
            fo[e] = rstd * (g - xh * c) + fo[e];
            dw_add_fp64(acc[k * kVec + e], __fmul_rn(fdy[e], fx[e]), rstd);
          }
          st_vec(dx + off, v, pack8(fo));
        }
      }
      double* out = part + ch * H;  // this chunk's partials: 16-byte stores
#pragma unroll
      for (int k = 0; k < kVPT; ++k) {
        const int v = k * kThreads + t;
        if (v >= nv) continue;
        double2* o = reinterpret_cast<double2*>(out + kVec * v);
#pragma unroll
        for (int q = 0; q < kVec / 2; ++q) {
          o[q] = make_double2(acc[k * kVec + 2 * q], acc[k * kVec + 2 * q + 1]);
        }
      }
    }
  }

  static __device__ __forceinline__ void run_reduce(const cake_bwd_args_t& a, int H) {
    reduce_fp64_partials<W, kSplits>(a, H, nchunks(a.T));
  }

  static cudaError_t launch(const cake_bwd_args_t& a, int H, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    int sm = 0;
    cudaError_t e = sm_count(&sm);
    if (e != cudaSuccess) return e;
    const int64_t nch = nchunks(a.T);
    const int64_t full = static_cast<int64_t>(sm) *
        blocks_per_sm(generic_bwd_main<GenericBwdPair>, kThreads, kMainSmem, 1);
    generic_bwd_main<GenericBwdPair>
        <<<grid_capped(balanced_grid(nch, full), a.grid_cap), kThreads, kMainSmem, st>>>(a, H);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    generic_bwd_reduce<GenericBwdPair>
        <<<grid_capped(ceil_div(H, kWarpSize), a.grid_cap), kReduceThreads, kReduceSmem, st>>>(a, H);
    return cudaSuccess;
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_GENERIC_CUH
