/* The C ABI every cake-rmsnorm library exports: the one contract between the CUDA libraries and
 * the Python loader (python/cake_rmsnorm/runtime/abi.py mirrors these structs with ctypes).
 * No torch and no C++ types cross it, so one wheel serves every torch version.
 *
 * A forward library exports cake_info and cake_fwd; a backward library exports cake_info,
 * cake_bwd_workspace_bytes and cake_bwd. Every function returns a cudaError_t value (0 = success).
 *
 * A generic library (a program that takes H at run time, for the widths that are not prebuilt)
 * reports cake_info.hidden = 0 and exports, instead of cake_fwd / cake_bwd_workspace_bytes /
 * cake_bwd, the same calls with H as an argument: cake_fwd_h, cake_bwd_workspace_bytes_h and
 * cake_bwd_h. H must be a multiple of 8 from 8 to the program's maximum (the registry's
 * `max_hidden`), else cudaErrorInvalidValue (and cake_bwd_workspace_bytes_h returns 0); x, y, dy,
 * dx, residual, residual_out, dresidual_out are then [T, H] and weight, dw [H].
 * Bump CAKE_ABI_VERSION on any change to these structs or signatures. */
#ifndef CAKE_RMSNORM_ABI_H
#define CAKE_RMSNORM_ABI_H

#include <stddef.h>
#include <stdint.h>

#define CAKE_ABI_VERSION 1

#define CAKE_DIRECTION_FWD 0
#define CAKE_DIRECTION_BWD 1
#define CAKE_WEIGHT_FP32 0
#define CAKE_WEIGHT_BF16 1

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  int32_t abi_version;     /* CAKE_ABI_VERSION the library was built with */
  int32_t direction;       /* CAKE_DIRECTION_* */
  int32_t hidden;          /* H; 0 for a generic library (H is an argument of its calls) */
  int32_t weight_dtype;    /* CAKE_WEIGHT_* */
  int32_t residual;        /* 1 when built for the residual variant */
  int32_t smem_bytes;      /* shared memory one block of its largest kernel takes */
  const char* program;     /* registry program id */
} cake_info_t;

/* Forward. x, residual, y, residual_out: [T, H] bf16 row-major, 16-byte aligned.
 * With residual: h = bf16(x + residual) is written to residual_out and normalised.
 * rstd: [T] fp32, saved for the backward. */
typedef struct {
  const void* x;
  const void* residual;     /* NULL unless built with residual */
  const void* weight;       /* [H] fp32 or bf16, as built */
  void* y;
  void* residual_out;       /* NULL unless built with residual */
  float* rstd;
  int64_t T;
  float eps;
} cake_fwd_args_t;

/* Backward. x is the normalised input: h when the forward had a residual.
 * dresidual_out: gradient flowing into residual_out (added to dx), or NULL.
 * dx: [T, H] bf16 (the gradient of x and of residual alike). dw: [H], weight dtype.
 * workspace: at least cake_bwd_workspace_bytes(T, sm_count) bytes (generic libraries:
 * cake_bwd_workspace_bytes_h(T, H, sm_count)), 256-byte aligned; the library
 * initialises what it needs of it on the stream. grid_cap: 0 = the library's own grid,
 * else at most that many blocks per kernel (det's bits do not depend on it; a program that runs in
 * thread-block clusters rounds it down to whole clusters, one cluster at least). */
typedef struct {
  const void* dy;
  const void* dresidual_out;
  const void* x;
  const void* weight;
  const float* rstd;
  void* dx;
  void* dw;
  void* workspace;
  size_t workspace_bytes;
  int64_t T;
  int32_t grid_cap;
} cake_bwd_args_t;

int cake_info(cake_info_t* out);
int cake_fwd(const cake_fwd_args_t* args, void* stream);
size_t cake_bwd_workspace_bytes(int64_t T, int32_t sm_count);
int cake_bwd(const cake_bwd_args_t* args, void* stream);

/* Generic libraries (cake_info.hidden == 0) only. */
int cake_fwd_h(const cake_fwd_args_t* args, int32_t H, void* stream);
size_t cake_bwd_workspace_bytes_h(int64_t T, int32_t H, int32_t sm_count);
int cake_bwd_h(const cake_bwd_args_t* args, int32_t H, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* CAKE_RMSNORM_ABI_H */
