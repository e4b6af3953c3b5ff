/* Forward: three program forms over one row layout and one order of operations, so they give the
 * same bits.
 *
 *   cake::Forward<H, WeightT, kResidual, kReduction (fp32), kRowsPerBlock, kWeightAhead, kRowsPerThread,
 *                 kL2EvictLast>
 *     A block holds rows = min(kRowsPerBlock, 1024 / threads per row) row groups; group g of block
 *     b normalises rows b*rows*kRowsPerThread + g + i*rows (i < kRowsPerThread), loading all their
 *     vectors straight from global memory before the first is reduced (more bytes in flight where
 *     a row is one warp's 16-byte vectors), then reducing them side by side (group_sums_once;
 *     reduced one row after another, the SASS ran each row's shuffles, square root and division
 *     only after the previous row's stores, so a warp waited the rows' chains in turn).
 *     grid = ceil(T / (rows * kRowsPerThread)).
 *     kWeightAhead 1: the weight is loaded with x, before the reduction.
 *     kL2EvictLast 1: x and the residual are loaded with an L2 evict_last policy (below).
 *   cake::ForwardSplit<H, WeightT, kResidual, kReduction (fp32), kRowsPerBlock, kWeightAhead, kL2EvictLast>
 *     Forward's rows with two threads per layout thread (half the registers each, twice the
 *     threads a row); the sum of squares is handed from the first to the second of each pair.
 *   cake::ForwardRing<H, WeightT, kResidual, kReduction (fp32), kBlocksPerSm>
 *     Persistent: a block is one row group; grid = sm_count * min(kBlocksPerSm, resident blocks),
 *     block b takes rows b, b + grid, ... through a ring of the next rows in shared memory
 *     (row_ring.cuh: 5 rows of x ahead, or 2 rows of x and residual), so DRAM stays busy while a
 *     row is reduced and written.
 *
 * L2 eviction priority: x and the residual are read once, but loading them evict_last lets the L2
 * evict (write back) its dirty lines first, so y's writes stream out alongside the reads. H200,
 * interleaved with torch.compile's kernel (which also loads x evict_last): fwd_rows1 at H 8192,
 * T 262144 1982 against 2066 us; up to 4% faster at H 1536-8192 from T 65536; at T 4096, where the
 * rows fit in L2, 0-8% slower. So it is a program parameter and the tuner picks per window.
 *
 * Row layout: FwdLayout<H> (at most 4 16-byte vectors per thread, coalesced) in every form.
 * Math (FP32): h = bf16(x + r) (written to residual_out), ss = Σ h² in a fixed order (per thread
 * in index order, xor butterfly, warps in order), rstd = 1 / sqrtf(ss / H + eps) (correctly rounded:
 * built with --prec-div=true --prec-sqrt=true), y = bf16((h·rstd)·w). The order is fixed by the
 * layout, which every form shares, so y and rstd are bitwise reproducible and independent of the
 * launch and of the form.
 */
#ifndef CAKE_RMSNORM_PROGRAMS_FORWARD_CUH
#define CAKE_RMSNORM_PROGRAMS_FORWARD_CUH

#include <type_traits>

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/common.cuh"
#include "cake_rmsnorm/row_ring.cuh"
#include "cake_rmsnorm/row_weight.cuh"
#include "cake_rmsnorm/smem_mode.cuh"

namespace cake {

// A vector of x or the residual, with kL2EvictLast's policy or without.
template <int kL2EvictLast>
struct InputLoad {
  static_assert(kL2EvictLast == 0 || kL2EvictLast == 1, "l2_evict_last must be 0 or 1");
  uint64_t policy = kL2EvictLast ? l2_policy_evict_last() : 0;
  __device__ __forceinline__ uint4 operator()(const bf16* row, int v) const {
    return kL2EvictLast ? ld_vec_hinted(row, v, policy) : ld_vec(row, v);
  }
};

template <class P>
__global__ void __launch_bounds__(P::kThreads, P::kMinBlocks) forward_kernel(const cake_fwd_args_t a) {
  P::run(a);
}

// A block for every `rows` rows of T (Forward, ForwardSplit: grid = ceil(T / rows)).
template <class P>
cudaError_t launch_row_blocks(const cake_fwd_args_t& a, cudaStream_t s, int64_t rows) {
  if (a.T <= 0) return cudaSuccess;
  const int64_t blocks = ceil_div64(a.T, rows);
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  forward_kernel<P><<<static_cast<unsigned>(blocks), P::kThreads, P::kSmemBytes, s>>>(a);
  return cudaSuccess;
}

// One vector of a row: h = bf16(x + r) into vh (x itself without residual), and h's squares
// added to ss in index order. Every forward form sums a row through this, in the layout's order.
template <bool kRes>
__device__ __forceinline__ void add_squares(uint4& vh, const uint4& vr, float& ss) {
  float fh[kVec];
  if constexpr (kRes) {
    float fr[kVec];
    unpack8(vh, fh);
    unpack8(vr, fr);
#pragma unroll
    for (int e = 0; e < kVec; ++e) fh[e] = fh[e] + fr[e];
    vh = pack8(fh);
  }
  unpack8(vh, fh);
#pragma unroll
  for (int e = 0; e < kVec; ++e) ss += fh[e] * fh[e];
}

// One vector of a row's outputs: h to residual_out (with residual), then y = bf16((h·rstd)·w) with
// w from load_w(fw) (after that store, as ptxas best schedules the residual forms).
template <bool kRes, class LoadW>
__device__ __forceinline__ void store_outputs(bf16* y, bf16* ro, int v, const uint4& vh, float rstd,
                                              LoadW&& load_w) {
  if constexpr (kRes) st_vec(ro, v, vh);
  float fh[kVec], fw[kVec], fy[kVec];
  unpack8(vh, fh);
  load_w(fw);
#pragma unroll
  for (int e = 0; e < kVec; ++e) fy[e] = (fh[e] * rstd) * fw[e];
  st_vec(y, v, pack8(fy));
}

// A row's part of its sum of squares: this thread's vectors in index order (h = bf16(x + r) into
// vh with a residual); 0 where the row does not exist.
template <class L, bool kRes>
__device__ __forceinline__ float row_squares(uint4 (&vh)[L::kVPT], const uint4 (&vr)[L::kVPT], int t,
                                             bool active) {
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    if (active && L::valid(k, t)) add_squares<kRes>(vh[k], vr[k], ss);
  }
  return ss;
}

// rstd from a row's summed squares (correctly rounded square root and division).
template <int H>
__device__ __forceinline__ float row_rstd(float ss, float eps) {
  return 1.0f / sqrtf(ss / static_cast<float>(H) + eps);
}

// A row's outputs: rstd, then h (with residual) and y for this thread's vectors. weight(k, fw):
// this thread's k-th weight vector as 8 floats (row_weight.cuh: GlobalWeight loads it now,
// HeldWeight has it in registers, loaded with x).
template <int H, class L, bool kRes, class Weight>
__device__ __forceinline__ void row_outputs(const cake_fwd_args_t& a, int64_t row, const uint4 (&vh)[L::kVPT],
                                            int t, float rstd, Weight&& weight) {
  if (t == 0) a.rstd[row] = rstd;
  const int64_t off = row * H;
  bf16* y = static_cast<bf16*>(a.y) + off;
  bf16* ro = kRes ? static_cast<bf16*>(a.residual_out) + off : nullptr;
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    if (L::valid(k, t))
      store_outputs<kRes>(y, ro, L::vec(k, t), vh[k], rstd, [&](float (&fw)[kVec]) { weight(k, fw); });
  }
}

// One row: vh (and vr) are this thread's vectors of x (and residual). Every thread of the block
// calls it (group_sum's barriers); `active` = the row exists.
template <int H, class L, bool kRes, class Weight>
__device__ __forceinline__ void forward_row(const cake_fwd_args_t& a, int64_t row, bool active,
                                            uint4 (&vh)[L::kVPT], const uint4 (&vr)[L::kVPT], int t,
                                            float* scratch, int warp, int warp0, Weight&& weight) {
  float ss = row_squares<L, kRes>(vh, vr, t, active);
  ss = group_sum<L::kWarps>(ss, scratch, warp, warp0);
  if (active) row_outputs<H, L, kRes>(a, row, vh, t, row_rstd<H>(ss, a.eps), weight);
}

template <int H, class W, bool kRes, Reduction kR, int kRowsPerBlock, int kWeightAhead, int kRowsPerThread,
          int kL2EvictLast>
struct Forward {
  static_assert(kR == Reduction::kFp32, "forward: reduction must be fp32");
  static_assert(kRowsPerBlock >= 1 && kRowsPerBlock <= 32, "rows_per_block out of range");
  static_assert(kWeightAhead == 0 || kWeightAhead == 1, "weight_ahead must be 0 or 1");
  static_assert(kRowsPerThread >= 1 && kRowsPerThread <= 8, "rows_per_thread out of range");
  using L = FwdLayout<H>;
  static constexpr int kRows = cmin(kRowsPerBlock, 1024 / L::kTPR);  // row groups per block
  static constexpr int kThreads = kRows * L::kTPR;
  static constexpr int kBlockRows = kRows * kRowsPerThread;  // group g: rows g, g + kRows, ...
  // <= 64 registers; weight_ahead holds 8 * kVPT more floats: <= 96
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * (kWeightAhead ? 96 : 64)));
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kSmemBytes = kReduceScratchBytes * kRowsPerThread;  // group_sums_once's

  static __device__ __forceinline__ void run(const cake_fwd_args_t& a) {
    // every block but the last holds kBlockRows rows: those run without a check a row (a uniform
    // branch: the whole block takes it, as group_sums_once's barrier needs)
    const int64_t first = static_cast<int64_t>(blockIdx.x) * kBlockRows;
    if (kBlockRows == 1 || a.T - first >= kBlockRows) {
      rows<true>(a, first);
    } else {
      rows<false>(a, first);
    }
  }

  // The block's rows from `first`; kWhole: all kBlockRows of them exist.
  template <bool kWhole>
  static __device__ __forceinline__ void rows(const cake_fwd_args_t& a, int64_t first) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const int g = threadIdx.x / L::kTPR;
    const int t = threadIdx.x % L::kTPR;
    const int64_t row0 = first + g;
    const W* w = static_cast<const W*>(a.weight);
    if constexpr (!kWeightAhead) prefetch_weight_small_t<L>(w, t, a.T);
    // this group's i-th row, and whether it exists. Row i is i * kRows rows past row0: one 64-bit
    // address a tensor and constant offsets from it, so the first load issues a few instructions
    // in (torch.compile's H 256 kernel: 12; with an address and a clamp a row, ours was 70)
    auto row_of = [&](int i) { return row0 + i * kRows; };
    const int64_t rows_left = a.T - row0;
    auto exists = [&](int i) { return kWhole || i * kRows < rows_left; };
    const InputLoad<kL2EvictLast> load;
    const bf16* x0 = static_cast<const bf16*>(a.x) + row0 * H;
    const bf16* r0 = kRes ? static_cast<const bf16*>(a.residual) + row0 * H : nullptr;
    // every row's vectors are loaded before the first row is reduced; a missing row's are zeros
    uint4 vh[kRowsPerThread][L::kVPT], vr[kRowsPerThread][L::kVPT];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t off = static_cast<int64_t>(i) * kRows * H;
#pragma unroll
      for (int k = 0; k < L::kVPT; ++k) {
        const bool live = exists(i) && L::valid(k, t);
        vh[i][k] = live ? load(x0 + off, L::vec(k, t)) : make_uint4(0, 0, 0, 0);
        vr[i][k] = kRes && live ? load(r0 + off, L::vec(k, t)) : make_uint4(0, 0, 0, 0);
      }
    }
    using Weight = typename std::conditional<kWeightAhead != 0, HeldWeight<L, W>, GlobalWeight<L, W>>::type;
    const Weight weight{w, t};
    // every row's squares, their group sums side by side (group_sums_once), every rstd, then
    // every row's outputs: forward_row's operations for each row, without a row's reduction
    // waiting for the previous row's stores. A missing row's zeros sum to +0 (never stored), so
    // the squares need no check a row.
    float ss[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) ss[i] = row_squares<L, kRes>(vh[i], vr[i], t, true);
    group_sums_once<L::kWarps>(ss, scratch, threadIdx.x / kWarpSize, g * L::kWarps);
    float rstd[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) rstd[i] = row_rstd<H>(ss[i], a.eps);
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      if (exists(i)) row_outputs<H, L, kRes>(a, row_of(i), vh[i], t, rstd[i], weight);
    }
  }

  static cudaError_t launch(const cake_fwd_args_t& a, cudaStream_t s) {
    return launch_row_blocks<Forward>(a, s, kBlockRows);
  }
};

// forward_row's row with twice the threads: the layout's thread t is two threads, t (its vectors
// k < kHalf) and t + kTPR (the rest), so each holds half the registers (32; a row of H 8192 is
// then 512 threads, 4 rows an SM: every warp slot used, where Forward's 64 registers fill half).
// t's running sum of squares is handed to t + kTPR through shared memory, which continues the
// same chain over its vectors; those threads then sum over the row as forward_row's warps do. The
// same operations in the same order: y, h and rstd have forward_row's bits.
template <int H, class W, bool kRes, Reduction kR, int kRowsPerBlock, int kWeightAhead, int kL2EvictLast>
struct ForwardSplit {
  static_assert(kR == Reduction::kFp32, "forward: reduction must be fp32");
  static_assert(kWeightAhead == 0 || kWeightAhead == 1, "weight_ahead must be 0 or 1");
  using L = FwdLayout<H>;
  static constexpr int kHalf = (L::kVPT + 1) / 2;  // vectors of the first thread of a pair
  static constexpr int kGroupThreads = 2 * L::kTPR;
  static_assert(kGroupThreads <= 1024, "forward_split: a row's threads must fit a block");
  static constexpr int kRows = cmin(kRowsPerBlock, 1024 / kGroupThreads);
  static constexpr int kThreads = kRows * kGroupThreads;
  // <= 32 registers (x: 4 per vector); weight_ahead holds 8 more floats a vector: <= 64
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * (kWeightAhead ? 64 : 32)));
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kChainBytes = 512 * 4;  // a float per thread pair, up to 1024 threads
  static constexpr int kSmemBytes = kChainBytes + kReduceScratchBytes;

  static __device__ __forceinline__ void run(const cake_fwd_args_t& a) {
    float* chain = reinterpret_cast<float*>(dyn_smem());
    float* scratch = reinterpret_cast<float*>(dyn_smem() + kChainBytes);
    const int g = threadIdx.x / kGroupThreads;
    const int u = threadIdx.x % kGroupThreads;
    const int half = u / L::kTPR;
    const int t = u % L::kTPR;
    const int k0 = half * kHalf;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRows + g;
    const bool active = kRows == 1 || row < a.T;
    const int64_t off = active ? row * H : 0;
    const bf16* x = static_cast<const bf16*>(a.x) + off;
    const bf16* r = kRes ? static_cast<const bf16*>(a.residual) + off : nullptr;
    const W* w = static_cast<const W*>(a.weight);
    if constexpr (!kWeightAhead) prefetch_weight_small_t<L>(w, t, a.T);
    const InputLoad<kL2EvictLast> load;
    // this thread's vectors k0, k0 + 1, ... (live: in the layout and in this half)
    uint4 vh[kHalf], vr[kHalf];
    float fw_held[kWeightAhead ? kHalf : 1][kVec];
#pragma unroll
    for (int j = 0; j < kHalf; ++j) {
      const int k = k0 + j;
      const bool live = active && k < L::kVPT && L::valid(k, t);
      vh[j] = live ? load(x, L::vec(k, t)) : make_uint4(0, 0, 0, 0);
      vr[j] = kRes && live ? load(r, L::vec(k, t)) : make_uint4(0, 0, 0, 0);
      if constexpr (kWeightAhead) {
        if (live) ld_w8(w, L::vec(k, t), fw_held[j]);
      }
    }
    float ss = 0.f;
    auto add_own_squares = [&] {
#pragma unroll
      for (int j = 0; j < kHalf; ++j) {
        const int k = k0 + j;
        if (active && k < L::kVPT && L::valid(k, t)) add_squares<kRes>(vh[j], vr[j], ss);
      }
    };
    if (half == 0) {
      add_own_squares();
      chain[g * L::kTPR + t] = ss;
    }
    __syncthreads();
    const int lane = threadIdx.x % kWarpSize;
    float* sums = scratch + g * L::kWarps;
    if (half == 1) {
      ss = chain[g * L::kTPR + t];
      add_own_squares();
      ss = warp_sum(ss);
      if (lane == 0) sums[t / kWarpSize] = ss;
    }
    __syncthreads();
    if (!active) return;
    float total = sums[0];
#pragma unroll
    for (int i = 1; i < L::kWarps; ++i) total += sums[i];
    const float rstd = 1.0f / sqrtf(total / static_cast<float>(H) + a.eps);
    if (u == 0) a.rstd[row] = rstd;
    bf16* y = static_cast<bf16*>(a.y) + off;
    bf16* ro = kRes ? static_cast<bf16*>(a.residual_out) + off : nullptr;
#pragma unroll
    for (int j = 0; j < kHalf; ++j) {
      const int k = k0 + j;
      if (!(k < L::kVPT && L::valid(k, t))) continue;
      store_outputs<kRes>(y, ro, L::vec(k, t), vh[j], rstd, [&](float (&fw)[kVec]) {
        if constexpr (kWeightAhead) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) fw[e] = fw_held[j][e];
        } else {
          ld_w8(w, L::vec(k, t), fw);
        }
      });
    }
  }

  static cudaError_t launch(const cake_fwd_args_t& a, cudaStream_t s) {
    return launch_row_blocks<ForwardSplit>(a, s, kRows);
  }
};

template <int H, class W, bool kRes, Reduction kR, int kBlocksPerSm>
struct ForwardRing {
  static_assert(kR == Reduction::kFp32, "forward: reduction must be fp32");
  static_assert(kBlocksPerSm >= 1, "blocks_per_sm must be positive");
  using L = FwdLayout<H>;
  // 12 bytes of ring per column either way: 6 rows of x, or 3 rows of x and residual.
  static constexpr int kStages = kRes ? 3 : 6;
  static constexpr int kPlanes = kRes ? 2 : 1;
  using Pipe = RowPipe<L, kStages, kPlanes>;
  static constexpr int kThreads = L::kTPR;
  static constexpr int kMinBlocks = cmax(1, 65536 / (kThreads * 64));  // <= 64 registers
  static constexpr int kHidden = H;
  static constexpr bool kResidual = kRes;
  using WeightT = W;
  static constexpr int kSmemBytes = kReduceScratchBytes + Pipe::kBytes;

  static __device__ __forceinline__ void run(const cake_fwd_args_t& a) {
    float* scratch = reinterpret_cast<float*>(dyn_smem());
    const Pipe pipe{reinterpret_cast<uint4*>(dyn_smem() + kReduceScratchBytes)};
    const int t = threadIdx.x;
    const int64_t b = blockIdx.x, grid = gridDim.x;
    const int64_t n = b < a.T ? (a.T - b + grid - 1) / grid : 0;
    const bf16* x = static_cast<const bf16*>(a.x);
    const bf16* r = kRes ? static_cast<const bf16*>(a.residual) : nullptr;
    const W* w = static_cast<const W*>(a.weight);
    prefetch_weight<L>(w, t);
    const GlobalWeight<L, W> weight{w, t};
    ring_rows(
        pipe, t, n,
        [&](int64_t j, const bf16* (&src)[kPlanes]) {
          const int64_t off = (b + j * grid) * H;
          src[0] = x + off;
          if constexpr (kRes) src[1] = r + off;
        },
        [](int64_t) {},
        [&](int64_t j, int stage) {
          uint4 vh[L::kVPT], vr[L::kVPT];
          pipe.read(stage, 0, t, vh);
          if constexpr (kRes) pipe.read(stage, 1, t, vr);
          forward_row<H, L, kRes>(a, b + j * grid, true, vh, vr, t, scratch, t / kWarpSize, 0, weight);
        });
  }

  static cudaError_t launch(const cake_fwd_args_t& a, cudaStream_t s) {
    if (a.T <= 0) return cudaSuccess;
    cudaError_t e = prepare_smem<ForwardRing>(forward_kernel<ForwardRing>, kSmemBytes);
    if (e != cudaSuccess) return e;
    int sm = 0;
    e = sm_count(&sm);
    if (e != cudaSuccess) return e;
    const int resident = blocks_per_sm(forward_kernel<ForwardRing>, kThreads, kSmemBytes, 1);
    const int64_t want = static_cast<int64_t>(sm) * (kBlocksPerSm < resident ? kBlocksPerSm : resident);
    forward_kernel<ForwardRing><<<grid_capped(want < a.T ? want : a.T, 0), kThreads, kSmemBytes, s>>>(a);
    return cudaSuccess;
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_PROGRAMS_FORWARD_CUH
