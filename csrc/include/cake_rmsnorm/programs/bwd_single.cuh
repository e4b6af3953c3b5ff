/* fast backward (and det's fixed64), single form:
 *   cake::BwdSingle<H, WeightT, kResidual, kReduction, kBlocksPerSm, kBlockRows, kRingRows, kCluster,
 *                   kReplicas, kChunkRows>
 *
 * One kernel; a block is one row group (BwdLayout). grid = min(sm_count * groups per SM, grid_cap, T)
 * with groups per SM = min(blocks_per_sm * max(1, 256 / threads per row), resident blocks) (kCluster
 * > 1: rounded down to whole clusters, at least one, no more than are resident at once). kChunkRows
 * 0: block b takes the contiguous rows [b*per, (b+1)*per), per = ceil(T / grid); kChunkRows > 0:
 * chunks of kChunkRows rows pulled at run time (bwd_row.cuh PulledChunks; grid <= chunks), so
 * faster SMs take more rows. Either way the rows go through the row pipeline
 * (bwd_row.cuh: the next kRingRows rows' dy and x in flight in shared memory). For each row it computes dx
 * (bwd_row_math, the same code as det) and adds the dw terms of its columns into per-thread sums,
 * in the form kReduction names:
 *   fp32          one FP32 sum per column over all the thread's rows (short ranges: small T);
 *   blocked_fp32  FP32 sums of kBlockRows rows, each folded into an FP64 running total, so no FP32
 *                 sum has more than kBlockRows terms (long ranges stay inside the budget);
 *   twosum        an FP32 TwoSum pair (sum + compensation, the product's TwoProduct error too);
 *   fp64_fold     an FP64 sum of the exact products (dy·x)·rstd (dw_add_fp64, as det's pair).
 *   fixed64       a 64-bit integer sum of the exact products rounded to multiples of 2^-34
 *                 (dw_add_fixed): integer addition is associative, so the sum, and dw, has the same
 *                 bits for any grid, chunk order or atomic order: a det program. Each thread also
 *                 keeps the largest term's magnitude; the last block checks that T such terms could
 *                 not have overflowed (fixed_in_range, NaN/Inf included) and otherwise leaves dw to a
 *                 second kernel, det's FP64 column tasks (Fallback: det_pair_c64's dw bits), which
 *                 otherwise exits at once.
 * kBlockRows > 0 exactly for blocked_fp32. Each group then atomicAdd(double)s its totals into one of
 * kReplicas FP64 accumulators [kReplicas][H] in the workspace (block b, or cluster b, into replica
 * b % kReplicas); after a __threadfence the block bumps an atomic counter and the last block to
 * arrive adds the replicas of each column in replica order (FP64) and converts the sum into dw
 * (weight dtype, rounded once).
 * Same-address atomics serialize: with one accumulator each column's additions are a chain as long
 * as the grid (528 at H 1536-2048 on the H200), and the chains, not the bytes, set the kernel's
 * constant cost; kReplicas accumulators cut each chain kReplicas times.
 * kCluster > 1: the blocks run in thread-block clusters of kCluster (sm_90+); each block leaves its
 * totals in its shared memory (the drained row ring), and block r of a cluster adds the cluster's
 * totals of the r-th slice of the columns (distributed shared memory) and atomicAdds those: kCluster
 * times fewer FP64 atomics. Every block adds into the same H addresses at about the same moment,
 * the end of the kernel, and same-address atomics serialize: on the H200 (528 blocks, H 1536,
 * T 1024) fast_single_f64_b2 took 63.6 us, in clusters of 8 22.6 us. With fixed row ranges the
 * clustered programs streamed slower at large T (T 524288: 1234 -> 1360 us): blocks of equal work
 * finish up to 20% apart, and a cluster waits for its slowest block; with pulled chunks they
 * stream as fast as the plain programs. The tuner picks per window.
 * The order of the FP64 atomics is not fixed: dw is not bitwise reproducible (fast backend); dx is.
 * fixed64 adds integers (atomicAdd on unsigned long long, wrapping): bitwise reproducible.
 * The library zeroes the workspace (memsetAsync on the stream) before the kernel.
 * workspace_bytes = align256(kReplicas * H * 8) + 256, independent of T: the accumulators, then the
 * last-block counter, at +64 fixed64's largest magnitude, at +128 the pulled chunks' counter, at +192
 * fixed64's fallback flag.
 */
#ifndef CAKE_RMSNORM_PROGRAMS_BWD_SINGLE_CUH
#define CAKE_RMSNORM_PROGRAMS_BWD_SINGLE_CUH

#include <cooperative_groups.h>

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/bwd_row.cuh"
#include "cake_rmsnorm/common.cuh"
#include "cake_rmsnorm/programs/bwd_column_task.cuh"  // fixed64's fallback
#include "cake_rmsnorm/smem_mode.cuh"

namespace cake {

template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks) bwd_single_kernel(const cake_bwd_args_t a) {
  P::run(a);
}
// fixed64: det's FP64 column tasks for dw, when the fixed-point sums could have left their range.
template <class P>
__global__ void __launch_bounds__(P::Fallback::kThreads, P::Fallback::kMinBlocks)
    bwd_single_fallback_kernel(const cake_bwd_args_t a) {
  P::run_fallback(a);
}

template <int H, class W, bool kRes, Reduction kR, int kBlocksPerSm, int kBlockRows, int kRingRows,
          int kCluster = 1, int kReplicas = 1, int kChunkRows = 0>
struct BwdSingle {
  static_assert(kBlocksPerSm >= 1, "blocks_per_sm must be positive");
  static_assert(kCluster >= 1 && kCluster <= 8, "single: cluster must be 1..8 (the portable cluster sizes)");
  static_assert(kReplicas >= 1 && kReplicas <= 64, "single: replicas must be 1..64");
  static_assert(kR == Reduction::kFp32 || kR == Reduction::kBlockedFp32 || kR == Reduction::kTwoSum ||
                    kR == Reduction::kFp64Fold || kR == Reduction::kFixed64,
                "single: reduction must be fp32, blocked_fp32, twosum, fp64_fold or fixed64");
  static_assert((kR == Reduction::kBlockedFp32) == (kBlockRows > 0),
                "single: block_rows > 0 exactly for blocked_fp32");
  using L = BwdLayout<H>;
  static constexpr int kThreads = L::kTPR;  // one row group per block
  // Row groups per SM asked for: blocks_per_sm "256-thread blocks" worth of groups.
  static constexpr int kGroupsPerSm = kBlocksPerSm * cmax(1, 256 / L::kTPR);
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * 128));  // <= 128 registers
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kPipeBytes = BwdPipe<L, kRes, kRingRows>::kBytes;
  static constexpr bool kPulled = kChunkRows > 0;
  // scratch, the row ring, the staged weight, the pulled chunks' tickets
  static constexpr int kTicketOffset = kReduceScratchBytes + kPipeBytes + StagedWeight<L, W>::kBytes;
  static constexpr int kSmemBytes = kTicketOffset + (kPulled ? kTicketBytes : 0);
  static constexpr size_t kCounterOffset = align256(sizeof(double) * H * kReplicas);
  static constexpr size_t kMagnitudeOffset = kCounterOffset + 64;  // fixed64: the largest term's high word
  static constexpr size_t kTicketCounterOffset = kCounterOffset + 128;
  static constexpr size_t kFallbackOffset = kCounterOffset + 192;  // fixed64: 1 = the column tasks write dw
  static constexpr bool kFixed = kR == Reduction::kFixed64;
  // fixed64's fallback: det's FP64 column tasks (det_column_task_f64_c64s8's dw: det_pair_c64's bits)
  using Fallback = BwdColumnTask<H, W, kRes, Reduction::kFp64Fold, 64, kDetSplits, 0, 2>;
  static_assert(kCluster == 1 || kPipeBytes >= static_cast<int>(sizeof(double)) * H,
                "single: the cluster's totals live in the drained row ring");

  static size_t workspace_bytes(int64_t /*T*/, int /*sm_count*/) { return kCounterOffset + 256; }

  static __device__ __forceinline__ void run(const cake_bwd_args_t& a) {
    if constexpr (kFixed) pdl_allow_dependents();  // the fallback kernel's blocks may wait beside ours
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    uint4* ring = reinterpret_cast<uint4*>(dyn_smem() + kReduceScratchBytes);
    const int t = threadIdx.x;
    const int warp = t / kWarpSize;
    const W* w = static_cast<const W*>(a.weight);
    bf16* dx = static_cast<bf16*>(a.dx);
    unsigned* counter = reinterpret_cast<unsigned*>(static_cast<char*>(a.workspace) + kCounterOffset);

    float blk[L::kCols];   // FP32 sums (the current block's, for blocked_fp32)
    float comp[L::kCols];  // twosum: compensation
    double tot[L::kCols];  // blocked_fp32: FP64 total of the finished blocks; fp64_fold: the sums
    unsigned long long fx[L::kCols];  // fixed64: the sums
    unsigned mag = 0;                 // fixed64: the largest term's high word
#pragma unroll
    for (int i = 0; i < L::kCols; ++i) {
      blk[i] = comp[i] = 0.f;
      tot[i] = 0.0;
      fx[i] = 0;
    }
    int in_block = 0;
    const StagedWeight<L, W> weight(w, dyn_smem() + kReduceScratchBytes + kPipeBytes, t);
    auto on_row = [&](int64_t, int64_t row, const uint4 (&vdy)[L::kVPT], const uint4 (&vx)[L::kVPT],
            const uint4 (&vres)[L::kVPT], bool has_res, float rstd) {
          bwd_row_math<H, L, kRes>(vdy, vx, vres, has_res, weight, rstd, dx + row * H, true, t, scratch,
                                      warp, 0, [&](int i, float p, float r) {
                                        if constexpr (kR == Reduction::kTwoSum) {
                                          dw_add_twosum(blk[i], comp[i], p, r);
                                        } else if constexpr (kR == Reduction::kFp64Fold) {
                                          dw_add_fp64(tot[i], p, r);
                                        } else if constexpr (kFixed) {
                                          dw_add_fixed(fx[i], mag, p, r);
                                        } else {
                                          blk[i] += dw_term(p, r);
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
        };
    bool any;  // this block has rows
    if constexpr (kPulled) {
      any = pulled_rows<H, L, kRes, kRingRows, kChunkRows>(
          a, ring, t, dyn_smem() + kTicketOffset, static_cast<char*>(a.workspace) + kTicketCounterOffset, on_row);
    } else {
      const int64_t per = (a.T + gridDim.x - 1) / gridDim.x;
      const int64_t r0 = static_cast<int64_t>(blockIdx.x) * per;
      const int64_t r1 = r0 + per < a.T ? r0 + per : a.T;
      const int64_t n = r1 > r0 ? r1 - r0 : 0;
      any = n > 0;
      pipelined_rows<H, L, kRes, kRingRows>(a, ring, t, n, [&](int64_t j) { return r0 + j; }, on_row);
    }
    auto total = [&](int i) {
      if constexpr (kFixed) {
        return fx[i];  // zero without rows
      } else {
        return any ? tot[i] + static_cast<double>(blk[i]) + static_cast<double>(comp[i]) : 0.0;
      }
    };
    using Acc = decltype(total(0));  // double, or fixed64's unsigned long long
    Acc* const acc0 = static_cast<Acc*>(a.workspace);
    Acc* acc = acc0 + static_cast<int64_t>((blockIdx.x / kCluster) % kReplicas) * H;  // this block's replica
    if constexpr (kFixed) {
      publish_magnitude(reinterpret_cast<unsigned*>(static_cast<char*>(a.workspace) + kMagnitudeOffset), mag);
    }
    if constexpr (kCluster > 1) {
      cluster_add(acc, reinterpret_cast<Acc*>(dyn_smem() + kReduceScratchBytes), t, total);
    } else if (any) {
#pragma unroll
      for (int k = 0; k < L::kVPT; ++k) {
        if (!L::valid(k, t)) continue;
#pragma unroll
        for (int e = 0; e < kVec; ++e) atomicAdd(acc + L::vec(k, t) * kVec + e, total(k * kVec + e));
      }
    }
    __threadfence();
    __syncthreads();
    int* last = reinterpret_cast<int*>(scratch);
    if (threadIdx.x == 0) *last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (*last) {
      __threadfence();
      if constexpr (kFixed) {
        const unsigned seen = __ldcg(reinterpret_cast<const unsigned*>(static_cast<char*>(a.workspace) + kMagnitudeOffset));
        if (!fixed_in_range(a.T, seen)) {  // the fallback kernel writes dw
          if (threadIdx.x == 0) *reinterpret_cast<unsigned*>(static_cast<char*>(a.workspace) + kFallbackOffset) = 1u;
          return;
        }
      }
      // about 32 loads in flight per thread
      columns_batched<H, kThreads, cmax(1, 32 / kReplicas)>(
          [&](int j) { return sum_in_order<kReplicas>([&](int q) { return __ldcg(acc0 + q * H + j); }); },
          [&](int j, Acc sum) {
            if constexpr (kFixed) {
              st_dw(static_cast<W*>(a.dw), j, fixed_value(sum));
            } else {
              st_dw(static_cast<W*>(a.dw), j, sum);
            }
          });
    }
  }

  // fixed64: once the single kernel has completed, its last block's verdict; out of range, det's FP64
  // column tasks compute dw (their dx writes are not part of this role: dx stays the single's).
  static __device__ __forceinline__ void run_fallback(const cake_bwd_args_t& a) {
    pdl_wait();
    if (__ldcg(reinterpret_cast<const unsigned*>(static_cast<const char*>(a.workspace) + kFallbackOffset)) == 0u) return;
    Fallback::run_cols(a);
  }

  // The cluster's totals into acc: each block's into its shared `mine` [H], then block r adds slice r
  // of the columns over the cluster's blocks (rank order) and atomicAdds it. A block with no rows
  // adds zeros. The second cluster barrier keeps every block's shared memory alive until read.
  template <class Acc, class Total>
  static __device__ __forceinline__ void cluster_add(Acc* acc, Acc* mine, int t, Total&& total) {
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    __syncthreads();  // every thread's last ring reads are done before the ring is overwritten
#pragma unroll
    for (int k = 0; k < L::kVPT; ++k) {
      if (!L::valid(k, t)) continue;
#pragma unroll
      for (int e = 0; e < kVec; ++e) mine[L::vec(k, t) * kVec + e] = total(k * kVec + e);
    }
    cluster.sync();
    constexpr int kSlice = ceil_div(H, kCluster);
    const int j0 = static_cast<int>(cluster.block_rank()) * kSlice;
    const int j1 = j0 + kSlice < H ? j0 + kSlice : H;
    for (int j = j0 + t; j < j1; j += kThreads) {
      atomicAdd(acc + j, sum_in_order<kCluster>([&](int q) { return cluster.map_shared_rank(mine, q)[j]; }));
    }
    cluster.sync();
  }

  // Resident clusters on the device, at least one (queried once per process; a library serves one
  // arch).
  static int resident_clusters() {
    static const int n = [&] {
      cudaLaunchAttribute attr[1];
      const cudaLaunchConfig_t cfg = cluster_config(kCluster, kThreads, kSmemBytes, nullptr, kCluster, attr);
      int c = 0;
      if (cudaOccupancyMaxActiveClusters(&c, bwd_single_kernel<BwdSingle>, &cfg) != cudaSuccess || c < 1) {
        (void)cudaGetLastError();
        c = 1;
      }
      return c;
    }();
    return n;
  }

  static cudaError_t launch_clusters(const cake_bwd_args_t& a, int64_t want, cudaStream_t st) {
    // Whole clusters, all resident at once (the grid is persistent), at least one.
    const int64_t fits = static_cast<int64_t>(resident_clusters()) * kCluster;
    if (want > fits) want = fits;
    if (a.grid_cap > 0 && want > a.grid_cap) want = a.grid_cap;
    const int grid = static_cast<int>(want / kCluster < 1 ? kCluster : want / kCluster * kCluster);
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = cluster_config(grid, kThreads, kSmemBytes, st, kCluster, attr);
    return cudaLaunchKernelEx(&cfg, bwd_single_kernel<BwdSingle>, a);
  }

  static cudaError_t launch(const cake_bwd_args_t& a, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    cudaError_t e = prepare_smem<BwdSingle>(bwd_single_kernel<BwdSingle>, kSmemBytes);
    if (e != cudaSuccess) return e;
    int sm = 0;
    e = sm_count(&sm);
    if (e != cudaSuccess) return e;
    e = cudaMemsetAsync(a.workspace, 0, workspace_bytes(a.T, sm), st);
    if (e != cudaSuccess) return e;
    // One wave: at most the resident blocks (the grid is persistent; each block takes a range).
    const int resident = blocks_per_sm(bwd_single_kernel<BwdSingle>, kThreads, kSmemBytes, 1);
    const int64_t per_sm = kGroupsPerSm < resident ? kGroupsPerSm : resident;
    const int64_t want = static_cast<int64_t>(sm) * per_sm;
    // at most one block per row, or per chunk when the chunks are pulled (each block starts on its own)
    const int64_t units = kPulled ? (a.T + kChunkRows - 1) / kChunkRows : a.T;
    if constexpr (kCluster > 1) {
      e = launch_clusters(a, want < units ? want : units, st);
      if (e != cudaSuccess || !kFixed) return e;
      return launch_fallback(a, st);
    }
    bwd_single_kernel<BwdSingle><<<grid_capped(want < units ? want : units, a.grid_cap), kThreads, kSmemBytes, st>>>(a);
    if constexpr (kFixed) return launch_fallback(a, st);
    return cudaSuccess;
  }

  // fixed64: the fallback kernel, a programmatic dependent of the single (common.cuh): its blocks
  // are scheduled as the single's start and wait there, so in range it costs about one empty
  // kernel's drain, not a launch.
  static cudaError_t launch_fallback(const cake_bwd_args_t& a, cudaStream_t st) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    e = prepare_smem<Fallback>(bwd_single_fallback_kernel<BwdSingle>, Fallback::kSmemBytes);
    if (e != cudaSuccess) return e;
    return launch_dependent(bwd_single_fallback_kernel<BwdSingle>, grid_capped(Fallback::kColTasks, a.grid_cap),
                            Fallback::kThreads, Fallback::kSmemBytes, st, a);
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_BWD_SINGLE_CUH
