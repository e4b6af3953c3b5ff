/* The per-row backward shared by every backward form (pair, single, column_task), and the row
 * pipeline that feeds it.
 *
 * One row group (RowLayout L, always BwdLayout<H>: the same layout in every form, so dx has the same
 * bits in every det program) handles one row:
 *   x̂ = x·rstd, g = dy·w (FP32), c = (1/H)·Σ g·x̂ (fixed-order group_sum),
 *   dx = bf16(rstd·(g − x̂·c) + dresidual_out)
 * and hands each element's dw product p = dy·x (exact in FP32: two bf16) and the row's rstd to
 * `on_term(i, p, rstd)` (i = column slot of this thread, 0..kCols-1: slot k*8+e is column
 * 8*(k*kTPR + t) + e), so each form accumulates dw (p·rstd) its own way.
 * `active` = the row exists; inactive rows still take part in the group reduction (barriers).
 *
 * The row pipeline (pipelined_rows) walks a row group's sequence of rows with the next rows' dy, x
 * (and dresidual_out) in flight in shared memory (row_ring.cuh); rstd comes a row ahead in a register.
 */
#ifndef CAKE_RMSNORM_BWD_ROW_CUH
#define CAKE_RMSNORM_BWD_ROW_CUH

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/common.cuh"
#include "cake_rmsnorm/row_ring.cuh"
#include "cake_rmsnorm/row_weight.cuh"

namespace cake {

// dw's term of one element, p·rstd rounded once to FP32 (the FP32 forms' term).
__device__ __forceinline__ float dw_term(float p, float rstd) { return __fmul_rn(p, rstd); }
// Its rounding error (TwoProduct through FMA): dw_term + dw_term_err == p·rstd exactly.
__device__ __forceinline__ float dw_term_err(float p, float rstd, float term) {
  return __fmaf_rn(p, rstd, -term);
}

// The compensated and FP64 per-column accumulations, one definition each: every det form adds its
// terms through these, so equal operands in equal order give equal bits across forms.
__device__ __forceinline__ void dw_add_twosum(float& s, float& c, float p, float rstd) {
  const float term = dw_term(p, rstd);
  two_sum_add(s, c, term, dw_term_err(p, rstd, term));
}
// p·rstd is exact in FP64 (16 + 24 significant bits): the only rounding is the FP64 addition.
__device__ __forceinline__ void dw_add_fp64(double& s, float p, float rstd) {
  s = __fma_rn(static_cast<double>(p), static_cast<double>(rstd), s);
}
// fixed64: the exact FP64 product p·rstd·2^kFixedShift rounded once to an integer and added
// (mod 2^64; the sum is exact while it stays inside int64). mag keeps the largest high word of
// |p·rstd·2^kFixedShift| (monotone in the magnitude; NaN and Inf above every finite value), from
// which the program checks afterwards that no sum could have left the range.
__device__ __forceinline__ void dw_add_fixed(unsigned long long& q, unsigned& mag, float p, float rstd) {
  const double t = __dmul_rn(static_cast<double>(p), static_cast<double>(rstd) * (1ull << kFixedShift));
  q += static_cast<unsigned long long>(__double2ll_rn(t));
  mag = max(mag, static_cast<unsigned>(__double2hiint(t)) & 0x7fffffffu);
}
// The fixed64 sum as the FP64 value it stands for, if T terms whose largest |t·2^kFixedShift| has
// high word mag could not have overflowed it: each term is at most M + 1/2 in magnitude (M < the
// double with high word mag and all low bits set), so |sum| <= T·(M + 1) <= 2^62 keeps every partial
// sum's true value inside int64. Else (or NaN/Inf seen) false.
__device__ __forceinline__ bool fixed_in_range(int64_t T, unsigned mag) {
  return static_cast<double>(T) * (__hiloint2double(static_cast<int>(mag), -1) + 1.0) <= 0x1p62;
}
// A warp's largest magnitude (dw_add_fixed's mag) into the program's global maximum; every lane
// of the warp calls it.
__device__ __forceinline__ void publish_magnitude(unsigned* global_max, unsigned mag) {
  mag = __reduce_max_sync(0xffffffffu, mag);
  if ((threadIdx.x & (kWarpSize - 1)) == 0) atomicMax(global_max, mag);
}
__device__ __forceinline__ double fixed_value(unsigned long long q) {
  return static_cast<double>(static_cast<long long>(q)) * (1.0 / (1ull << kFixedShift));
}

template <int H, class L, bool kRes, class Weight, class OnTerm>
__device__ __forceinline__ void bwd_row_math(const uint4 (&vdy)[L::kVPT], const uint4 (&vx)[L::kVPT],
                                             const uint4 (&vres)[L::kVPT], bool has_res,
                                             const Weight& weight, float rstd,
                                             bf16* __restrict__ dx, bool active, int t, float* scratch,
                                             int warp, int warp0, OnTerm&& on_term) {
  float dot = 0.f;
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    if (!(active && L::valid(k, t))) continue;
    float fdy[kVec], fx[kVec], fw[kVec];
    unpack8(vdy[k], fdy);
    unpack8(vx[k], fx);
    weight(k, fw);
#pragma unroll
    for (int e = 0; e < kVec; ++e) dot += (fdy[e] * fw[e]) * (fx[e] * rstd);
  }
  const float c = group_sum<L::kWarps>(dot, scratch, warp, warp0) / static_cast<float>(H);
  if (!active) return;
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    if (!L::valid(k, t)) continue;
    float fdy[kVec], fx[kVec], fw[kVec], fo[kVec];
    unpack8(vdy[k], fdy);
    unpack8(vx[k], fx);
    weight(k, fw);  // again: holding 8*kVPT weights across the reduction costs registers
    if (kRes && has_res) {
      unpack8(vres[k], fo);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) fo[e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const float g = fdy[e] * fw[e];
      const float xh = fx[e] * rstd;
      fo[e] = rstd * (g - xh * c) + fo[e];
      on_term(k * kVec + e, __fmul_rn(fdy[e], fx[e]), rstd);
    }
    st_vec(dx, L::vec(k, t), pack8(fo));
  }
}

// One row straight from global memory (the column task's row tasks).
template <int H, class L, class W, bool kRes, class OnTerm>
__device__ __forceinline__ void bwd_row(const bf16* __restrict__ dy, const bf16* __restrict__ x,
                                        const bf16* __restrict__ dres, const W* __restrict__ w,
                                        float rstd, bf16* __restrict__ dx, bool active, int t,
                                        float* scratch, int warp, int warp0, OnTerm&& on_term) {
  uint4 vdy[L::kVPT], vx[L::kVPT], vres[L::kVPT];
  const bool has_res = kRes && dres != nullptr;
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    const bool live = active && L::valid(k, t);
    vdy[k] = live ? ld_vec(dy, L::vec(k, t)) : make_uint4(0, 0, 0, 0);
    vx[k] = live ? ld_vec(x, L::vec(k, t)) : make_uint4(0, 0, 0, 0);
    vres[k] = live && has_res ? ld_vec(dres, L::vec(k, t)) : make_uint4(0, 0, 0, 0);
  }
  bwd_row_math<H, L, kRes>(vdy, vx, vres, has_res, GlobalWeight<L, W>{w, t}, rstd, dx, active, t, scratch,
                           warp, warp0, on_term);
}

// The backward's pipeline shape: kRingRows rows of dy and x, or 2/3 as many rows of dy, x and
// dresidual_out for residual programs: the same 4 * kRingRows bytes per column of shared memory
// either way (12 for the default 3 rows).
template <class L, bool kRes, int kRingRows = 3>
struct BwdPipe {
  static_assert(kRingRows >= 3 && kRingRows % 3 == 0, "ring_rows must be a multiple of 3");
  static constexpr int kStages = kRes ? 2 * kRingRows / 3 : kRingRows;
  static constexpr int kPlanes = kRes ? 3 : 2;
  using Pipe = RowPipe<L, kStages, kPlanes>;
  static constexpr int kBytes = Pipe::kBytes;
};

// For j = 0, 1, ... while live(j) (uniform over the block: every thread calls on_row equally
// often, as group_sum's barriers need), on_row(j, row_of(j), vdy, vx, vres, has_res, rstd), with the
// next rows in flight; ahead(j) runs first in each step (before row j + 1's rstd is read), so a walk
// can learn its next rows there. ring: this group's BwdPipe<L, kRes, kRingRows>::kBytes of shared
// memory.
template <int H, class L, bool kRes, int kRingRows = 3, class Live, class RowOf, class Ahead, class OnRow>
__device__ __forceinline__ void pipelined_rows_while(const cake_bwd_args_t& a, uint4* ring, int t, Live&& live,
                                                     RowOf&& row_of, Ahead&& ahead, OnRow&& on_row) {
  using Shape = BwdPipe<L, kRes, kRingRows>;
  const typename Shape::Pipe pipe{ring};
  const bf16* dy = static_cast<const bf16*>(a.dy);
  const bf16* x = static_cast<const bf16*>(a.x);
  const bf16* dres = kRes ? static_cast<const bf16*>(a.dresidual_out) : nullptr;
  const bool has_res = kRes && dres != nullptr;
  float rstd = live(0) ? __ldg(a.rstd + row_of(0)) : 0.f, next_rstd = 0.f;
  ring_rows_while(
      pipe, t, live,
      [&](int64_t j, const bf16* (&src)[Shape::kPlanes]) {
        const int64_t off = row_of(j) * H;
        src[0] = dy + off;
        src[1] = x + off;
        if constexpr (Shape::kPlanes == 3) src[2] = has_res ? dres + off : nullptr;
      },
      [&](int64_t j) {
        ahead(j);
        next_rstd = live(j + 1) ? __ldg(a.rstd + row_of(j + 1)) : 0.f;
      },
      [&](int64_t j, int stage) {
        uint4 vdy[L::kVPT], vx[L::kVPT], vres[L::kVPT];
        pipe.read(stage, 0, t, vdy);
        pipe.read(stage, 1, t, vx);
        if constexpr (Shape::kPlanes == 3) {
          if (has_res) pipe.read(stage, 2, t, vres);
        }
        on_row(j, row_of(j), vdy, vx, vres, has_res, rstd);
        rstd = next_rstd;
      });
}

// A walk over chunks of kC rows handed out at run time (pipelined_rows_while's live/row_of/ahead):
// block b takes chunk b, then chunk b + grid, then whatever chunk a global counter hands it next
// (2·grid + atomicAdd), so blocks on SMs that stream faster take more chunks and all blocks finish
// within about one chunk of each other (with one fixed range per block, the H200's blocks of equal
// work finished up to 20% apart). The next ticket is pulled a chunk ahead, so the atomic's round
// trip overlaps a chunk's rows; tickets live in 4 shared slots every thread reads. The counter must
// be zero at launch; a block past the last chunk walks no rows.
constexpr int kTicketBytes = 4 * static_cast<int>(sizeof(long long));  // shared memory of the tickets
template <int kC>
struct PulledChunks {
  static_assert(kC >= 4 && (kC & (kC - 1)) == 0, "pulled chunks: a power of two of at least 4 rows "
                                                 "(a ticket is read up to kStages - 1 rows ahead)");
  long long* slot;                // shared (kTicketBytes): the tickets of chunks q & 3
  unsigned long long* counter;    // global
  int64_t T, nch, grid;
  long long pending = 0;          // thread 0: the ticket of the chunk after the next

  __device__ __forceinline__ PulledChunks(long long* s, unsigned long long* c, int64_t T_, int t)
      : slot(s), counter(c), T(T_), nch((T_ + kC - 1) / kC), grid(gridDim.x) {
    if (t == 0) {
      slot[0] = blockIdx.x;
      slot[1] = blockIdx.x + grid;
      pending = pull();
    }
    __syncthreads();
  }
  __device__ __forceinline__ long long pull() const {
    return 2 * grid + static_cast<long long>(atomicAdd(counter, 1ull));
  }
  __device__ __forceinline__ int64_t chunk(int64_t j) const { return slot[(j / kC) & 3]; }
  __device__ __forceinline__ int64_t row(int64_t j) const { return chunk(j) * kC + j % kC; }
  __device__ __forceinline__ bool live(int64_t j) const {
    const int64_t c = chunk(j);
    return c < nch && c * kC + j % kC < T;
  }
  // At the first row of chunk q >= 1: chunk q + 1's ticket into its slot (read from row
  // (q+1)·kC - kStages + 1 on, after this barrier), and the next one pulled.
  __device__ __forceinline__ void ahead(int64_t j, int t) {
    if (j == 0 || j % kC != 0) return;
    if (t == 0) {
      slot[(j / kC + 1) & 3] = pending;
      if (pending < nch) pending = pull();
    }
    __syncthreads();
  }
};

// pipelined_rows over chunks of kC rows pulled at run time: tickets = kTicketBytes of shared memory,
// counter = 8 bytes of global memory, zero at launch. Returns whether this block had rows.
template <int H, class L, bool kRes, int kRingRows, int kC, class OnRow>
__device__ __forceinline__ bool pulled_rows(const cake_bwd_args_t& a, uint4* ring, int t, void* tickets,
                                            void* counter, OnRow&& on_row) {
  PulledChunks<kC> chunks(static_cast<long long*>(tickets), static_cast<unsigned long long*>(counter), a.T, t);
  const bool any = chunks.live(0);
  pipelined_rows_while<H, L, kRes, kRingRows>(
      a, ring, t, [&](int64_t j) { return chunks.live(j); }, [&](int64_t j) { return chunks.row(j); },
      [&](int64_t j) { chunks.ahead(j, t); }, on_row);
  return any;
}

// The rows j = 0..n-1 (n uniform over the block).
template <int H, class L, bool kRes, int kRingRows = 3, class RowOf, class OnRow>
__device__ __forceinline__ void pipelined_rows(const cake_bwd_args_t& a, uint4* ring, int t, int64_t n,
                                               RowOf&& row_of, OnRow&& on_row) {
  pipelined_rows_while<H, L, kRes, kRingRows>(
      a, ring, t, [n](int64_t j) { return j < n; }, row_of, [](int64_t) {}, on_row);
}

}  // namespace cake

#endif  // CAKE_RMSNORM_BWD_ROW_CUH
