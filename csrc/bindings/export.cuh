/* The C ABI of one library (csrc/include/cake_rmsnorm/abi.h), emitted by the generated source:
 *   CAKE_EXPORT_FWD(Program, "program_id", H, CAKE_WEIGHT_*, residual)
 *   CAKE_EXPORT_BWD(Program, "program_id", H, CAKE_WEIGHT_*, residual)
 * Program provides kSmemBytes and launch(); backward programs also workspace_bytes(T, sm_count).
 * Arguments are checked here (NULL required pointers, T < 0, short workspace: cudaErrorInvalidValue);
 * T == 0 launches nothing (the backward still writes dw = 0). Then launch + cudaGetLastError().
 */
#ifndef CAKE_RMSNORM_BINDINGS_EXPORT_CUH
#define CAKE_RMSNORM_BINDINGS_EXPORT_CUH

#include <cuda_runtime.h>

#include <type_traits>

#include "cake_rmsnorm/abi.h"
#include "cake_rmsnorm/common.cuh"
#include "cake_rmsnorm/smem_mode.cuh"  // CAKE_OVERSIZED: 1 only in libraries above the opt-in

namespace cake {
namespace bind {

inline int info(cake_info_t* out, int direction, const char* name, int H, int wdt, int res,
                int smem) {
  if (out == nullptr) return cudaErrorInvalidValue;
  out->abi_version = CAKE_ABI_VERSION;
  out->direction = direction;
  out->hidden = H;
  out->weight_dtype = wdt;
  out->residual = res;
  out->smem_bytes = smem;
  out->program = name;
  return cudaSuccess;
}

template <class P>
int fwd(const cake_fwd_args_t* a, void* stream) {
  if (a == nullptr || a->T < 0) return cudaErrorInvalidValue;
  if (a->T == 0) return cudaSuccess;
  if (!a->x || !a->weight || !a->y || !a->rstd) return cudaErrorInvalidValue;
  if (P::kResidual && (!a->residual || !a->residual_out)) return cudaErrorInvalidValue;
  cudaError_t e = P::launch(*a, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

template <class P>
size_t bwd_workspace(int64_t T, int32_t sm) {
  if (T <= 0) return 0;
  return P::workspace_bytes(T, sm > 0 ? sm : 1);
}

template <class P>
int bwd(const cake_bwd_args_t* a, void* stream) {
  if (a == nullptr || a->T < 0 || !a->dw) return cudaErrorInvalidValue;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a->T == 0) {
    return cudaMemsetAsync(a->dw, 0, sizeof(typename P::WeightT) * P::kHidden, s);
  }
  if (!a->dy || !a->x || !a->weight || !a->rstd || !a->dx) return cudaErrorInvalidValue;
  int sm = 0;
  cudaError_t e = sm_count(&sm);
  if (e != cudaSuccess) return e;
  const size_t need = bwd_workspace<P>(a->T, sm);
  if (need > 0 && (a->workspace == nullptr || a->workspace_bytes < need)) {
    return cudaErrorInvalidValue;
  }
  e = P::launch(*a, s);
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace bind
}  // namespace cake

#define CAKE_EXPORT_COMMON_(P, NAME, H, WDT, RES, DIR)                                           \
  static_assert((H) == P::kHidden, "export: H differs from the program's");                       \
  static_assert(((RES) != 0) == P::kResidual, "export: residual differs from the program's");     \
  static_assert(((WDT) == CAKE_WEIGHT_FP32) == std::is_same<typename P::WeightT, float>::value,   \
                "export: weight dtype differs from the program's");                               \
  extern "C" __attribute__((visibility("default"))) int cake_info(cake_info_t* out) {             \
    return cake::bind::info(out, DIR, NAME, H, WDT, RES, P::kSmemBytes);                          \
  }

#define CAKE_EXPORT_FWD(P, NAME, H, WDT, RES)                                                    \
  CAKE_EXPORT_COMMON_(P, NAME, H, WDT, RES, CAKE_DIRECTION_FWD)                                   \
  extern "C" __attribute__((visibility("default"))) int cake_fwd(const cake_fwd_args_t* args,     \
                                                                 void* stream) {                  \
    return cake::bind::fwd<P>(args, stream);                                                      \
  }

#define CAKE_EXPORT_BWD(P, NAME, H, WDT, RES)                                                    \
  CAKE_EXPORT_COMMON_(P, NAME, H, WDT, RES, CAKE_DIRECTION_BWD)                                   \
  extern "C" __attribute__((visibility("default"))) size_t cake_bwd_workspace_bytes(              \
      int64_t T, int32_t sm_count) {                                                              \
    return cake::bind::bwd_workspace<P>(T, sm_count);                                             \
  }                                                                                               \
  extern "C" __attribute__((visibility("default"))) int cake_bwd(const cake_bwd_args_t* args,     \
                                                                 void* stream) {                  \
    return cake::bind::bwd<P>(args, stream);                                                      \
  }

#endif  // CAKE_RMSNORM_BINDINGS_EXPORT_CUH
