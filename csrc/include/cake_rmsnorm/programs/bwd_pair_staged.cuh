/* det backward, pair form with a staged reduce:
 *   cake::BwdPairStaged<H, WeightT, kResidual, kReduction, kChunkRows, kStageBytes>  (fp64_fold only)
 *
 * Main kernel: BwdPair<H, WeightT, kResidual, fp64_fold, kChunkRows>'s own (the same kernel, launched through
 * BwdPair::launch_main), so dx and the FP64 chunk partials are BwdPair's bits.
 * Reduce kernel: BwdPair's reduction, column for column and addition for addition: a block of 32
 * columns x kSplits warps; warp s folds, in FP64 and chunk order starting from 0.0, the contiguous
 * chunk segment s (seg = ceil(nchunks / kSplits), as BwdPair cuts it); then warp 0 adds the kSplits
 * segment sums in split order and rounds once to the weight dtype. The only difference is how the
 * partials travel: each warp copies up to kStageChunks chunk rows of its 32 columns at a time into its
 * own slice of dynamic shared memory (cp.async, all in flight at once), waits, and then adds them from
 * shared memory in chunk order. Same operands, same order, same FP64 additions: dw is bit-identical to
 * BwdPair's (the program's registry fallback), whatever kStageBytes is.
 * Dynamic shared memory of the reduce = kStageBytes = [kSplits][32] doubles (split sums) + the staging
 * slices (as many whole kSplits*32*8 B chunk rows as fit; any rest is unused); kStageBytes is the compile-time parameter `stage_bytes`, so the same code builds under the
 * opt-in limit (testable on an H200) and above it (oversized mode, CUDA 13.4+, sm_107a).
 */
#ifndef CAKE_RMSNORM_PROGRAMS_BWD_PAIR_STAGED_CUH
#define CAKE_RMSNORM_PROGRAMS_BWD_PAIR_STAGED_CUH

#include "cake_rmsnorm/programs/bwd_pair.cuh"
#include "cake_rmsnorm/smem_mode.cuh"

namespace cake {

__device__ __forceinline__ void cp_async8(double* smem_dst, const double* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}

template <int H, class W, bool kRes, Reduction kR, int kChunkRows, int kStageBytes>
struct BwdPairStaged : BwdPair<H, W, kRes, kR, kChunkRows> {
  static_assert(kR == Reduction::kFp64Fold, "pair_staged: reduction must be fp64_fold");
  using Base = BwdPair<H, W, kRes, kR, kChunkRows>;
  using Base::kReduceThreads;
  using Base::kSplits;
  static constexpr int kSplitBytes = Base::kReduceSmem;  // [kSplits][32] doubles
  static constexpr int kChunkRowBytes = kSplits * kWarpSize * static_cast<int>(sizeof(double));
  static_assert(kStageBytes >= kSplitBytes + kChunkRowBytes,
                "stage_bytes must hold the split sums (kSplits*32*8 B) and at least one staged "
                "chunk row (kSplits*32*8 B)");
  static constexpr int kStageChunks = (kStageBytes - kSplitBytes) / kChunkRowBytes;  // per warp
  static constexpr int kSmemBytes = cmax(Base::kMainSmem, kStageBytes);

  static __device__ __forceinline__ void run_reduce(const cake_bwd_args_t& a) {
    double* sm = reinterpret_cast<double*>(dyn_smem());  // [kSplits][32]
    const int lane = threadIdx.x % kWarpSize;
    const int s = threadIdx.x / kWarpSize;
    double* stage = reinterpret_cast<double*>(dyn_smem() + kSplitBytes) +
                   static_cast<size_t>(s) * kStageChunks * kWarpSize;
    const double* part = static_cast<const double*>(a.workspace);
    int64_t c0, c1;
    chunk_segment<kSplits>(Base::nchunks(a.T), s, c0, c1);
    constexpr int kTiles = ceil_div(H, kWarpSize);
    for (int tile = blockIdx.x; tile < kTiles; tile += gridDim.x) {
      const int col = tile * kWarpSize + lane;
      double sum = 0.0;
      if (col < H) {
        const double* p = part + col;
        for (int64_t cb = c0; cb < c1; cb += kStageChunks) {
          const int n = static_cast<int>(c1 - cb < kStageChunks ? c1 - cb : kStageChunks);
          for (int j = 0; j < n; ++j) cp_async8(stage + j * kWarpSize + lane, p + (cb + j) * H);
          cp_async_commit();
          cp_async_wait<0>();  // this thread's own copies: it reads only what it copied
#pragma unroll 4
          for (int j = 0; j < n; ++j) sum += stage[j * kWarpSize + lane];
        }
      }
      combine_splits<W, kSplits>(static_cast<W*>(a.dw), H, sm, s, lane, col, sum);
    }
  }

  static cudaError_t launch(const cake_bwd_args_t& a, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    // Attributes first: where the device or runtime cannot give kStageBytes, launch nothing at all.
    cudaError_t e = prepare_smem<BwdPairStaged>(bwd_pair_reduce<BwdPairStaged>, kStageBytes);
    if (e != cudaSuccess) return e;
    e = Base::launch_main(a, st);
    if (e != cudaSuccess) return e;
    bwd_pair_reduce<BwdPairStaged><<<grid_capped(ceil_div(H, kWarpSize), a.grid_cap), kReduceThreads,
                                     kStageBytes, st>>>(a);
    e = cudaGetLastError();  // a launch refused for its shared memory is not sticky: clear, return
    return e;
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_BWD_PAIR_STAGED_CUH
