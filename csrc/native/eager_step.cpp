// The eager training step as one C++ autograd node: torch.ops.cake_rmsnorm_native.step.
//
// Why: at small T the eager step is host time. Through a Python autograd.Function, each step pays
// for a Python forward, a Python backward the engine calls back into (with the GIL), and four
// allocations through Python's argument parsing. Here the forward allocates and launches in C++,
// and the backward runs in the autograd engine's own thread with no Python at all.
//
// The op knows nothing of routing: Python (cake_rmsnorm.ops) picks the forward and backward
// libraries for this point, as for its own path, and passes their C ABI entry points (abi.h) as
// addresses. Built against one torch version's C++ API (ci/build-wheels.sh --native TORCH); the
// Python side loads it only under that version and otherwise keeps its own path.
//
// Streams: the backward launches on the stream the forward ran on, which is where torch's engine
// runs a node's backward anyway (CUDA semantics: backward ops run on their forward's stream).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cake_rmsnorm/abi.h"

namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using FwdFn = int (*)(const cake_fwd_args_t*, void*);
using FwdHFn = int (*)(const cake_fwd_args_t*, int32_t, void*);
using BwdFn = int (*)(const cake_bwd_args_t*, void*);
using BwdHFn = int (*)(const cake_bwd_args_t*, int32_t, void*);

// The ABI's layout: row-major and 16-byte aligned (a copy where it is not).
Tensor ready(const Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<std::uintptr_t>(t.const_data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

template <typename Fn>
Fn entry(int64_t address) {
  return reinterpret_cast<Fn>(static_cast<std::uintptr_t>(address));
}

void check_launch(int rc, const char* call) {
  TORCH_CHECK(rc == 0, "cake_rmsnorm: ", call, " failed with CUDA error ", rc,
              " (`cake-rmsnorm doctor` shows what this GPU and driver can run)");
}

// Forward inputs past the tensors, in order: eps, the two entry points (the backward's 0 when no
// gradient is wanted), hidden (0 for a fixed-width library, else H: the generic libraries' calls
// take it), the backward's workspace bytes, its grid cap, the stream.
struct Step : public torch::autograd::Function<Step> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x_in,
                               const std::optional<Tensor>& residual_in, const Tensor& weight_in,
                               double eps, int64_t fwd_fn, int64_t bwd_fn, int64_t hidden,
                               int64_t ws_bytes, int64_t grid_cap, int64_t stream) {
    const Tensor x = ready(x_in);
    const Tensor weight = ready(weight_in);
    const bool has_residual = residual_in.has_value() && residual_in->defined();
    const Tensor residual = has_residual ? ready(*residual_in) : Tensor();
    const int64_t tokens = x.size(0);
    Tensor y = at::empty_like(x);
    Tensor h = has_residual ? at::empty_like(x) : Tensor();
    Tensor rstd = at::empty({tokens}, x.options().dtype(at::kFloat));
    cake_fwd_args_t args{};
    args.x = x.const_data_ptr();
    args.residual = has_residual ? residual.const_data_ptr() : nullptr;
    args.weight = weight.const_data_ptr();
    args.y = y.mutable_data_ptr();
    args.residual_out = has_residual ? h.mutable_data_ptr() : nullptr;
    args.rstd = rstd.mutable_data_ptr<float>();
    args.T = tokens;
    args.eps = static_cast<float>(eps);
    void* s = reinterpret_cast<void*>(static_cast<std::uintptr_t>(stream));
    const int rc = hidden ? entry<FwdHFn>(fwd_fn)(&args, static_cast<int32_t>(hidden), s)
                          : entry<FwdFn>(fwd_fn)(&args, s);
    check_launch(rc, "the forward launch");

    ctx->save_for_backward({has_residual ? h : x, weight, rstd});  // h is what was normalised
    ctx->saved_data["bwd_fn"] = bwd_fn;
    ctx->saved_data["hidden"] = hidden;
    ctx->saved_data["ws_bytes"] = ws_bytes;
    ctx->saved_data["grid_cap"] = grid_cap;
    ctx->saved_data["stream"] = stream;
    if (has_residual) return {y, h};
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& xn = saved[0];
    const Tensor& weight = saved[1];
    const Tensor& rstd = saved[2];
    const bool has_residual = grads.size() == 2;
    const Tensor dy = ready(grads[0]);  // undefined grads arrive as zeros (materialize_grads)
    const Tensor dh = has_residual ? ready(grads[1]) : Tensor();
    const int64_t hidden = ctx->saved_data["hidden"].toInt();
    const int64_t ws_bytes = ctx->saved_data["ws_bytes"].toInt();
    Tensor dx = at::empty_like(xn);
    Tensor dw = at::empty_like(weight);
    // held until the launch is queued: the allocator orders its reuse on this stream
    Tensor workspace = ws_bytes ? at::empty({ws_bytes}, xn.options().dtype(at::kByte)) : Tensor();
    cake_bwd_args_t args{};
    args.dy = dy.const_data_ptr();
    args.dresidual_out = has_residual ? dh.const_data_ptr() : nullptr;
    args.x = xn.const_data_ptr();
    args.weight = weight.const_data_ptr();
    args.rstd = rstd.const_data_ptr<float>();
    args.dx = dx.mutable_data_ptr();
    args.dw = dw.mutable_data_ptr();
    args.workspace = ws_bytes ? workspace.mutable_data_ptr() : nullptr;
    args.workspace_bytes = static_cast<size_t>(ws_bytes);
    args.T = xn.size(0);
    args.grid_cap = static_cast<int32_t>(ctx->saved_data["grid_cap"].toInt());
    const int64_t bwd_fn = ctx->saved_data["bwd_fn"].toInt();
    // 0 when the caller saw no gradient wanted; a node exists only when one is
    TORCH_CHECK(bwd_fn != 0, "cake_rmsnorm_native.step: backward without a backward entry point");
    const int64_t stream = ctx->saved_data["stream"].toInt();
    void* s = reinterpret_cast<void*>(static_cast<std::uintptr_t>(stream));
    const int rc = hidden ? entry<BwdHFn>(bwd_fn)(&args, static_cast<int32_t>(hidden), s)
                          : entry<BwdFn>(bwd_fn)(&args, s);
    check_launch(rc, "the backward launch");
    // one gradient per forward input: x, residual (dh flows through h = x + residual), weight, and
    // none for the seven numbers
    return {dx, has_residual ? dx : Tensor(), dw, Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor(), Tensor(), Tensor()};
  }
};

std::vector<Tensor> step(const Tensor& x, const std::optional<Tensor>& residual,
                         const Tensor& weight, double eps, int64_t fwd_fn, int64_t bwd_fn,
                         int64_t hidden, int64_t ws_bytes, int64_t grid_cap, int64_t stream) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) > 0,
              "cake_rmsnorm_native.step: x must be [T, H] with T > 0");
  TORCH_CHECK(fwd_fn != 0, "cake_rmsnorm_native.step: null forward entry point");
  return Step::apply(x, residual, weight, eps, fwd_fn, bwd_fn, hidden, ws_bytes, grid_cap, stream);
}

}  // namespace

TORCH_LIBRARY(cake_rmsnorm_native, m) {
  m.def("step(Tensor x, Tensor? residual, Tensor weight, float eps, int fwd_fn, int bwd_fn, "
        "int hidden, int ws_bytes, int grid_cap, int stream) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(cake_rmsnorm_native, CompositeImplicitAutograd, m) {
  m.impl("step", &step);
}
