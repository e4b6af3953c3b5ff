/* Where a row's math reads this thread's weight vector k (8 floats): one reader type per place,
 * each called as weight(k, fw), so the forward (forward_row) and the backward (bwd_row_math) take
 * any of them and give the same bits whichever (the same floats, in the same order).
 *
 *   GlobalWeight  from global memory through L1, at each use (forms that walk few rows: the column
 *                 task, the forward without weight_ahead);
 *   HeldWeight    in registers, loaded before the row's reduction (weight_ahead forwards);
 *   StagedWeight  from shared memory, copied there once per block (the backward forms that walk
 *                 many rows: pair, single). Read through L1 there, the weight's 32-byte-strided
 *                 loads missed about a third of the time and were about a third of the L2 traffic
 *                 (ncu, H200: L2 85-88% busy, DRAM 76-81%); staged, det's pair ran up to 8% faster
 *                 (H200, T >= 16384).
 */
#ifndef CAKE_RMSNORM_ROW_WEIGHT_CUH
#define CAKE_RMSNORM_ROW_WEIGHT_CUH

#include "cake_rmsnorm/common.cuh"

namespace cake {

template <class L, class W>
struct GlobalWeight {
  const W* __restrict__ w;
  int t;
  __device__ __forceinline__ void operator()(int k, float (&fw)[kVec]) const { ld_w8(w, L::vec(k, t), fw); }
};

// Held in registers, loaded once per row group before the row's reduction (8 floats per vector
// held across it), so a row waits one memory round trip, not two: the weight_ahead forwards (the
// H200 tuner routes them wherever H >= 1536).
template <class L, class W>
struct HeldWeight {
  float f[L::kVPT][kVec];
  __device__ __forceinline__ HeldWeight(const W* w, int t) {
#pragma unroll
    for (int k = 0; k < L::kVPT; ++k) {
      if (L::valid(k, t)) ld_w8(w, L::vec(k, t), f[k]);
    }
  }
  __device__ __forceinline__ void operator()(int k, float (&fw)[kVec]) const {
#pragma unroll
    for (int e = 0; e < kVec; ++e) fw[e] = f[k][e];
  }
};

template <class L, class W>
struct StagedWeight {
  // 16-byte pieces indexed by vector, one plane per piece (conflict-free reads): 2 planes of FP32
  // weight, 1 of BF16; always the FP32 size (4 bytes per column), so the program's shared memory
  // does not depend on the weight dtype.
  static constexpr int kPieces = static_cast<int>(sizeof(W)) * kVec / 16;
  static constexpr int kBytes = 2 * L::kNV * 16;
  const uint4* s;
  int t;
  // cp.async, issued before the row ring's first copies: they join the ring's first group, which
  // ring_rows waits for before row 0 (and before it returns), so no barrier and no stall here.
  __device__ __forceinline__ StagedWeight(const W* w, unsigned char* smem, int t_)
      : s(reinterpret_cast<const uint4*>(smem)), t(t_) {
    uint4* d = reinterpret_cast<uint4*>(smem);
#pragma unroll
    for (int k = 0; k < L::kVPT; ++k) {
      if (!L::valid(k, t)) continue;
      const int v = L::vec(k, t);
#pragma unroll
      for (int p = 0; p < kPieces; ++p) cp_async16(d + p * L::kNV + v, reinterpret_cast<const uint4*>(w) + kPieces * v + p);
    }
  }
  __device__ __forceinline__ void operator()(int k, float (&fw)[kVec]) const {
    const int v = L::vec(k, t);
    if constexpr (kPieces == 2) {
      const uint4 a = s[v], b = s[L::kNV + v];
      fw[0] = __uint_as_float(a.x); fw[1] = __uint_as_float(a.y); fw[2] = __uint_as_float(a.z);
      fw[3] = __uint_as_float(a.w); fw[4] = __uint_as_float(b.x); fw[5] = __uint_as_float(b.y);
      fw[6] = __uint_as_float(b.z); fw[7] = __uint_as_float(b.w);
    } else {
      unpack8(s[v], fw);
    }
  }
};

}  // namespace cake

#endif  // CAKE_RMSNORM_ROW_WEIGHT_CUH
