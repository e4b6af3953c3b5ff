/* det backward, pair form: cake::BwdPair<H, WeightT, kResidual, kReduction, kChunkRows>
 * (reduction fp64_fold or twosum)
 *
 * Main kernel: the rows are cut into FIXED chunks of kChunkRows rows (chunk c = rows
 * [c*kChunkRows, ...)), independent of SM count and grid. One block = one row group (RowLayout, at
 * most 512 threads); grid = min(nchunks, resident blocks, grid_cap), blocks grid-stride over chunks.
 * For each row of its chunk, in row order, the block computes dx (bwd_row) and each thread adds
 * the row's dw terms of its own columns into FP32 registers, so every column of a chunk is summed
 * by one thread in row order (twosum: a TwoSum pair per column). The chunk partial goes to
 * workspace[chunk][H] (fp32); twosum also writes the compensation to a second plane after it.
 * Reduce kernel: a block of 32 columns x kSplits warps; warp s sums, in chunk order, the contiguous
 * segment s of the chunks (segments depend only on T) — in FP64 (fp64_fold) or as an FP32 TwoSum
 * pair (twosum) — then warp 0 adds the kSplits segment sums in split order (FP64, or TwoSum) and
 * writes dw (rounded once to the weight dtype).
 * Every sum has an order fixed by T and compile-time constants only: the bits depend only on the
 * inputs, not on SM count, grid_cap or timing.
 * workspace_bytes = align256(planes * nchunks * H * 4), nchunks = ceil(T / kChunkRows), planes = 1
 * (fp64_fold) or 2 (twosum: sums, then compensations).
 */
#ifndef CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CUH
#define CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CUH

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/bwd_row.cuh"
#include "cake_rmsnorm/common.cuh"

namespace cake {

template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks) bwd_pair_kernel(const cake_bwd_args_t a) {
  P::run_main(a);
}
template <class P>
__global__ void __launch_bounds__(P::kReduceThreads) bwd_pair_reduce(const cake_bwd_args_t a) {
  P::run_reduce(a);
}

template <int H, class W, bool kRes, Reduction kR, int kChunkRows>
struct BwdPair {
  static_assert(kChunkRows >= 1, "chunk_rows must be positive");
  static_assert(kR == Reduction::kFp64Fold || kR == Reduction::kTwoSum,
                "pair: reduction must be fp64_fold or twosum");
  using L = RowLayout<H, 512>;
  static constexpr int kThreads = L::kTPR;
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * 128));  // <= 128 registers
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kSplits = 8;  // reduce: chunk segments per column, combined in split order
  static constexpr int kReduceThreads = kSplits * kWarpSize;
  static constexpr int kReduceSmem = kSplits * kWarpSize * 8;  // a double or a TwoSum float pair
  static constexpr int kSmemBytes = cmax(kReduceScratchBytes, kReduceSmem);
  static constexpr int kBlocksPerSm = 1;  // fallback when the occupancy query fails

  __host__ __device__ static int64_t nchunks(int64_t T) { return (T + kChunkRows - 1) / kChunkRows; }
  static constexpr int kPlanes = kR == Reduction::kTwoSum ? 2 : 1;
  static size_t workspace_bytes(int64_t T, int /*sm_count*/) {
    return align256(static_cast<size_t>(kPlanes) * nchunks(T) * H * sizeof(float));
  }

  // This thread's columns of one chunk row (8 floats per vector slot, two 16-byte stores).
  static __device__ __forceinline__ void store_chunk(float* out, const float (&v)[L::kCols], int t) {
#pragma unroll
    for (int k = 0; k < L::kVPT; ++k) {
      if (!L::valid(k, t)) continue;
      float4* o = reinterpret_cast<float4*>(out) + 2 * L::vec(k, t);
      o[0] = make_float4(v[k * kVec + 0], v[k * kVec + 1], v[k * kVec + 2], v[k * kVec + 3]);
      o[1] = make_float4(v[k * kVec + 4], v[k * kVec + 5], v[k * kVec + 6], v[k * kVec + 7]);
    }
  }

  static __device__ __forceinline__ void run_main(const cake_bwd_args_t& a) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const int t = threadIdx.x;
    const int warp = t / kWarpSize;
    const W* w = static_cast<const W*>(a.weight);
    float* part = static_cast<float*>(a.workspace);
    const int64_t nch = nchunks(a.T);
    for (int64_t ch = blockIdx.x; ch < nch; ch += gridDim.x) {
      float acc[L::kCols], comp[L::kCols];
#pragma unroll
      for (int i = 0; i < L::kCols; ++i) acc[i] = comp[i] = 0.f;
      const int64_t row0 = ch * kChunkRows;
      const int rows = static_cast<int>(a.T - row0 < kChunkRows ? a.T - row0 : kChunkRows);
#pragma unroll 1
      for (int r = 0; r < rows; ++r) {  // block-uniform trip count
        const int64_t row = row0 + r;
        const int64_t off = row * H;
        const bf16* dres = kRes && a.dresidual_out ? static_cast<const bf16*>(a.dresidual_out) + off
                                                   : nullptr;
        bwd_row<H, L, W, kRes>(static_cast<const bf16*>(a.dy) + off, static_cast<const bf16*>(a.x) + off,
                               dres, w, __ldg(a.rstd + row), static_cast<bf16*>(a.dx) + off, true, t,
                               scratch, warp, 0, [&](int i, float term, float err) {
                                 if constexpr (kR == Reduction::kTwoSum) {
                                   two_sum_add(acc[i], comp[i], term, err);
                                 } else {
                                   acc[i] += term;
                                 }
                               });
      }
      store_chunk(part + ch * H, acc, t);
      if constexpr (kR == Reduction::kTwoSum) store_chunk(part + (nch + ch) * H, comp, t);
    }
  }

  // The chunk segment [c0, c1) of warp s (depends only on T).
  static __device__ __forceinline__ void segment(int64_t T, int s, int64_t& c0, int64_t& c1) {
    const int64_t nch = nchunks(T);
    const int64_t seg = (nch + kSplits - 1) / kSplits;
    c0 = s * seg;
    c1 = c0 + seg < nch ? c0 + seg : nch;
  }

  // add(v, c) for the chunk partials v = p[c*H], c in [c0, c1), in chunk order (4 loads in flight).
  template <class Add>
  static __device__ __forceinline__ void fold_chunks(const float* p, int64_t c0, int64_t c1, Add&& add) {
    int64_t c = c0;
    for (; c + 4 <= c1; c += 4) {
      const float v0 = __ldcg(p + (c + 0) * H), v1 = __ldcg(p + (c + 1) * H);
      const float v2 = __ldcg(p + (c + 2) * H), v3 = __ldcg(p + (c + 3) * H);
      add(v0, c);
      add(v1, c + 1);
      add(v2, c + 2);
      add(v3, c + 3);
    }
    for (; c < c1; ++c) add(__ldcg(p + c * H), c);
  }

  // Warp 0 adds the kSplits segment sums in split order (FP64) and writes dw; block-wide barriers.
  static __device__ __forceinline__ void combine_splits(const cake_bwd_args_t& a, double* sm, int s,
                                                        int lane, int col, double sum) {
    sm[s * kWarpSize + lane] = sum;
    __syncthreads();
    if (s == 0 && col < H) {
      double v = sm[lane];
#pragma unroll
      for (int i = 1; i < kSplits; ++i) v += sm[i * kWarpSize + lane];
      st_dw(static_cast<W*>(a.dw), col, v);
    }
    __syncthreads();
  }

  // The same with TwoSum pairs (sum, compensation), for the twosum reduction.
  static __device__ __forceinline__ void combine_splits(const cake_bwd_args_t& a, float2* sm, int s,
                                                        int lane, int col, float2 sum) {
    sm[s * kWarpSize + lane] = sum;
    __syncthreads();
    if (s == 0 && col < H) {
      float S = sm[lane].x, C = sm[lane].y;
#pragma unroll
      for (int i = 1; i < kSplits; ++i) two_sum_add(S, C, sm[i * kWarpSize + lane].x, sm[i * kWarpSize + lane].y);
      st_dw(static_cast<W*>(a.dw), col, static_cast<double>(S) + static_cast<double>(C));
    }
    __syncthreads();
  }

  static __device__ __forceinline__ void run_reduce(const cake_bwd_args_t& a) {
    const int lane = threadIdx.x % kWarpSize;
    const int s = threadIdx.x / kWarpSize;
    const float* part = static_cast<const float*>(a.workspace);
    int64_t c0, c1;
    segment(a.T, s, c0, c1);
    constexpr int kTiles = ceil_div(H, kWarpSize);
    for (int tile = blockIdx.x; tile < kTiles; tile += gridDim.x) {
      const int col = tile * kWarpSize + lane;
      const float* p = part + (col < H ? col : 0);
      const int64_t e1 = col < H ? c1 : c0;  // past H: an empty segment, barriers only
      if constexpr (kR == Reduction::kTwoSum) {
        const float* q = p + nchunks(a.T) * H;  // the compensation plane
        float S = 0.f, C = 0.f;
        fold_chunks(p, c0, e1, [&](float v, int64_t c) { two_sum_add(S, C, v, __ldcg(q + c * H)); });
        combine_splits(a, reinterpret_cast<float2*>(dyn_smem()), s, lane, col, make_float2(S, C));
      } else {
        double sum = 0.0;
        fold_chunks(p, c0, e1, [&](float v, int64_t) { sum += static_cast<double>(v); });
        combine_splits(a, reinterpret_cast<double*>(dyn_smem()), s, lane, col, sum);
      }
    }
  }

  // The main kernel alone (BwdPairStaged launches this very kernel, then its own reduce).
  static cudaError_t launch_main(const cake_bwd_args_t& a, cudaStream_t st) {
    int sm = 0;
    cudaError_t e = sm_count(&sm);
    if (e != cudaSuccess) return e;
    const int64_t nch = nchunks(a.T);
    const int64_t full = static_cast<int64_t>(sm) *
        blocks_per_sm(bwd_pair_kernel<BwdPair>, kThreads, kReduceScratchBytes, kBlocksPerSm);
    const int64_t want = nch < full ? nch : full;
    bwd_pair_kernel<BwdPair><<<grid_capped(want, a.grid_cap), kThreads, kReduceScratchBytes, st>>>(a);
    return cudaGetLastError();
  }

  static cudaError_t launch(const cake_bwd_args_t& a, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    cudaError_t e = launch_main(a, st);
    if (e != cudaSuccess) return e;
    bwd_pair_reduce<BwdPair><<<grid_capped(ceil_div(H, kWarpSize), a.grid_cap), kReduceThreads, kReduceSmem, st>>>(a);
    return cudaSuccess;
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_BWD_PAIR_CUH
