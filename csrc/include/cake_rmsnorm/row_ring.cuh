/* A row group's ring of the next rows in shared memory, filled by cp.async (sm_80+).
 *
 * ring_rows walks a sequence of n rows with the next kStages-1 rows already in flight: each thread
 * copies (cp.async, 16 bytes at a time) and later reads only its own slots, so no barrier is needed,
 * and the bytes in flight cost no registers. Used by the forward ring program and by every backward
 * form that walks many rows per row group (bwd_row.cuh's pipelined_rows).
 */
#ifndef CAKE_RMSNORM_ROW_RING_CUH
#define CAKE_RMSNORM_ROW_RING_CUH

#include "cake_rmsnorm/common.cuh"

namespace cake {

// A row group's ring of kStages rows in shared memory: [kStages][kPlanes][kVPT][kTPR] 16-byte slots
// (planes dy, x and, for residual programs, dresidual_out); thread t's vector k sits at k*kTPR + t
// (consecutive threads, consecutive banks).
template <class L, int kStages, int kPlanes>
struct RowPipe {
  static_assert(kStages >= 2, "a row pipeline needs at least 2 stages");
  static constexpr int kSlots = L::kVPT * L::kTPR;
  static constexpr int kBytes = kStages * kPlanes * kSlots * 16;
  static constexpr int kStageCount = kStages;
  static constexpr int kPlaneCount = kPlanes;
  uint4* ring;

  __device__ __forceinline__ void issue(int stage, const bf16* const (&src)[kPlanes], bool live, int t) const {
    if (live) {
      uint4* s = ring + stage * kPlanes * kSlots;
#pragma unroll
      for (int q = 0; q < kPlanes; ++q) {
        if (src[q] == nullptr) continue;
#pragma unroll
        for (int k = 0; k < L::kVPT; ++k) {
          if (L::valid(k, t)) cp_async16(s + q * kSlots + k * L::kTPR + t, reinterpret_cast<const uint4*>(src[q]) + L::vec(k, t));
        }
      }
    }
    cp_async_commit();  // always: one group per row keeps wait_group's count exact
  }
  __device__ __forceinline__ void read(int stage, int q, int t, uint4 (&v)[L::kVPT]) const {
    const uint4* s = ring + (stage * kPlanes + q) * kSlots;
#pragma unroll
    for (int k = 0; k < L::kVPT; ++k) v[k] = L::valid(k, t) ? s[k * L::kTPR + t] : make_uint4(0, 0, 0, 0);
  }
};

// For j = 0, 1, ... while live(j): before_wait(j) (scalar loads a row ahead), then, once row j's
// copies have landed, on_row(j, stage) (read the planes with pipe.read(stage, plane, t, v)).
// sources(j, src) names the kPlanes row pointers of a live row j (nullptr: that plane is not
// copied). live(j) must be uniform over the block when on_row holds barriers, and known
// kStages - 1 rows ahead (row j + kStages - 1 is issued before before_wait(j)).
template <class Pipe, class Live, class Sources, class BeforeWait, class OnRow>
__device__ __forceinline__ void ring_rows_while(const Pipe& pipe, int t, Live&& live, Sources&& sources,
                                                BeforeWait&& before_wait, OnRow&& on_row) {
  constexpr int kStages = Pipe::kStageCount;
  auto issue = [&](int64_t j, int stage) {
    const bf16* src[Pipe::kPlaneCount] = {};
    const bool l = live(j);
    if (l) sources(j, src);
    pipe.issue(stage, src, l, t);
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(s, s);
  int stage = 0;             // the stage row j sits in
  int fill = kStages - 1;    // the stage row j + kStages - 1 goes to
#pragma unroll 1
  for (int64_t j = 0; live(j); ++j) {
    issue(j + kStages - 1, fill);
    fill = fill + 1 == kStages ? 0 : fill + 1;
    before_wait(j);
    cp_async_wait<kStages - 1>();  // this thread's copies of row j have landed
    on_row(j, stage);
    stage = stage + 1 == kStages ? 0 : stage + 1;
  }
  cp_async_wait<0>();  // nothing of this sequence stays in flight into whatever the block does next
}

// The rows j = 0..n-1 (n uniform over the block when on_row holds barriers).
template <class Pipe, class Sources, class BeforeWait, class OnRow>
__device__ __forceinline__ void ring_rows(const Pipe& pipe, int t, int64_t n, Sources&& sources,
                                          BeforeWait&& before_wait, OnRow&& on_row) {
  ring_rows_while(pipe, t, [n](int64_t j) { return j < n; }, sources, before_wait, on_row);
}

}  // namespace cake

#endif  // CAKE_RMSNORM_ROW_RING_CUH
