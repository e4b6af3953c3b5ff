/* det backward, pair form: cake::BwdPair<H, WeightT, kResidual, kReduction, kChunkRows, kRingRows, kPull>
 * (reduction fp64_fold or twosum)
 *
 * Main kernel: the rows are cut into FIXED chunks of kChunkRows rows (chunk c = rows
 * [c*kChunkRows, ...)), independent of SM count and grid. One block = one row group (BwdLayout);
 * grid = balanced_grid(nchunks, resident blocks), capped by grid_cap; block b takes chunks b, b + grid, ... and walks
 * their rows as one sequence through the row pipeline (bwd_row.cuh: the next kRingRows rows' dy and
 * x in flight in shared memory). kPull 1: grid = min(resident blocks, nchunks), and after chunks b
 * and b + grid a block pulls its next chunk at run time (bwd_row.cuh PulledChunks), so blocks on
 * faster SMs take more chunks; a chunk's rows and sums are the same whichever block takes it, so
 * the bits are too. For each row, in row order, it computes dx and each thread adds the
 * row's dw terms of its own columns into registers, so every column of a chunk is summed by one
 * thread in row order, starting from zero at the chunk's first row:
 *   fp64_fold  an FP64 sum of the exact products (dy·x)·rstd (dw_add_fp64): the chunk partial is
 *              written as a double;
 *   twosum     an FP32 TwoSum pair (dw_add_twosum): sums, then compensations, in two FP32 planes.
 * Reduce kernel: a block of 32 columns x kSplits warps; warp s sums, in chunk order, the contiguous
 * segment s of the chunks (segments depend only on T) — in FP64 (fp64_fold) or as an FP32 TwoSum
 * pair (twosum) — then warp 0 adds the kSplits segment sums in split order (FP64, or TwoSum) and
 * writes dw (rounded once to the weight dtype).
 * Every sum has an order fixed by T and compile-time constants only: the bits depend only on the
 * inputs, not on SM count, grid_cap or timing. The column task (bwd_column_task.cuh) walks the same
 * chunks and segments with the same additions, so it gives the same bits as the pair of its reduction.
 * workspace_bytes = align256(nchunks * H * 8): one plane of doubles (fp64_fold) or two of floats
 * (twosum), nchunks = ceil(T / kChunkRows); kPull 1: then 256 bytes for the chunk counter (zeroed by
 * the library before the main kernel).
 */
#ifndef CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CUH
#define CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CUH

#include <type_traits>

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/bwd_row.cuh"
#include "cake_rmsnorm/common.cuh"
#include "cake_rmsnorm/smem_mode.cuh"

namespace cake {

template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks) bwd_pair_kernel(const cake_bwd_args_t a) {
  P::run_main(a);
}
template <class P>
__global__ void __launch_bounds__(P::kReduceThreads) bwd_pair_reduce(const cake_bwd_args_t a) {
  P::run_reduce(a);
}

// The segment [c0, c1) of the nch chunks that split s of kSplits takes (depends only on nch):
// shared by the pair's reduce and the column task, so both cut the chunks alike.
template <int kSplits>
__host__ __device__ __forceinline__ void chunk_segment(int64_t nch, int s, int64_t& c0, int64_t& c1) {
  const int64_t seg = (nch + kSplits - 1) / kSplits;
  c0 = s * seg < nch ? s * seg : nch;
  c1 = c0 + seg < nch ? c0 + seg : nch;
}

// add(load(c)) for c in [c0, c1), in chunk order: the additions are one sequential chain, the loads
// need not be. Double-buffered batches of kFoldAhead: batch k+1's loads are issued before batch k is
// added, so however the compiler interleaves loads and additions (it does: it sinks each load next
// to its use), an addition waits at most once per batch for memory. Indices past c1 load c1 - 1 and
// add T{} (zero), an exact no-op (a sum started at +0 never becomes -0).
constexpr int kFoldAhead = 32;
template <class T, class Load, class Add>
__device__ __forceinline__ void fold_in_order(int64_t c0, int64_t c1, Load&& load, Add&& add) {
  if (c0 >= c1) return;
  T cur[kFoldAhead], nxt[kFoldAhead];
#pragma unroll
  for (int i = 0; i < kFoldAhead; ++i) cur[i] = load(c0 + i < c1 ? c0 + i : c1 - 1);
  for (int64_t c = c0; c < c1; c += kFoldAhead) {
#pragma unroll
    for (int i = 0; i < kFoldAhead; ++i) {
      const int64_t n = c + kFoldAhead + i;
      nxt[i] = load(n < c1 ? n : c1 - 1);
    }
#pragma unroll
    for (int i = 0; i < kFoldAhead; ++i) add(c + i < c1 ? cur[i] : T{});
#pragma unroll
    for (int i = 0; i < kFoldAhead; ++i) cur[i] = nxt[i];
  }
}

// Warp 0 adds the kSplits split sums of its 32 columns in split order and writes dw; block-wide
// barriers. FP64 sums, or TwoSum pairs (sum, compensation).
template <class W, int kSplits>
__device__ __forceinline__ void combine_splits(W* dw, int H, double* sm, int s, int lane, int col, double sum) {
  sm[s * kWarpSize + lane] = sum;
  __syncthreads();
  if (s == 0 && col < H) {
    double v = sm[lane];
#pragma unroll
    for (int i = 1; i < kSplits; ++i) v += sm[i * kWarpSize + lane];
    st_dw(dw, col, v);
  }
  __syncthreads();
}
template <class W, int kSplits>
__device__ __forceinline__ void combine_splits(W* dw, int H, float2* sm, int s, int lane, int col, float2 sum) {
  sm[s * kWarpSize + lane] = sum;
  __syncthreads();
  if (s == 0 && col < H) {
    float S = sm[lane].x, C = sm[lane].y;
#pragma unroll
    for (int i = 1; i < kSplits; ++i) two_sum_add(S, C, sm[i * kWarpSize + lane].x, sm[i * kWarpSize + lane].y);
    st_dw(dw, col, static_cast<double>(S) + static_cast<double>(C));
  }
  __syncthreads();
}

// The reduce's walk, one block of kSplits warps over tiles of 32 columns (grid-stride): for each of
// this thread's columns, fold(s, lane, col, c, c0, e1) sums chunks [c0, e1) of column c in chunk order
// (warp s's segment; past H an empty segment at column 0, so its barriers still run) and combines.
template <int kSplits, class Fold>
__device__ __forceinline__ void for_each_reduce_column(int H, int64_t nch, Fold&& fold) {
  const int lane = threadIdx.x % kWarpSize;
  const int s = threadIdx.x / kWarpSize;
  int64_t c0, c1;
  chunk_segment<kSplits>(nch, s, c0, c1);
  const int tiles = ceil_div(H, kWarpSize);
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int col = tile * kWarpSize + lane;
    fold(s, lane, col, col < H ? col : 0, c0, col < H ? c1 : c0);
  }
}

// det's FP64 reduce: warp s folds its segment of the chunk partials [nch][H] (doubles) in chunk
// order, then combine_splits. H is a compile-time constant in the pair and a run-time one in the
// generic program.
template <class W, int kSplits>
__device__ __forceinline__ void reduce_fp64_partials(const cake_bwd_args_t& a, int H, int64_t nch) {
  const double* part = static_cast<const double*>(a.workspace);
  W* dw = static_cast<W*>(a.dw);
  for_each_reduce_column<kSplits>(H, nch, [&](int s, int lane, int col, int c, int64_t c0, int64_t e1) {
    const double* p = part + c;
    double sum = 0.0;
    fold_in_order<double>(c0, e1, [&](int64_t k) { return __ldg(p + k * H); }, [&](double v) { sum += v; });
    combine_splits<W, kSplits>(dw, H, reinterpret_cast<double*>(dyn_smem()), s, lane, col, sum);
  });
}

template <int H, class W, bool kRes, Reduction kR, int kChunkRows, int kRingRows = 3, int kPull = 0>
struct BwdPair {
  static_assert(kChunkRows >= 1, "chunk_rows must be positive");
  static_assert(kR == Reduction::kFp64Fold || kR == Reduction::kTwoSum,
                "pair: reduction must be fp64_fold or twosum");
  using L = BwdLayout<H>;
  static constexpr int kThreads = L::kTPR;
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * 128));  // <= 128 registers
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr bool kFp64 = kR == Reduction::kFp64Fold;
  using Part = typename std::conditional<kFp64, double, float>::type;  // a chunk partial's type
  static constexpr int kSplits = kDetSplits;  // reduce: chunk segments per column, combined in split order
  static constexpr int kReduceThreads = kSplits * kWarpSize;
  static constexpr int kReduceSmem = kSplits * kWarpSize * 8;  // a double or a TwoSum float pair
  static constexpr int kPipeBytes = BwdPipe<L, kRes, kRingRows>::kBytes;
  static_assert(kPull == 0 || kPull == 1, "pair: pull must be 0 or 1");
  // scratch, the row ring, the staged weight, the pulled chunks' tickets
  static constexpr int kTicketOffset = kReduceScratchBytes + kPipeBytes + StagedWeight<L, W>::kBytes;
  static constexpr int kMainSmem = kTicketOffset + (kPull ? kTicketBytes : 0);
  static constexpr int kSmemBytes = cmax(kMainSmem, kReduceSmem);
  static constexpr int kBlocksPerSm = 1;  // fallback when the occupancy query fails

  __host__ __device__ static int64_t nchunks(int64_t T) { return (T + kChunkRows - 1) / kChunkRows; }
  static constexpr int kPlanes = kFp64 ? 1 : 2;
  __host__ __device__ static size_t partials_bytes(int64_t T) {
    return align256(static_cast<size_t>(kPlanes) * nchunks(T) * H * sizeof(Part));
  }
  static size_t workspace_bytes(int64_t T, int /*sm_count*/) { return partials_bytes(T) + (kPull ? 256 : 0); }

  // This thread's columns of one chunk row, 16-byte stores.
  static __device__ __forceinline__ void store_chunk(Part* out, const Part (&v)[L::kCols], int t) {
    constexpr int kPer = 16 / sizeof(Part);  // values per store
#pragma unroll
    for (int k = 0; k < L::kVPT; ++k) {
      if (!L::valid(k, t)) continue;
      uint4* o = reinterpret_cast<uint4*>(out + kVec * L::vec(k, t));
#pragma unroll
      for (int q = 0; q < kVec / kPer; ++q) {
        uint4 u;
        memcpy(&u, &v[k * kVec + q * kPer], 16);
        o[q] = u;
      }
    }
  }

  static __device__ __forceinline__ void run_main(const cake_bwd_args_t& a) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    uint4* ring = reinterpret_cast<uint4*>(dyn_smem() + kReduceScratchBytes);
    const int t = threadIdx.x;
    const int warp = t / kWarpSize;
    const W* w = static_cast<const W*>(a.weight);
    bf16* dx = static_cast<bf16*>(a.dx);
    Part* part = static_cast<Part*>(a.workspace);
    const int64_t nch = nchunks(a.T);
    Part acc[L::kCols];
    float comp[L::kCols];  // twosum: the compensations
#pragma unroll
    for (int i = 0; i < L::kCols; ++i) {
      acc[i] = 0;
      comp[i] = 0.f;
    }
    const StagedWeight<L, W> weight(w, dyn_smem() + kReduceScratchBytes + kPipeBytes, t);
    auto on_row = [&](int64_t, int64_t row, const uint4 (&vdy)[L::kVPT], const uint4 (&vx)[L::kVPT],
            const uint4 (&vres)[L::kVPT], bool has_res, float rstd) {
          bwd_row_math<H, L, kRes>(vdy, vx, vres, has_res, weight, rstd, dx + row * H, true, t, scratch,
                                      warp, 0, [&](int i, float p, float r) {
                                        if constexpr (kFp64) {
                                          dw_add_fp64(acc[i], p, r);
                                        } else {
                                          dw_add_twosum(acc[i], comp[i], p, r);
                                        }
                                      });
          if (row % kChunkRows == kChunkRows - 1 || row == a.T - 1) {  // the chunk is complete
            const int64_t ch = row / kChunkRows;
            store_chunk(part + ch * H, acc, t);
            if constexpr (!kFp64) store_chunk(part + (nch + ch) * H, comp, t);
#pragma unroll
            for (int i = 0; i < L::kCols; ++i) {
              acc[i] = 0;
              comp[i] = 0.f;
            }
          }
        };
    if constexpr (kPull) {
      pulled_rows<H, L, kRes, kRingRows, kChunkRows>(a, ring, t, dyn_smem() + kTicketOffset,
                                                     static_cast<char*>(a.workspace) + partials_bytes(a.T), on_row);
    } else {
      const int64_t b = blockIdx.x, grid = gridDim.x;
      // This block's rows: chunks b, b + grid, ... back to back; only the very last chunk is short.
      const int64_t nb = b < nch ? (nch - b + grid - 1) / grid : 0;
      const int64_t last = b + (nb - 1) * grid;
      const int64_t n = nb > 0 ? (nb - 1) * kChunkRows + (a.T - last * kChunkRows < kChunkRows
                                                            ? a.T - last * kChunkRows : kChunkRows)
                               : 0;
      pipelined_rows<H, L, kRes, kRingRows>(
          a, ring, t, n, [&](int64_t j) { return (b + (j / kChunkRows) * grid) * kChunkRows + j % kChunkRows; },
          on_row);
    }
    pdl_allow_dependents();  // this block's partials are stored: the reduce may be scheduled
  }

  static __device__ __forceinline__ void run_reduce(const cake_bwd_args_t& a) {
    pdl_wait();  // launched while the main kernel drains: its partials must have landed
    const int64_t nch = nchunks(a.T);
    if constexpr (kFp64) {
      reduce_fp64_partials<W, kSplits>(a, H, nch);
    } else {  // TwoSum: sums and compensations, two planes of floats
      const float* part = static_cast<const float*>(a.workspace);
      for_each_reduce_column<kSplits>(H, nch, [&](int s, int lane, int col, int c, int64_t c0, int64_t e1) {
        const float* p = part + c;
        const float* q = p + nch * H;  // the compensation plane
        float S = 0.f, C = 0.f;
        fold_in_order<float2>(
            c0, e1, [&](int64_t k) { return make_float2(__ldg(p + k * H), __ldg(q + k * H)); },
            [&](float2 v) { two_sum_add(S, C, v.x, v.y); });
        combine_splits<W, kSplits>(static_cast<W*>(a.dw), H, reinterpret_cast<float2*>(dyn_smem()), s, lane, col,
                                   make_float2(S, C));
      });
    }
  }

  // The main kernel alone (BwdPairStaged launches this very kernel, then its own reduce).
  static cudaError_t launch_main(const cake_bwd_args_t& a, cudaStream_t st) {
    cudaError_t e = prepare_smem<BwdPair>(bwd_pair_kernel<BwdPair>, kMainSmem);
    if (e != cudaSuccess) return e;
    int sm = 0;
    e = sm_count(&sm);
    if (e != cudaSuccess) return e;
    const int64_t nch = nchunks(a.T);
    const int64_t full = static_cast<int64_t>(sm) *
        blocks_per_sm(bwd_pair_kernel<BwdPair>, kThreads, kMainSmem, kBlocksPerSm);
    if constexpr (kPull) {
      e = cudaMemsetAsync(static_cast<char*>(a.workspace) + partials_bytes(a.T), 0, 256, st);
      if (e != cudaSuccess) return e;
    }
    const int64_t grid = kPull ? (full < nch ? full : nch) : balanced_grid(nch, full);
    bwd_pair_kernel<BwdPair><<<grid_capped(grid, a.grid_cap), kThreads, kMainSmem, st>>>(a);
    return cudaGetLastError();
  }

  // The reduce, a programmatic dependent of whatever main kernel stored the chunk partials (this
  // one, or BwdPairChunk's).
  static cudaError_t launch_reduce(const cake_bwd_args_t& a, cudaStream_t st) {
    return launch_dependent(bwd_pair_reduce<BwdPair>, grid_capped(ceil_div(H, kWarpSize), a.grid_cap),
                            kReduceThreads, kReduceSmem, st, a);
  }

  static cudaError_t launch(const cake_bwd_args_t& a, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    cudaError_t e = launch_main(a, st);
    if (e != cudaSuccess) return e;
    return launch_reduce(a, st);
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CUH
