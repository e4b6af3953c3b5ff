/* det backward, column-task form (small T): cake::BwdColumnTask<H, WeightT, kResidual,
 * kReduction, kColsPerBlock, kRowSplits, kStageChunk, kLaunches>  (reduction twosum, fp64_fold or
 * fixed64)
 *
 * One launch of tasks of two roles (grid-stride over tasks when grid_cap is smaller):
 *  - column tasks 0 .. ceil(H/kColsPerBlock)-1: task c owns dw columns [c*kColsPerBlock, ...).
 *    The rows are cut as the det pair cuts them: chunks of kDetChunkRows rows, and kRowSplits
 *    contiguous segments of chunks (chunk_segment). Warp s walks segment s chunk by chunk in row
 *    order; lane l holds kColsPerBlock/32 adjacent columns and sums each chunk from zero exactly as
 *    the pair's main kernel does — a TwoSum pair (twosum: dw_add_twosum) or an FP64 sum of exact
 *    products (fp64_fold: dw_add_fp64) — then folds the chunk into its segment sum as the pair's
 *    reduce does. Warp 0 combines the kRowSplits sums in split order (TwoSum, or FP64) and writes
 *    dw (one rounding to the weight dtype). With row_splits = 8 (the pair's kSplits) these are the
 *    pair's operations in the pair's order: dw has BwdPair<..., 64>'s bits, and dx too (the same
 *    bwd_row code and BwdLayout).
 *  - row tasks: kGroups row groups per block compute dx for one row each (bwd_row, shared with the
 *    other backward forms; the dw terms are ignored there).
 * With launches = 2 the two roles are two kernels that run side by side (see kLaunches below); the
 * additions are the same.
 * fixed64: each lane also sums its columns' terms as 64-bit integers (dw_add_fixed, as BwdSingle's
 * fixed64) and keeps the largest term's magnitude; a task leaves both sums of its columns in the
 * workspace, and the last task to finish writes every dw from the integer sums, or, where they
 * could have overflowed, from the FP64 ones: BwdSingle<..., kFixed64, ...>'s bits either way.
 * Every order is fixed by T and compile-time constants: bitwise reproducible, independent of SM
 * count and grid. workspace_bytes = 0 (fixed64: align256(16 H) + 256).
 */
#ifndef CAKE_RMSNORM_PROGRAMS_BWD_COLUMN_TASK_CUH
#define CAKE_RMSNORM_PROGRAMS_BWD_COLUMN_TASK_CUH

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/bwd_row.cuh"
#include "cake_rmsnorm/common.cuh"
#include "cake_rmsnorm/programs/bwd_pair.cuh"  // chunk_segment: the pair's cut of the chunks
#include "cake_rmsnorm/smem_mode.cuh"

namespace cake {

template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks) bwd_column_task_kernel(const cake_bwd_args_t a) {
  P::run(a);
}
// launches = 2: the row tasks and the column tasks as two kernels (below).
template <class P>
__global__ void __launch_bounds__(P::kRowThreads) bwd_column_rows_kernel(const cake_bwd_args_t a) {
  P::run_rows(a);
}
template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks) bwd_column_cols_kernel(const cake_bwd_args_t a) {
  P::run_cols(a);
}

template <int H, class W, bool kRes, Reduction kR, int kColsPerBlock, int kRowSplits, int kStageChunk,
          int kLaunches>
struct BwdColumnTask {
  static_assert(kR == Reduction::kTwoSum || kR == Reduction::kFp64Fold || kR == Reduction::kFixed64,
                "column_task: reduction must be twosum, fp64_fold or fixed64");
  static constexpr bool kFixed = kR == Reduction::kFixed64;
  static constexpr int kCPL = kColsPerBlock / kWarpSize;  // columns per lane
  static_assert(kColsPerBlock % kWarpSize == 0 && (kCPL == 1 || kCPL == 2 || kCPL == 4 || kCPL == 8),
                "cols_per_block must be 32, 64, 128 or 256");
  static_assert(kRowSplits == kDetSplits, "row_splits must be det's kDetSplits (8): the pair's cut");
  using L = BwdLayout<H>;
  static constexpr int kChunkRows = kDetChunkRows;  // the pair's chunks (same bits)
  static constexpr int kBatch = L::kTPR > 256 ? 8 : 16;  // rows loaded ahead in a column walk (registers)
  static constexpr int kThreads = cmax(kRowSplits * kWarpSize, L::kTPR);
  static_assert(kThreads <= 1024, "block too large");
  static constexpr int kMinBlocks = 1;  // small T: few blocks; registers go to the rows loaded ahead
  static constexpr int kGroups = kThreads / L::kTPR;  // row groups of a row task
  // launches = 2: the row tasks run in a kernel of their own (no column-task shared memory or
  // registers to hold their occupancy down), launched first; the column kernel is launched as its
  // programmatic dependent (common.cuh), scheduled as soon as every row block has started, so the
  // two run side by side. It reads nothing the row kernel writes, and waits for it (pdl_wait) only
  // before it exits: whatever follows on the stream then finds dx complete too.
  static_assert(kLaunches == 1 || kLaunches == 2, "launches must be 1 or 2");
  static constexpr int kRowGroups = cmax(1, 256 / L::kTPR);
  static constexpr int kRowThreads = kRowGroups * L::kTPR;
  static constexpr int kColTasks = ceil_div(H, kColsPerBlock);
  // per split and column: a TwoSum float pair or a double (fixed64: a double and a 64-bit integer)
  static constexpr int kColSmem = kRowSplits * kColsPerBlock * (kFixed ? 16 : 8);
  static_assert(kStageChunk == 0 || kStageChunk == 1, "stage_chunk must be 0 or 1");
  // stage_chunk = 1: a warp copies a whole chunk of its columns (dy, x as bf16, then rstd) into its
  // own shared-memory stage with cp.async, every row in flight at once, then sums it from there:
  // one memory round trip per chunk instead of one per kBatch rows.
  static constexpr int kTileRowBytes = kColsPerBlock * 2;  // one tensor's bytes of a row in a task
  static constexpr int kWarpStage = 2 * kChunkRows * kTileRowBytes + kChunkRows * 4;
  static constexpr int kStageSmem = kStageChunk ? kRowSplits * kWarpStage : 0;
  static_assert(!kStageChunk || H % kColsPerBlock == 0,
                "stage_chunk needs whole column tiles: every lane of a warp takes part in its copies");
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kSmemBytes = cmax(kReduceScratchBytes, kColSmem + kStageSmem);

  // fixed64: each column's integer sum [H] and FP64 sum [H], then the tasks' counter and, 64 bytes on,
  // the largest term's high word (the last column task decides between the two, as the single does)
  static constexpr size_t kFixedSums = align256(static_cast<size_t>(H) * 16);
  static size_t workspace_bytes(int64_t /*T*/, int /*sm_count*/) { return kFixed ? kFixedSums + 256 : 0; }

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

  // Copy rows [r0, r1) of the task's columns [c0, c0 + kColsPerBlock) (16-byte pieces; pieces past
  // H are not copied, their columns are never read) and their rstd into this warp's stage; returns
  // once they have landed and the warp has synchronised.
  static __device__ __forceinline__ void stage_chunk(const cake_bwd_args_t& a, unsigned char* stage, int64_t r0,
                                                     int64_t r1, int c0, int lane) {
    constexpr int kPieces = kTileRowBytes / 16;
    bf16* sdy = reinterpret_cast<bf16*>(stage);
    bf16* sx = sdy + kChunkRows * kColsPerBlock;
    float* srstd = reinterpret_cast<float*>(sx + kChunkRows * kColsPerBlock);
    const bf16* dy = static_cast<const bf16*>(a.dy) + c0;
    const bf16* x = static_cast<const bf16*>(a.x) + c0;
    const int n = static_cast<int>(r1 - r0);
    for (int i = lane; i < n * kPieces; i += kWarpSize) {
      const int row = i / kPieces, piece = i % kPieces;
      if (c0 + piece * kVec >= H) continue;
      const int64_t off = (r0 + row) * H + piece * kVec;
      cp_async16(sdy + row * kColsPerBlock + piece * kVec, dy + off);
      cp_async16(sx + row * kColsPerBlock + piece * kVec, x + off);
    }
    for (int i = lane; i < n; i += kWarpSize) cp_async4(srstd + i, a.rstd + r0 + i);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
  }

  template <int N>
  static __device__ __forceinline__ void ld_shared_cols(const bf16* p, float (&f)[N]) {
#pragma unroll
    for (int e = 0; e < N; ++e) f[e] = __bfloat162float(p[e]);
  }

  // add(e, p, rstd) for rows [r0, r1) in row order, p = dy·x of this lane's column e: the chunk
  // copied whole into this warp's stage first (stage_chunk = 1).
  template <class Add>
  static __device__ __forceinline__ void walk_chunk_staged(const cake_bwd_args_t& a, int task, int s, int lane,
                                                           int64_t r0, int64_t r1, Add&& add) {
    unsigned char* stage = dyn_smem() + kColSmem + s * kWarpStage;
    stage_chunk(a, stage, r0, r1, task * kColsPerBlock, lane);
    const bf16* sdy = reinterpret_cast<const bf16*>(stage) + lane * kCPL;
    const bf16* sx = sdy + kChunkRows * kColsPerBlock;
    const float* srstd = reinterpret_cast<const float*>(stage + 2 * kChunkRows * kTileRowBytes);
    // Unrolled: the shared-memory loads of 8 rows go ahead of their additions (rolled, each row's
    // loads wait behind the previous row's FP64 add).
#pragma unroll 8
    for (int i = 0; i < static_cast<int>(r1 - r0); ++i) {
      float fdy[kCPL], fx[kCPL];
      ld_shared_cols<kCPL>(sdy + i * kColsPerBlock, fdy);
      ld_shared_cols<kCPL>(sx + i * kColsPerBlock, fx);
      const float rstd = srstd[i];
#pragma unroll
      for (int e = 0; e < kCPL; ++e) add(e, __fmul_rn(fdy[e], fx[e]), rstd);
    }
    __syncwarp();  // the stage is read before the next chunk's copies land in it
  }

  // The same from global memory: kBatch rows' loads in flight at once, then their terms added in
  // row order (the walk is bound by memory latency, not by the sequential additions); the next
  // batch (up to seg_end) is prefetched to L2 meanwhile. dy, x: this lane's first column.
  template <class Add>
  static __device__ __forceinline__ void walk_chunk_batched(const cake_bwd_args_t& a, const bf16* dy, const bf16* x,
                                                            int64_t r0, int64_t r1, int64_t seg_end, Add&& add) {
    for (int64_t rb = r0; rb < r1; rb += kBatch) {
      float rstd[kBatch], fdy[kBatch][kCPL], fx[kBatch][kCPL];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int64_t next = rb + kBatch + i;
        if (next < seg_end) {
          prefetch_l2(dy + next * H);
          prefetch_l2(x + next * H);
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int64_t row = rb + i < r1 ? rb + i : r1 - 1;  // past the chunk: loaded, not added
        rstd[i] = __ldg(a.rstd + row);
        ld_cols<kCPL>(dy + row * H, fdy[i]);
        ld_cols<kCPL>(x + row * H, fx[i]);
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        // A row past the chunk adds a zero term, an exact no-op (a sum started at +0 is never -0).
        // No branch: with one, the compiler sinks each row's loads behind the previous row's
        // additions and the walk waits one memory latency per row.
        const bool live = rb + i < r1;
#pragma unroll
        for (int e = 0; e < kCPL; ++e) add(e, live ? __fmul_rn(fdy[i][e], fx[i][e]) : 0.f, rstd[i]);
      }
    }
  }

  static __device__ __forceinline__ void column_task(const cake_bwd_args_t& a, int task) {
    // [kRowSplits][kColsPerBlock]: float2 (sum, compensation) for twosum, double for fp64_fold
    float2* pairs = reinterpret_cast<float2*>(dyn_smem());
    double* fold = reinterpret_cast<double*>(dyn_smem());
    unsigned long long* qfold = reinterpret_cast<unsigned long long*>(fold + kRowSplits * kColsPerBlock);
    unsigned mag = 0;  // fixed64: the largest term's high word (dw_add_fixed)
    const int lane = threadIdx.x % kWarpSize;
    const int s = threadIdx.x / kWarpSize;
    const int cl = lane * kCPL;                       // first column of this lane in the task
    const int col = task * kColsPerBlock + cl;
    if (s < kRowSplits) {
      float sum[kCPL], comp[kCPL];  // twosum: this split's pair
      double dsum[kCPL];            // fp64_fold (and fixed64's fallback): this split's sum
      unsigned long long q[kCPL];   // fixed64: this split's integer sum (any order: exact)
#pragma unroll
      for (int e = 0; e < kCPL; ++e) {
        sum[e] = comp[e] = 0.f;
        dsum[e] = 0.0;
        q[e] = 0;
      }
      if (col < H) {
        int64_t c0, c1;
        chunk_segment<kRowSplits>(ceil_div64(a.T, kChunkRows), s, c0, c1);
        const bf16* dy = static_cast<const bf16*>(a.dy) + col;
        const bf16* x = static_cast<const bf16*>(a.x) + col;
        const int64_t seg_end = c1 * kChunkRows < a.T ? c1 * kChunkRows : a.T;  // the segment's rows
        for (int64_t c = c0; c < c1; ++c) {  // the pair's chunks, in chunk order
          const int64_t r0 = c * kChunkRows;
          const int64_t r1 = r0 + kChunkRows < a.T ? r0 + kChunkRows : a.T;
          float cs[kCPL], cc[kCPL];  // the chunk's sum, from zero, as the pair's main kernel has it
          double cd[kCPL];
#pragma unroll
          for (int e = 0; e < kCPL; ++e) {
            cs[e] = cc[e] = 0.f;
            cd[e] = 0.0;
          }
          auto add_term = [&](int e, float p, float rstd) {
            if constexpr (kR == Reduction::kTwoSum) {
              dw_add_twosum(cs[e], cc[e], p, rstd);
            } else {
              dw_add_fp64(cd[e], p, rstd);
              if constexpr (kFixed) dw_add_fixed(q[e], mag, p, rstd);
            }
          };
          if constexpr (kStageChunk) {
            walk_chunk_staged(a, task, s, lane, r0, r1, add_term);
          } else {
            walk_chunk_batched(a, dy, x, r0, r1, seg_end, add_term);
          }
#pragma unroll
          for (int e = 0; e < kCPL; ++e) {  // the pair's reduce: fold the chunk into the split
            if constexpr (kR == Reduction::kTwoSum) {
              two_sum_add(sum[e], comp[e], cs[e], cc[e]);
            } else {
              dsum[e] += cd[e];
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
          if constexpr (kFixed) qfold[s * kColsPerBlock + cl + e] = q[e];
        }
      }
    }
    if constexpr (kFixed) publish_magnitude(fixed_magnitude(a), mag);
    __syncthreads();
    if (s == 0 && col < H) {  // the pair's combine_splits: split sums in split order
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
        if constexpr (kFixed) {  // both sums to the workspace; the last task picks
          unsigned long long qs = 0;
          for (int i = 0; i < kRowSplits; ++i) qs += qfold[i * kColsPerBlock + cl + e];
          fixed_sums(a)[col + e] = qs;
          reinterpret_cast<double*>(fixed_sums(a) + H)[col + e] = v;
        } else {
          st_dw(static_cast<W*>(a.dw), col + e, v);
        }
      }
    }
    if constexpr (kFixed) finish_fixed(a);
    __syncthreads();
  }

  // fixed64's workspace (workspace_bytes)
  static __device__ __forceinline__ unsigned long long* fixed_sums(const cake_bwd_args_t& a) {
    return static_cast<unsigned long long*>(a.workspace);
  }
  static __device__ __forceinline__ unsigned* fixed_magnitude(const cake_bwd_args_t& a) {
    return reinterpret_cast<unsigned*>(static_cast<char*>(a.workspace) + kFixedSums + 64);
  }
  // After a column task has left its sums: the last of the kColTasks tasks writes every column's dw,
  // the fixed-point sum where T terms of the largest magnitude seen could not overflow it
  // (fixed_in_range, as BwdSingle's last block decides: the same bits), else the FP64 one.
  static __device__ __forceinline__ void finish_fixed(const cake_bwd_args_t& a) {
    int* last = reinterpret_cast<int*>(dyn_smem());  // the split sums are read by now (barrier below)
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned* done = reinterpret_cast<unsigned*>(static_cast<char*>(a.workspace) + kFixedSums);
      *last = atomicAdd(done, 1u) == kColTasks - 1;
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    const bool exact = fixed_in_range(a.T, __ldcg(fixed_magnitude(a)));
    const unsigned long long* q = fixed_sums(a);
    const double* v = reinterpret_cast<const double*>(q + H);
    columns_batched<H, kThreads, 16>([&](int j) { return exact ? fixed_value(__ldcg(q + j)) : __ldcg(v + j); },
                                     [&](int j, double d) { st_dw(static_cast<W*>(a.dw), j, d); });
  }

  template <int kG>  // row groups per block
  static __device__ __forceinline__ void row_task(const cake_bwd_args_t& a, int64_t task) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const int g = threadIdx.x / L::kTPR;
    const int t = threadIdx.x % L::kTPR;
    const int warp = threadIdx.x / kWarpSize;
    const int64_t row = task * kG + g;
    const bool active = g < kG && row < a.T;  // threads past kG*kTPR idle (barriers only)
    const int64_t off = active ? row * H : 0;
    const bf16* dres = kRes && a.dresidual_out ? static_cast<const bf16*>(a.dresidual_out) + off : nullptr;
    prefetch_weight_small_t<L>(static_cast<const W*>(a.weight), t, a.T);
    bwd_row<H, L, W, kRes>(static_cast<const bf16*>(a.dy) + off, static_cast<const bf16*>(a.x) + off, dres,
                           static_cast<const W*>(a.weight), active ? __ldg(a.rstd + row) : 0.f,
                           static_cast<bf16*>(a.dx) + off, active, t, scratch, warp,
                           g < kG ? g * L::kWarps : 0, [](int, float, float) {});
  }

  static __device__ __forceinline__ void run(const cake_bwd_args_t& a) {
    const int64_t tasks = kColTasks + (a.T + kGroups - 1) / kGroups;
    for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {  // block-uniform
      if (task < kColTasks) {
        column_task(a, static_cast<int>(task));
      } else {
        row_task<kGroups>(a, task - kColTasks);
      }
    }
  }

  static __device__ __forceinline__ void run_rows(const cake_bwd_args_t& a) {
    pdl_allow_dependents();  // the column kernel needs nothing of ours: let it be scheduled now
    const int64_t tasks = (a.T + kRowGroups - 1) / kRowGroups;
    for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) row_task<kRowGroups>(a, task);
  }
  static __device__ __forceinline__ void run_cols(const cake_bwd_args_t& a) {
    for (int task = blockIdx.x; task < kColTasks; task += gridDim.x) column_task(a, task);
    pdl_wait();  // complete only after the row kernel: the stream's next work may read dx
  }

  static cudaError_t launch(const cake_bwd_args_t& a, cudaStream_t st) {
    if (a.T <= 0) return cudaSuccess;
    if constexpr (kFixed) {  // the counter and the magnitude (the sums are written whole)
      const cudaError_t e = cudaMemsetAsync(static_cast<char*>(a.workspace) + kFixedSums, 0, 256, st);
      if (e != cudaSuccess) return e;
    }
    if constexpr (kLaunches == 2) {
      cudaError_t e = prepare_smem<BwdColumnTask>(bwd_column_cols_kernel<BwdColumnTask>, kSmemBytes);
      if (e != cudaSuccess) return e;
      const int64_t rows = (a.T + kRowGroups - 1) / kRowGroups;
      bwd_column_rows_kernel<BwdColumnTask><<<grid_capped(rows < 0x7fffffffLL ? rows : 0x7fffffffLL, a.grid_cap),
                                              kRowThreads, kReduceScratchBytes, st>>>(a);
      e = cudaGetLastError();
      if (e != cudaSuccess) return e;
      return launch_dependent(bwd_column_cols_kernel<BwdColumnTask>, grid_capped(kColTasks, a.grid_cap), kThreads,
                              kSmemBytes, st, a);
    } else {
      const cudaError_t e = prepare_smem<BwdColumnTask>(bwd_column_task_kernel<BwdColumnTask>, kSmemBytes);
      if (e != cudaSuccess) return e;
      const int64_t tasks = kColTasks + (a.T + kGroups - 1) / kGroups;
      const int64_t want = tasks < 0x7fffffffLL ? tasks : 0x7fffffffLL;
      bwd_column_task_kernel<BwdColumnTask><<<grid_capped(want, a.grid_cap), kThreads, kSmemBytes, st>>>(a);
      return cudaSuccess;
    }
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_BWD_COLUMN_TASK_CUH
