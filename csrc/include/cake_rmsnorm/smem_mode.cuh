/* Dynamic shared memory above the defaults: the one place a kernel's shared-memory attributes are set.
 *
 * CAKE_OVERSIZED is defined to 1 by the generated source of a library whose declared shared memory
 * passes the opt-in limit (232448 B, registry archs.toml) and by no other (tests/test_oversized.py
 * checks both, over every arch's plan). Only such a library sets cudaFuncAttributeSharedMemoryMode
 * to AllowOversizedSharedMemory (CUDA 13.4+); every library sets MaxDynamicSharedMemorySize when it
 * asks for more than the 48 KiB a launch gets by default. Any error is cleared (cudaGetLastError:
 * nothing sticky stays behind) and returned to the caller, which launches nothing.
 */
#ifndef CAKE_RMSNORM_SMEM_MODE_CUH
#define CAKE_RMSNORM_SMEM_MODE_CUH

#include <cuda_runtime.h>

#include <atomic>

#ifndef CAKE_OVERSIZED
#define CAKE_OVERSIZED 0
#endif

namespace cake {

constexpr int kDefaultDynSmemBytes = 48 * 1024;
constexpr int kMaxDevices = 64;  // devices past this are prepared on every call (no cache)

template <class Kernel>
inline cudaError_t set_smem_attributes(Kernel kernel, int bytes) {
  cudaError_t e = cudaSuccess;
#if CAKE_OVERSIZED
#if CUDART_VERSION >= 13040
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeSharedMemoryMode,
                           static_cast<int>(cudaSharedMemoryModeAllowOversizedSharedMemory));
#else
  e = cudaFuncSetAttribute(kernel, static_cast<cudaFuncAttribute>(16), 3);
#endif
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return e;
  }
#endif
  if (bytes > kDefaultDynSmemBytes) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) (void)cudaGetLastError();
  }
  return e;
}

// Set the attributes once per (Tag, device) and process; a failure is returned (and retried on the
// next call), never cached as success.
template <class Tag, class Kernel>
inline cudaError_t prepare_smem(Kernel kernel, int bytes) {
  static std::atomic<int> ready[kMaxDevices] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached && ready[dev].load(std::memory_order_acquire)) return cudaSuccess;
  e = set_smem_attributes(kernel, bytes);
  if (e == cudaSuccess && cached) ready[dev].store(1, std::memory_order_release);
  return e;
}

}  // namespace cake

#endif  // CAKE_RMSNORM_SMEM_MODE_CUH
