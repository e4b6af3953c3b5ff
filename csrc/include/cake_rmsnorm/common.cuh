/* Device code shared by every cake-rmsnorm program form.
 *
 * Row layout: a row of H bf16 is H/8 16-byte vectors spread over kTPR threads (a multiple of 32,
 * "a row group"), kVPT vectors per thread; vector k of thread t is vector k*kTPR + t, so each load
 * instruction of a warp covers 512 contiguous bytes. Vectors past H/8 are masked (never for the
 * prebuilt widths). Several row groups may share a block (small H).
 *
 * Reductions are in a FIXED order: each thread sums its own elements in index order, a warp uses an
 * xor butterfly (a + b == b + a exactly, so every lane holds the same bits), and the warps of a group
 * are added in warp order from shared memory. Nothing depends on timing, grid or SM count.
 * All shared memory is dynamic and of compile-time size (no static __shared__ anywhere), so a
 * program's kSmemBytes is exactly what one of its blocks takes.
 */
#ifndef CAKE_RMSNORM_COMMON_CUH
#define CAKE_RMSNORM_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace cake {

using bf16 = __nv_bfloat16;

// How a program sums dw (the registry's `reduction`; the generator passes it as the template
// argument after kResidual, so the label and the code cannot disagree).
enum class Reduction : int {
  kFp32 = 0,         // plain FP32 sums
  kBlockedFp32 = 1,  // FP32 sums of at most block_rows terms, folded into FP64
  kTwoSum = 2,       // FP32 TwoSum pairs (sum + compensation), TwoProduct error included
  kFp64Fold = 3,     // FP64 sums
  kFixed64 = 4,      // 64-bit fixed-point sums of the rounded terms: exact, so any order gives the same bits
};

constexpr int kWarpSize = 32;
// det's canonical cut of the rows for dw: chunks of 64 rows, summed from zero in row order, folded
// in chunk order over 8 contiguous segments (the pair's chunk_rows and kSplits; the column task
// follows it), so every det form of one reduction gives the same bits.
constexpr int kDetChunkRows = 64;
constexpr int kDetSplits = 8;
// fixed64: a dw term t is held as the integer round(t · 2^kFixedShift) (bwd_row.cuh dw_add_fixed).
constexpr int kFixedShift = 34;
constexpr int kVec = 8;                 // bf16 per 16-byte vector
constexpr int kReduceScratchBytes = 128;  // one float per warp, up to 32 warps (1024 threads)

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int round_up(int a, int b) { return ceil_div(a, b) * b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr size_t align256(size_t n) { return (n + 255) / 256 * 256; }

template <int H, int kMaxTPR>
struct RowLayout {
  static_assert(H > 0 && H % kVec == 0, "H must be a positive multiple of 8");
  static constexpr int kNV = H / kVec;                                   // vectors per row
  static constexpr int kVPT = ceil_div(kNV, kMaxTPR);                    // vectors per thread
  static constexpr int kTPR = round_up(ceil_div(kNV, kVPT), kWarpSize);  // threads per row
  static constexpr int kWarps = kTPR / kWarpSize;
  static constexpr int kCols = kVPT * kVec;                              // columns per thread
  static constexpr bool kExact = kTPR * kVPT == kNV;
  __device__ __forceinline__ static bool valid(int k, int t) { return kExact || k * kTPR + t < kNV; }
  __device__ __forceinline__ static int vec(int k, int t) { return k * kTPR + t; }
};

// The backward's row layout: at most 2 vectors (32 bytes of each tensor) per thread: the rows in
// flight live in shared memory (bwd_row.cuh's pipeline), and 2 vectors leave the registers to the
// per-column dw sums (2 each in the compensated and FP64 forms) at 128 registers a thread. Every
// backward form uses this one layout, so dx (whose dot product is summed in the layout's order) has
// the same bits in every det program form.
constexpr int kBwdVecsPerThread = 2;
template <int H>
using BwdLayout = RowLayout<H, round_up(ceil_div(H / kVec, kBwdVecsPerThread), kWarpSize)>;

// The forward's row layout, shared by every forward form (so rstd and y have the same bits in each):
// at most 4 vectors per thread (more rows in flight come from more row groups, or from the ring
// program's shared memory, not from registers).
constexpr int kFwdVecsPerThread = 4;
template <int H>
using FwdLayout = RowLayout<H, round_up(ceil_div(H / kVec, kFwdVecsPerThread), kWarpSize)>;

/* ---- 16-byte bf16 vectors ---- */
__device__ __forceinline__ uint4 ld_vec(const bf16* row, int v) {
  return __ldg(reinterpret_cast<const uint4*>(row) + v);
}
// ld_vec with an L2 eviction priority (`policy` from l2_policy_evict_last): the forward reads x
// and the residual once, yet loading them evict_last makes the L2 write back its dirty lines (y,
// and what the kernel before left) first, which keeps DRAM streaming (forward.cuh, kL2EvictLast).
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint4 ld_vec_hinted(const bf16* row, int v, uint64_t policy) {
  uint4 u;
  asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w)
      : "l"(reinterpret_cast<const uint4*>(row) + v), "l"(policy));
  return u;
}
__device__ __forceinline__ void st_vec(bf16* row, int v, uint4 u) {
  reinterpret_cast<uint4*>(row)[v] = u;
}
__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[kVec]) {
  f[0] = bf_lo(u.x); f[1] = bf_hi(u.x); f[2] = bf_lo(u.y); f[3] = bf_hi(u.y);
  f[4] = bf_lo(u.z); f[5] = bf_hi(u.z); f[6] = bf_lo(u.w); f[7] = bf_hi(u.w);
}
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);  // round to nearest even
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint4 pack8(const float (&f)[kVec]) {
  return make_uint4(pack2(f[0], f[1]), pack2(f[2], f[3]), pack2(f[4], f[5]), pack2(f[6], f[7]));
}

/* ---- prefetches (no registers held; the line is on its way when the load comes) ---- */
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}
// This thread's weight vectors of layout L: a row's first weight load comes after its reduction,
// so without this a block of few rows (small T) waits a second DRAM round trip for them.
// Only once per block of many rows, or where the grid is small: kernels of one row per block call
// prefetch_weight_small_t, since at large T their prefetches (one per row) cost more than they
// save (the H200 forward at T 65536 ran 1.5-2.3x slower with one per row).
constexpr int64_t kPrefetchWeightMaxT = 256;
template <class L, class W>
__device__ __forceinline__ void prefetch_weight(const W* w, int t) {
#pragma unroll
  for (int k = 0; k < L::kVPT; ++k) {
    if (L::valid(k, t)) prefetch_l1(w + kVec * L::vec(k, t));
  }
}

template <class L, class W>
__device__ __forceinline__ void prefetch_weight_small_t(const W* w, int t, int64_t T) {
  if (T <= kPrefetchWeightMaxT) prefetch_weight<L>(w, t);
}

/* ---- weight [H] (fp32 or bf16) as 8 floats; dw stores ---- */
__device__ __forceinline__ void ld_w8(const float* w, int v, float (&f)[kVec]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(w) + 2 * v);
  const float4 b = __ldg(reinterpret_cast<const float4*>(w) + 2 * v + 1);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void ld_w8(const bf16* w, int v, float (&f)[kVec]) {
  unpack8(ld_vec(w, v), f);
}
__device__ __forceinline__ void st_dw(float* dw, int j, double v) { dw[j] = static_cast<float>(v); }
__device__ __forceinline__ void st_dw(bf16* dw, int j, double v) { dw[j] = __double2bfloat16(v); }

/* ---- compensated arithmetic ---- */
// Knuth TwoSum: s + e == a + b exactly (no FMA contraction possible: no products).
__device__ __forceinline__ void two_sum(float a, float b, float& s, float& e) {
  s = a + b;
  const float bb = s - a;
  e = (a - (s - bb)) + (b - bb);
}
// TwoSum accumulation of one dw term: (s, c) += term, err (err: the term's TwoProduct error).
__device__ __forceinline__ void two_sum_add(float& s, float& c, float term, float err) {
  float ns, e;
  two_sum(s, term, ns, e);
  s = ns;
  c += e + err;
}

/* ---- fixed-order reductions ---- */
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// N sums over a row group at once (a thread's N rows: the forward's rows_per_thread), each in a
// fixed order (the warp's xor butterfly, then the group's warps in order), every thread of the
// group getting the same bits: the N shuffle chains side by side and one barrier for all N
// cross-warp sums, where N group_sum calls wait each chain's latency (and two barriers) in turn;
// ptxas does not move a shuffle above the previous row's stores. scratch: N * 32 floats
// (N * kReduceScratchBytes); warp0 = first warp of the group. No barrier after: a caller that
// uses scratch again syncs first (group_sum).
template <int kWarps, int N>
__device__ __forceinline__ void group_sums_once(float (&v)[N], float* scratch, int warp, int warp0) {
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
  if constexpr (kWarps > 1) {
    constexpr int kStride = kReduceScratchBytes / static_cast<int>(sizeof(float));
    if ((threadIdx.x & (kWarpSize - 1)) == 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) scratch[i * kStride + warp] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float* sums = scratch + i * kStride + warp0;
      float s = sums[0];
#pragma unroll
      for (int j = 1; j < kWarps; ++j) s += sums[j];
      v[i] = s;
    }
  }
}

// One sum over a row group of kWarps warps (group_sums_once of one value); scratch: one float per
// warp of the block (kReduceScratchBytes). Every thread of the block must call it the same number
// of times (it holds __syncthreads).
template <int kWarps>
__device__ __forceinline__ float group_sum(float v, float* scratch, int warp, int warp0) {
  float sums[1] = {v};
  group_sums_once<kWarps>(sums, scratch, warp, warp0);
  if constexpr (kWarps > 1) __syncthreads();  // the next call writes scratch again
  return sums[0];
}

// load(0) + load(1) + ... + load(N - 1) in index order (in load's type: FP64, or wrapping 64-bit
// integers), every load issued before the first addition.
template <int N, class Load>
__device__ __forceinline__ auto sum_in_order(Load&& load) {
  using V = decltype(load(0));
  V v[N];
#pragma unroll
  for (int q = 0; q < N; ++q) v[q] = load(q);
  V sum = v[0];
#pragma unroll
  for (int q = 1; q < N; ++q) sum += v[q];
  return sum;
}

// For the columns j = threadIdx.x, + kThreads, ... < H: store(j, value(j)), kBatch of a thread's
// columns at a time, every value loaded before the first is stored. As one loop of load, convert and
// store, the compiler keeps each load behind the previous column's store, and a thread waits one
// memory round trip per column.
template <int H, int kThreads, int kBatch, class Value, class Store>
__device__ __forceinline__ void columns_batched(Value&& value, Store&& store) {
  using V = decltype(value(0));
  for (int j0 = static_cast<int>(threadIdx.x); j0 < H; j0 += kThreads * kBatch) {
    V v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (j0 + b * kThreads < H) v[b] = value(j0 + b * kThreads);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (j0 + b * kThreads < H) store(j0 + b * kThreads, v[b]);
    }
  }
}

__device__ __forceinline__ unsigned char* dyn_smem() {
  extern __shared__ __align__(16) unsigned char cake_dyn_smem[];
  return cake_dyn_smem;
}

/* ---- asynchronous copies global -> shared (sm_80+) ---- */
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
// cp.async.wait_group with a count known only after unrolling (at most 7 groups pending).
__device__ __forceinline__ void cp_async_wait_pending(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

/* ---- programmatic dependent launch (sm_90+) ----
 * A kernel launched by launch_dependent() may be scheduled while the kernel before it on the stream
 * drains (its launch latency hidden behind that kernel's tail): it must call pdl_wait() before it
 * reads anything that kernel wrote (pdl_wait returns once that kernel has completed and its writes
 * are visible; with no such dependency it returns at once). The kernel before lets it be scheduled
 * with pdl_allow_dependents(), once its blocks have no more use for their SM slots. */
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_allow_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

/* ---- host helpers ---- */
template <class Args>
inline cudaError_t launch_dependent(void (*kernel)(Args), int grid, int threads, size_t smem, cudaStream_t st,
                                    const Args& a) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, a);
}
// The launch of `grid` blocks (a multiple of `cluster`) in thread-block clusters of `cluster` (sm_90+);
// attr: room for the configuration's one attribute.
inline cudaLaunchConfig_t cluster_config(int grid, int threads, size_t smem, cudaStream_t st, int cluster,
                                         cudaLaunchAttribute (&attr)[1]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}
inline cudaError_t sm_count(int* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  return cudaDeviceGetAttribute(out, cudaDevAttrMultiProcessorCount, dev);
}
// Resident blocks per SM of a kernel (queried once per process and kernel; a library serves one arch).
template <class Kernel>
inline int blocks_per_sm(Kernel kernel, int threads, size_t smem, int fallback) {
  static const int n = [&] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, threads, smem) != cudaSuccess || b < 1) {
      (void)cudaGetLastError();
      b = fallback;
    }
    return b;
  }();
  return n;
}
// Blocks for `tasks` equal tasks (a block takes tasks b, b + grid, ...) when `slots` blocks fit at
// once: as many as make every block take the same number of tasks in the fewest rounds. With all
// slots filled, 1024 chunks on 660 slots run as 660 + 364: the second round leaves 45% of the
// slots idle; 512 blocks take 2 chunks each and finish together.
inline int64_t balanced_grid(int64_t tasks, int64_t slots) {
  if (tasks <= slots || slots < 1) return tasks;
  const int64_t rounds = (tasks + slots - 1) / slots;
  return (tasks + rounds - 1) / rounds;
}
inline int grid_capped(int64_t want, int cap) {
  if (cap > 0 && want > cap) want = cap;
  if (want < 1) want = 1;
  return static_cast<int>(want);
}

}  // namespace cake

#endif  // CAKE_RMSNORM_COMMON_CUH
