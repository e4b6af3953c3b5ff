/* The C ABI of one library (csrc/include/cake_rmsnorm/abi.h), emitted by the generated source:
 *   CAKE_EXPORT_FWD(Program, "program_id", H, CAKE_WEIGHT_*, residual)
 *   CAKE_EXPORT_BWD(Program, "program_id", H, CAKE_WEIGHT_*, residual)
 * Program provides kSmemBytes and launch(); backward programs also workspace_bytes(T, sm_count).
 * A generic (runtime-H) program exports the H-taking calls instead, and cake_info.hidden = 0:
 *   CAKE_EXPORT_FWD_H(Program, "program_id", CAKE_WEIGHT_*, residual)
 *   CAKE_EXPORT_BWD_H(Program, "program_id", CAKE_WEIGHT_*, residual)
 * Program provides kSmemBytes, valid_hidden(H), launch(args, H, stream); backward programs also
 * workspace_bytes(T, H).
 * Arguments are checked here (NULL required pointers, T < 0, short workspace, an H that is not a
 * multiple of 8 in 8..kMaxHidden: cudaErrorInvalidValue); T == 0 launches nothing (the backward
 * still writes dw = 0). Then launch + cudaGetLastError().
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

// Generic (runtime-H) programs: the same checks, plus H's.
template <class P>
int fwd_h(const cake_fwd_args_t* a, int32_t H, void* stream) {
  if (a == nullptr || a->T < 0 || !P::valid_hidden(H)) return cudaErrorInvalidValue;
  if (a->T == 0) return cudaSuccess;
  if (!a->x || !a->weight || !a->y || !a->rstd) return cudaErrorInvalidValue;
  if (P::kResidual && (!a->residual || !a->residual_out)) return cudaErrorInvalidValue;
  cudaError_t e = P::launch(*a, H, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

template <class P>
size_t bwd_workspace_h(int64_t T, int32_t H) {
  if (T <= 0 || !P::valid_hidden(H)) return 0;  // cake_bwd_h refuses such an H anyway
  return P::workspace_bytes(T, H);
}

template <class P>
int bwd_h(const cake_bwd_args_t* a, int32_t H, void* stream) {
  if (a == nullptr || a->T < 0 || !a->dw || !P::valid_hidden(H)) return cudaErrorInvalidValue;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a->T == 0) {
    return cudaMemsetAsync(a->dw, 0, sizeof(typename P::WeightT) * static_cast<size_t>(H), s);
  }
  if (!a->dy || !a->x || !a->weight || !a->rstd || !a->dx) return cudaErrorInvalidValue;
  const size_t need = bwd_workspace_h<P>(a->T, H);
  if (need > 0 && (a->workspace == nullptr || a->workspace_bytes < need)) {
    return cudaErrorInvalidValue;
  }
  cudaError_t e = P::launch(*a, H, s);
  if (e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace bind
}  // namespace cake

#define CAKE_EXPORT_INFO_(P, NAME, H, WDT, RES, DIR)                                             \
  static_assert(((RES) != 0) == P::kResidual, "export: residual differs from the program's");     \
  static_assert(((WDT) == CAKE_WEIGHT_FP32) == std::is_same<typename P::WeightT, float>::value,   \
                "export: weight dtype differs from the program's");                               \
  extern "C" __attribute__((visibility("default"))) int cake_info(cake_info_t* out) {             \
    return cake::bind::info(out, DIR, NAME, H, WDT, RES, P::kSmemBytes);                          \
  }

#define CAKE_EXPORT_COMMON_(P, NAME, H, WDT, RES, DIR)                                           \
  static_assert((H) == P::kHidden, "export: H differs from the program's");                       \
  CAKE_EXPORT_INFO_(P, NAME, H, WDT, RES, DIR)

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

// Generic programs: cake_info.hidden = 0 (any H), and the H-taking calls.
#define CAKE_EXPORT_FWD_H(P, NAME, WDT, RES)                                                     \
  CAKE_EXPORT_INFO_(P, NAME, 0, WDT, RES, CAKE_DIRECTION_FWD)                                     \
  extern "C" __attribute__((visibility("default"))) int cake_fwd_h(const cake_fwd_args_t* args,   \
                                                                   int32_t H, void* stream) {     \
    return cake::bind::fwd_h<P>(args, H, stream);                                                 \
  }

#define CAKE_EXPORT_BWD_H(P, NAME, WDT, RES)                                                     \
  CAKE_EXPORT_INFO_(P, NAME, 0, WDT, RES, CAKE_DIRECTION_BWD)                                     \
  extern "C" __attribute__((visibility("default"))) size_t cake_bwd_workspace_bytes_h(            \
      int64_t T, int32_t H, int32_t sm_count) {                                                   \
    (void)sm_count;                                                                               \
    return cake::bind::bwd_workspace_h<P>(T, H);                                                  \
  }                                                                                               \
  extern "C" __attribute__((visibility("default"))) int cake_bwd_h(const cake_bwd_args_t* args,   \
                                                                   int32_t H, void* stream) {     \
    return cake::bind::bwd_h<P>(args, H, stream);                                                 \
  }

#endif  // CAKE_RMSNORM_BINDINGS_EXPORT_CUH
