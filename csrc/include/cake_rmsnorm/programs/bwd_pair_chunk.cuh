/* backward, pair form with a staged chunk: cake::BwdPairChunk<H, WeightT, kResidual, kReduction,
 * kChunkRows, kGroups, kCopyParts>  (fp64_fold only)
 *
 * BwdPair's chunk partials and BwdPair's reduce, computed by a block that works on one chunk at a
 * time with all its threads instead of walking the chunk row by row with one row group. For small
 * H a row group is one warp, and BwdPair's block then walks its chunk's rows one after another
 * (a warp reduction and a dependent chain per row: instruction-bound at 7.5% of DRAM bandwidth, ncu,
 * H200, H 256, T 4096); here:
 *   1. the chunk's rows of dy, x (and dresidual_out) and their rstd, contiguous in memory, are
 *      copied into shared memory with cp.async in kCopyParts groups of consecutive rows, all in
 *      flight at once;
 *   2. the block's kGroups row groups take its rows g, g + kGroups, ..., each row once its part
 *      has landed, and compute dx (bwd_row_math: BwdPair's row math and layout, so dx has its bits);
 *   3. each thread sums its columns of the chunk from the staged rows in row order, from zero, in
 *      FP64 from the exact products (dw_add_fp64): BwdPair<fp64_fold>'s chunk partial, addition
 *      for addition.
 * With 64-row chunks the partials, and so dx and dw, are det_pair_c64's bits, which the FP64 column
 * tasks give too (ci/check_programs.py compares them); with other chunk_rows the bits are
 * reproducible but not det's canonical ones (fast's programs). Block b takes chunks b, b + grid, ...
 * (balanced_grid over the resident blocks, grid_cap). Shared memory: 3 planes of kChunkRows rows
 * (the dresidual_out plane unused without residual, so every library of a program takes the same
 * bytes), the rows' rstd and the group-sum scratch.
 */
#ifndef CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CHUNK_CUH
#define CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CHUNK_CUH

#include "cake_rmsnorm/programs/bwd_pair.cuh"
#include "cake_rmsnorm/smem_mode.cuh"

namespace cake {

template <int H, class W, bool kRes, Reduction kR, int kChunkRows, int kGroups, int kCopyParts = 1>
struct BwdPairChunk : BwdPair<H, W, kRes, kR, kChunkRows> {
  static_assert(kR == Reduction::kFp64Fold, "pair_chunk: reduction must be fp64_fold");
  static_assert(kGroups >= 1 && kChunkRows % kGroups == 0, "pair_chunk: groups must divide chunk_rows");
  using Base = BwdPair<H, W, kRes, kR, kChunkRows>;
  using L = BwdLayout<H>;
  static constexpr int kThreads = kGroups * L::kTPR;
  static_assert(kThreads <= 1024, "pair_chunk: at most 1024 threads a block (the group-sum scratch's 32 warps)");
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * 128));  // <= 128 registers
  static constexpr int kPlaneBytes = kChunkRows * H * 2;                  // one bf16 plane of the chunk
  static constexpr int kRstdOffset = kReduceScratchBytes + 3 * kPlaneBytes;
  static constexpr int kMainSmem = kRstdOffset + kChunkRows * 4;
  static constexpr int kSmemBytes = cmax(kMainSmem, Base::kReduceSmem);
  static constexpr int kRowsPerGroup = kChunkRows / kGroups;
  static constexpr int kColsPerThread = ceil_div(H, kThreads);
  static_assert(kCopyParts >= 1 && kCopyParts <= 8 && kRowsPerGroup % kCopyParts == 0,
                "pair_chunk: copy_parts (at most 8) must divide chunk_rows / groups");
  static constexpr int kPartRows = kChunkRows / kCopyParts;
  static_assert(kThreads >= kPartRows, "pair_chunk: a thread copies each row's rstd");

  static size_t workspace_bytes(int64_t T, int /*sm_count*/) { return Base::partials_bytes(T); }

  // Rows [r0 + lo, r0 + hi) of dy, x (and dresidual_out), and their rstd, into the chunk's shared
  // memory: one cp.async group.
  static __device__ __forceinline__ void copy_rows(const cake_bwd_args_t& a, int64_t r0, int lo, int hi, bool has_res) {
    unsigned char* s = dyn_smem() + kReduceScratchBytes;
    constexpr int kRowUnits = H / kVec;  // 16-byte pieces of a row; a chunk's rows are contiguous
    const int64_t first = (r0 + lo) * kRowUnits;
    const uint4* src[3] = {reinterpret_cast<const uint4*>(a.dy) + first, reinterpret_cast<const uint4*>(a.x) + first,
                           has_res ? reinterpret_cast<const uint4*>(a.dresidual_out) + first : nullptr};
    const int units = (hi > lo ? hi - lo : 0) * kRowUnits;
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (src[q] == nullptr) continue;
      uint4* d = reinterpret_cast<uint4*>(s + q * kPlaneBytes) + lo * kRowUnits;
      for (int u = threadIdx.x; u < units; u += kThreads) cp_async16(d + u, src[q] + u);
    }
    const int r = lo + static_cast<int>(threadIdx.x);
    if (r < hi) {  // cp_async4's instruction; through that helper ptxas schedules the q4 program
                   // differently (same instruction count), and that schedule has not been timed
      const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dyn_smem() + kRstdOffset + 4 * r));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(a.rstd + r0 + r) : "memory");
    }
    cp_async_commit();
  }

  static __device__ __forceinline__ void run_main(const cake_bwd_args_t& a) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const bf16* sdy = reinterpret_cast<const bf16*>(dyn_smem() + kReduceScratchBytes);
    const bf16* sx = sdy + kChunkRows * H;
    const bf16* sres = sx + kChunkRows * H;
    const float* srstd = reinterpret_cast<const float*>(dyn_smem() + kRstdOffset);
    const int g = threadIdx.x / L::kTPR;
    const int t = threadIdx.x % L::kTPR;
    const int warp = threadIdx.x / kWarpSize;
    const bool has_res = kRes && a.dresidual_out != nullptr;
    bf16* dx = static_cast<bf16*>(a.dx);
    double* part = static_cast<double*>(a.workspace);
    const int64_t nch = Base::nchunks(a.T);
    const HeldWeight<L, W> weight(static_cast<const W*>(a.weight), t);
    for (int64_t c = blockIdx.x; c < nch; c += gridDim.x) {
      const int64_t r0 = c * kChunkRows;
      const int n = static_cast<int>(a.T - r0 < kChunkRows ? a.T - r0 : kChunkRows);
      __syncthreads();  // the previous chunk's staged rows are read
#pragma unroll
      for (int p = 0; p < kCopyParts; ++p) copy_rows(a, r0, p * kPartRows, cmin((p + 1) * kPartRows, n), has_res);
#pragma unroll
      for (int i = 0; i < kRowsPerGroup; ++i) {
        const int r = i * kGroups + g;
        if (i % (kRowsPerGroup / kCopyParts) == 0) {  // the rows of the next copy part: landed, and seen by all
          cp_async_wait_pending(kCopyParts - 1 - i / (kRowsPerGroup / kCopyParts));
          __syncthreads();
        }
        uint4 vdy[L::kVPT], vx[L::kVPT], vres[L::kVPT];
#pragma unroll
        for (int k = 0; k < L::kVPT; ++k) {
          const bool live = r < n && L::valid(k, t);
          const int v = r * (H / kVec) + L::vec(k, t);
          vdy[k] = live ? reinterpret_cast<const uint4*>(sdy)[v] : make_uint4(0, 0, 0, 0);
          vx[k] = live ? reinterpret_cast<const uint4*>(sx)[v] : make_uint4(0, 0, 0, 0);
          vres[k] = live && has_res ? reinterpret_cast<const uint4*>(sres)[v] : make_uint4(0, 0, 0, 0);
        }
        bwd_row_math<H, L, kRes>(vdy, vx, vres, has_res, weight, r < n ? srstd[r] : 0.f, dx + (r0 + r) * H, r < n,
                                 t, scratch, warp, g * L::kWarps, [](int, float, float) {});
      }
      // dw: this thread's columns of the chunk, in row order from zero (BwdPair's chunk partial)
#pragma unroll
      for (int q = 0; q < kColsPerThread; ++q) {
        const int j = q * kThreads + static_cast<int>(threadIdx.x);
        if (H % kThreads != 0 && j >= H) continue;
        double sum = 0.0;
#pragma unroll 8
        for (int r = 0; r < n; ++r) {
          dw_add_fp64(sum, __fmul_rn(__bfloat162float(sdy[r * H + j]), __bfloat162float(sx[r * H + j])), srstd[r]);
        }
        part[c * H + j] = sum;
      }
    }
    pdl_allow_dependents();  // this block's partials are stored: the reduce may be scheduled
  }

  static cudaError_t launch(const cake_bwd_args_t& a, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    cudaError_t e = prepare_smem<BwdPairChunk>(bwd_pair_kernel<BwdPairChunk>, kMainSmem);
    if (e != cudaSuccess) return e;
    int sm = 0;
    e = sm_count(&sm);
    if (e != cudaSuccess) return e;
    const int64_t full = static_cast<int64_t>(sm) *
        blocks_per_sm(bwd_pair_kernel<BwdPairChunk>, kThreads, kMainSmem, 1);
    bwd_pair_kernel<BwdPairChunk><<<grid_capped(balanced_grid(Base::nchunks(a.T), full), a.grid_cap), kThreads,
                                          kMainSmem, st>>>(a);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    return Base::launch_reduce(a, st);
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CHUNK_CUH
