"""The op: `rms_norm(x, weight, eps, residual, backend)` as torch.library custom ops.

    cake_rmsnorm::fwd(x, weight, eps, backend) -> (y, rstd)
    cake_rmsnorm::fwd_residual(x, residual, weight, eps, backend) -> (y, h, rstd)
    cake_rmsnorm::bwd(dy, dresidual_out?, x, weight, rstd, backend, residual) -> (dx, dw)

x is [T, H] bf16 (the wrapper flattens leading dims), weight [H] fp32 or bf16; H a prebuilt width,
or any other multiple of 8 up to checks.MAX_HIDDEN (the generic libraries). The ops are opaque
to torch.compile (register_fake gives their shapes) and launch through the provider's C ABI on
torch's current stream: no host sync, every buffer from torch's allocator (CUDA-graph safe).
In eager mode `rms_norm` skips the custom ops: it runs one autograd.Function (_Eager), or, where
the native step's wheel for this torch is installed (runtime/native.py), one C++ autograd node.
Importing this module imports torch and reads the registry; it loads no library and creates no
CUDA context.
"""

import bisect
import os
import re
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import checks
from .checks import BACKENDS, WIDTHS, resolve_backend  # noqa: F401  (re-exported)
from .checks import WEIGHT_DTYPES as _WEIGHT_DTYPES
from .errors import LaunchError
from .registry import TableKey, load_registry
from .runtime import abi, device, loader, native, router

__all__ = ["rms_norm", "resolve_backend", "set_grid_cap", "get_grid_cap"]

_REGISTRY = load_registry()
_NULL = 0


def _env_grid_cap() -> int:
    text = os.environ.get("CAKE_RMSNORM_GRID_CAP", "").strip()
    try:
        value = int(text) if text else 0
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"CAKE_RMSNORM_GRID_CAP={text!r}: expected an integer >= 0 "
                         f"(0 = each library's own grid)")
    return value


# Backward grid cap: 0 = each library's own grid; else at most that many blocks per kernel.
_grid_cap: int = _env_grid_cap()


def set_grid_cap(blocks: int) -> None:
    """Cap the backward's blocks per kernel (0 = the library's own grid); det's bits do not change.
    Programs that run in thread-block clusters (fast's `_k4`/`_k8`) round it down to whole clusters,
    one cluster at least. A step through the native C++ node (runtime/native.py) takes the cap in
    force at its forward; the Python paths, the one at its backward."""
    global _grid_cap
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
        raise ValueError(f"grid_cap must be an int >= 0, got {blocks!r}")
    _grid_cap = blocks


def get_grid_cap() -> int:
    return _grid_cap


# ---- routing (cached per device and route table; bisect per call) ----------------------------
class _Table:
    __slots__ = ("info", "firsts", "libs")

    def __init__(self, info: device.DeviceInfo, firsts: List[int]) -> None:
        self.info = info
        self.firsts = firsts
        self.libs: List[Optional[abi.Library]] = [None] * len(firsts)


_tables: Dict[tuple, _Table] = {}


def _library(index: int, backend: str, direction: str, hidden: int, tokens: int,
             weight_dtype: str, residual: bool) -> Tuple[abi.Library, int]:
    """The loaded library for this point and the device's SM count."""
    key = (index, backend, direction, hidden, weight_dtype, residual)
    table = _tables.get(key)
    if table is None:
        info = device.device_info(index)
        windows = _REGISTRY.table(TableKey(info.arch.name, backend, direction, weight_dtype,
                                           residual, hidden))
        table = _tables.setdefault(key, _Table(info, [w.first for w in windows]))
    i = bisect.bisect_right(table.firsts, tokens) - 1
    lib = table.libs[i]
    if lib is None:
        route = _REGISTRY.route(table.info.arch.name, backend, direction, hidden, table.firsts[i],
                                weight_dtype, residual)
        loaded = loader.load_library(table.info.arch, router.runnable_on(_REGISTRY, route, index))
        # a generic library (H not prebuilt) takes H with each call: bind this table's H
        lib = table.libs[i] = loaded.at(hidden) if loaded.generic else loaded
    return lib, table.info.sm_count


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(index: int) -> int:
    if _raw_stream is not None:
        return int(_raw_stream(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def _like(t: Tensor) -> Tensor:
    return torch.empty_like(t, memory_format=torch.contiguous_format)


# y, h (None without residual), rstd, and the x and weight launched on (row-major, aligned: the
# backward may take them as they are)
_Forward = Tuple[Tensor, Optional[Tensor], Tensor, Tensor, Tensor]


def _ready(t: Tensor) -> Tuple[Tensor, int]:
    """t row-major and 16-byte aligned, as the ABI requires (a copy where it is not), and its
    address."""
    ptr = t.data_ptr()
    if ptr % 16 or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
        ptr = t.data_ptr()
    return t, ptr


_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _on_device(index: int, launch, *args):
    """launch(*args, stream) with `index` the current CUDA device and its current stream, and its
    result; the device is switched (and restored) only when it is not already current."""
    prev = _current_device()
    if prev == index:
        return launch(*args, _stream(index))
    torch.cuda.set_device(index)
    try:
        return launch(*args, _stream(index))
    finally:
        torch.cuda.set_device(prev)


def _launch_fwd(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                backend: str, checked: bool = False) -> _Forward:
    """checked: the caller (rms_norm's eager path) has already run the public checks."""
    if not checked:
        checks.check_op(x, weight, residual, eps=eps, backend=backend)
    tokens, hidden = x.shape
    x, x_ptr = _ready(x)  # first: the outputs below are empty_like a row-major x
    weight, w_ptr = _ready(weight)
    y = torch.empty_like(x)
    h = None if residual is None else torch.empty_like(x)
    rstd = torch.empty(tokens, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return y, h, rstd, x, weight
    r_ptr = h_ptr = _NULL
    if residual is not None:
        residual, r_ptr = _ready(residual)
        h_ptr = h.data_ptr()  # type: ignore[union-attr]
    index = x.get_device()
    lib, _ = _library(index, backend, "fwd", hidden, tokens, _WEIGHT_DTYPES[weight.dtype],
                      residual is not None)
    _on_device(index, lib.fwd, x_ptr, r_ptr, w_ptr, y.data_ptr(), h_ptr, rstd.data_ptr(), tokens,
               eps)
    return y, h, rstd, x, weight


# ---- the custom ops ---------------------------------------------------------------------------
@torch.library.custom_op("cake_rmsnorm::fwd", mutates_args=())
def _fwd(x: Tensor, weight: Tensor, eps: float, backend: str) -> Tuple[Tensor, Tensor]:
    y, _, rstd, _, _ = _launch_fwd(x, None, weight, eps, backend)
    return y, rstd


@_fwd.register_fake
def _fwd_fake(x: Tensor, weight: Tensor, eps: float, backend: str) -> Tuple[Tensor, Tensor]:
    return _like(x), x.new_empty((x.shape[0],), dtype=torch.float32)


@torch.library.custom_op("cake_rmsnorm::fwd_residual", mutates_args=())
def _fwd_residual(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                  backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    y, h, rstd, _, _ = _launch_fwd(x, residual, weight, eps, backend)
    return y, h, rstd  # type: ignore[return-value]


@_fwd_residual.register_fake
def _fwd_residual_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                       backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    return _like(x), _like(x), x.new_empty((x.shape[0],), dtype=torch.float32)


def _launch_bwd(dy: Tensor, dresidual_out: Optional[Tensor], x: Tensor, weight: Tensor,
                rstd: Tensor, backend: str, residual: bool,
                checked: bool = False) -> Tuple[Tensor, Tensor]:
    """checked: x, weight and rstd are what the checked forward launched on and saved (row-major,
    aligned: _Forward), and autograd gives dy (and dresidual_out) the shape, dtype and device of the
    forward's outputs."""
    if not checked:
        checks.check_op(x, weight, dy, dresidual_out, backend=backend, rstd=rstd)
        x, weight, rstd = _ready(x)[0], _ready(weight)[0], _ready(rstd)[0]
    tokens, hidden = x.shape
    dx = torch.empty_like(x)
    dw = torch.empty_like(weight)
    if tokens == 0:
        return dx, dw.zero_()
    dy, dy_ptr = _ready(dy)
    index = x.get_device()
    lib, sm_count = _library(index, backend, "bwd", hidden, tokens, _WEIGHT_DTYPES[weight.dtype],
                             residual)
    ws_bytes = lib.bwd_workspace_bytes(tokens, sm_count)
    # held until the launch is queued: the allocator orders its reuse on this stream
    workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=x.device) if ws_bytes else None
    dres_ptr = _NULL
    if dresidual_out is not None:
        dresidual_out, dres_ptr = _ready(dresidual_out)
    _on_device(index, lib.bwd, dy_ptr, dres_ptr, x.data_ptr(), weight.data_ptr(), rstd.data_ptr(),
               dx.data_ptr(), dw.data_ptr(),
               workspace.data_ptr() if workspace is not None else _NULL, ws_bytes, tokens,
               _grid_cap)
    return dx, dw


@torch.library.custom_op("cake_rmsnorm::bwd", mutates_args=())
def _bwd(dy: Tensor, dresidual_out: Optional[Tensor], x: Tensor, weight: Tensor, rstd: Tensor,
         backend: str, residual: bool) -> Tuple[Tensor, Tensor]:
    return _launch_bwd(dy, dresidual_out, x, weight, rstd, backend, residual)


@_bwd.register_fake
def _bwd_fake(dy: Tensor, dresidual_out: Optional[Tensor], x: Tensor, weight: Tensor,
              rstd: Tensor, backend: str, residual: bool) -> Tuple[Tensor, Tensor]:
    return _like(x), _like(weight)


def _fwd_setup(ctx, inputs, output) -> None:
    x, weight, _eps, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.backend = backend


def _fwd_backward(ctx, dy: Tensor, _drstd: Optional[Tensor]):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _bwd(dy, None, x, weight, rstd, ctx.backend, False)
    return dx, dw, None, None


def _res_setup(ctx, inputs, output) -> None:
    _x, _residual, weight, _eps, backend = inputs
    ctx.save_for_backward(output[1], weight, output[2])  # h is what was normalised
    ctx.backend = backend


def _res_backward(ctx, dy: Tensor, dh: Optional[Tensor], _drstd: Optional[Tensor]):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = _bwd(dy, dh, h, weight, rstd, ctx.backend, True)
    return dx, dx, dw, None, None


torch.library.register_autograd("cake_rmsnorm::fwd", _fwd_backward, setup_context=_fwd_setup)
torch.library.register_autograd("cake_rmsnorm::fwd_residual", _res_backward,
                                setup_context=_res_setup)


# ---- eager fast path: the same launches without the custom-op dispatch -------------------------
class _Eager(torch.autograd.Function):
    """What the custom ops do, as one autograd.Function: in eager mode it saves the dispatcher's
    per-call cost (about 4x the launch itself). torch.compile and any tensor subclass, dispatch
    mode or functorch transform take the custom ops instead."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, backend):  # type: ignore[override]
        y, h, rstd, x, weight = _launch_fwd(x, residual, weight, eps, backend, checked=True)
        ctx.save_for_backward(x if h is None else h, weight, rstd)
        ctx.backend, ctx.residual = backend, h is not None
        return y if h is None else (y, h)

    @staticmethod
    def backward(ctx, dy, dh=None):  # type: ignore[override]
        xn, weight, rstd = ctx.saved_tensors
        dx, dw = _launch_bwd(dy, dh, xn, weight, rstd, ctx.backend, ctx.residual, checked=True)
        return dx, (dx if ctx.residual else None), dw, None, None


def _native_step(op, x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                 backend: str):
    """The eager step through the native C++ node (runtime/native.py): this point's forward and
    backward libraries picked here, as _launch_fwd and _launch_bwd pick them, and handed over by
    address. The backward's grid cap and workspace are fixed now; it runs on this stream."""
    tokens, hidden = x.shape
    index = x.get_device()
    weight_dtype, res = _WEIGHT_DTYPES[weight.dtype], residual is not None
    fwd, _ = _library(index, backend, "fwd", hidden, tokens, weight_dtype, res)
    bwd_entry = ws_bytes = 0  # no gradient wanted: no node is made, no backward library loaded
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (res and residual.requires_grad)):  # type: ignore[union-attr]
        bwd, sm_count = _library(index, backend, "bwd", hidden, tokens, weight_dtype, res)
        bwd_entry, ws_bytes = bwd.entry, bwd.bwd_workspace_bytes(tokens, sm_count)
    try:
        out = _on_device(index, op, x, residual, weight, eps, fwd.entry, bwd_entry,
                         fwd.entry_hidden, ws_bytes, _grid_cap)
    except RuntimeError as exc:  # the C++ forward's failed launch, as the Python path reports it
        rc = _NATIVE_LAUNCH.search(str(exc))
        if rc is None:
            raise
        raise LaunchError(abi._launch_message(fwd.name, "cake_fwd", int(rc.group(1)))) from None
    return out[0] if residual is None else (out[0], out[1])


# as eager_step.cpp's check_launch words a failed forward launch
_NATIVE_LAUNCH = re.compile(r"the forward launch failed with CUDA error (-?\d+)")


# _Eager.apply less Function.apply's Python preamble, which only serves functorch transforms (ruled
# out by _eager()) and setup_context (which _Eager does not define): the C++ apply, with the
# preamble's one other step, unwrapping dead functorch wrappers, done on the tensors here. A third
# of apply's cost at T 128, where the step is host time.
_apply_eager = super(torch.autograd.Function, _Eager).apply
_unwrap_if_dead = getattr(torch._C._functorch, "unwrap_if_dead", lambda t: t)

# Set False to send eager calls through the custom ops too (the env var sets it at import).
EAGER_FAST_PATH: bool = os.environ.get("CAKE_RMSNORM_EAGER_CUSTOM_OP", "") in ("", "0")
_PLAIN = (Tensor, torch.nn.Parameter)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _eager(x: Tensor, weight: Tensor, residual: Optional[Tensor]) -> bool:
    if not EAGER_FAST_PATH or torch.compiler.is_compiling():
        return False
    return (type(x) in _PLAIN and type(weight) in _PLAIN
            and (residual is None or type(residual) in _PLAIN)
            and _get_current_dispatch_mode() is None and not _functorch_active())


# ---- the public op ----------------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, residual: Optional[Tensor] = None,
             backend: Optional[str] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """y = bf16(x · rstd · weight) over the last dim; with `residual`, h = x + residual is
    normalised and (y, h) returned. backend: "det" (bitwise-reproducible backward), "fast", or None
    (det when torch.are_deterministic_algorithms_enabled(), else fast)."""
    backend = resolve_backend(backend)
    checks.check_args(x, weight, residual, eps)
    shape = x.shape
    hidden = shape[-1]
    flat = len(shape) == 2
    x2, weight = _rows(x, hidden, flat), weight.contiguous()
    r2 = None if residual is None else _rows(residual, hidden, flat)
    if _eager(x, weight, residual):
        x2, weight = _unwrap_if_dead(x2), _unwrap_if_dead(weight)
        r2 = None if r2 is None else _unwrap_if_dead(r2)
        step = native.step_op()
        if step is not None and x2.shape[0]:
            out = _native_step(step, x2, r2, weight, float(eps), backend)
        else:
            out = _apply_eager(x2, r2, weight, float(eps), backend)
    elif r2 is None:
        out = _fwd(x2, weight, float(eps), backend)[0]
    else:
        out = _fwd_residual(x2, r2, weight, float(eps), backend)[:2]
    if flat:
        return out
    return out.view(shape) if r2 is None else (out[0].view(shape), out[1].view(shape))


def _rows(t: Tensor, hidden: int, flat: bool) -> Tensor:
    """t as row-major [T, H] rows."""
    t = t.contiguous()
    return t if flat else t.view(-1, hidden)
