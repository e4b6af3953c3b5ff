"""ctypes mirror of csrc/include/cake_rmsnorm/abi.h and a wrapper around one loaded library.

Keep the structs here field-for-field equal to the header: tests/test_runtime_cpu.py compiles a
host-only stub against the real header and checks the layout through these classes.
A generic library (cake_info.hidden == 0) exports the H-taking calls (cake_fwd_h, cake_bwd_h,
cake_bwd_workspace_bytes_h) instead: Library.fwd_h / bwd_h / bwd_workspace_bytes_h call them, and
Library.at(H) gives an object with the plain calls' signatures that passes H (what the op uses).
No torch, no CUDA at import.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

from ..errors import LaunchError, ProviderError

CAKE_ABI_VERSION = 1
CAKE_DIRECTION_FWD = 0
CAKE_DIRECTION_BWD = 1
CAKE_WEIGHT_FP32 = 0
CAKE_WEIGHT_BF16 = 1

DIRECTION_CODES = {"fwd": CAKE_DIRECTION_FWD, "bwd": CAKE_DIRECTION_BWD}
WEIGHT_CODES = {"fp32": CAKE_WEIGHT_FP32, "bf16": CAKE_WEIGHT_BF16}


class CakeInfo(ctypes.Structure):
    _fields_ = [
        ("abi_version", ctypes.c_int32),
        ("direction", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("weight_dtype", ctypes.c_int32),
        ("residual", ctypes.c_int32),
        ("smem_bytes", ctypes.c_int32),
        ("program", ctypes.c_char_p),
    ]


class FwdArgs(ctypes.Structure):
    _fields_ = [
        ("x", ctypes.c_void_p),
        ("residual", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("residual_out", ctypes.c_void_p),
        ("rstd", ctypes.c_void_p),  # float*
        ("T", ctypes.c_int64),
        ("eps", ctypes.c_float),
    ]


class BwdArgs(ctypes.Structure):
    _fields_ = [
        ("dy", ctypes.c_void_p),
        ("dresidual_out", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("rstd", ctypes.c_void_p),  # const float*
        ("dx", ctypes.c_void_p),
        ("dw", ctypes.c_void_p),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("T", ctypes.c_int64),
        ("grid_cap", ctypes.c_int32),
    ]


_WS_CACHE_SIZE = 256  # distinct token counts remembered per library (variable-length batches)


class _PerThread(threading.local):
    """One reusable args struct per thread: the library reads it synchronously during the call."""

    fwd: Optional[FwdArgs] = None
    bwd: Optional[BwdArgs] = None


class Library:
    """One loaded cake library: its ctypes functions, checked against what the registry expects."""

    def __init__(self, name: str, path: Path, cdll: ctypes.CDLL, info: CakeInfo,
                 direction: str) -> None:
        self.name = name
        self.path = path
        self.cdll = cdll
        self.info = info
        self.direction = direction
        self.program = (info.program or b"").decode("utf-8", "replace")
        self._local = _PerThread()
        self._ws_bytes: dict = {}
        self._fwd = self._bwd = self._ws = None
        self.generic = info.hidden == 0  # H is an argument of its calls (abi.h)
        self._fwd_h = self._bwd_h = self._ws_h = None
        if self.generic:
            self._fwd = self._bwd = self._ws = _needs_hidden(name)  # the plain calls: a clear error
            if direction == "fwd":
                self._fwd_h = _function(cdll, name, "cake_fwd_h", ctypes.c_int,
                                        [ctypes.POINTER(FwdArgs), ctypes.c_int32, ctypes.c_void_p])
            else:
                self._ws_h = _function(cdll, name, "cake_bwd_workspace_bytes_h", ctypes.c_size_t,
                                       [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32])
                self._bwd_h = _function(cdll, name, "cake_bwd_h", ctypes.c_int,
                                        [ctypes.POINTER(BwdArgs), ctypes.c_int32, ctypes.c_void_p])
        elif direction == "fwd":
            self._fwd = _function(cdll, name, "cake_fwd", ctypes.c_int,
                                  [ctypes.POINTER(FwdArgs), ctypes.c_void_p])
        else:
            self._ws = _function(cdll, name, "cake_bwd_workspace_bytes", ctypes.c_size_t,
                                 [ctypes.c_int64, ctypes.c_int32])
            self._bwd = _function(cdll, name, "cake_bwd", ctypes.c_int,
                                  [ctypes.POINTER(BwdArgs), ctypes.c_void_p])
        # the launch call's address, for callers outside Python (runtime/native.py's C++ step);
        # a generic library's takes H (AtHidden.entry_hidden)
        call = self._fwd_h or self._fwd if direction == "fwd" else self._bwd_h or self._bwd
        self.entry: int = ctypes.cast(call, ctypes.c_void_p).value or 0
        self.entry_hidden = 0

    @classmethod
    def open(cls, path: Path, *, name: str, program: str, direction: str, hidden: int,
             weight_dtype: str, residual: bool, mode: int = ctypes.DEFAULT_MODE) -> "Library":
        """dlopen `path` (absolute) and check its cake_info against the registry's library."""
        try:
            cdll = ctypes.CDLL(str(path), mode=mode)
        except OSError as exc:
            raise ProviderError(f"cannot load library {name} from {path}: {exc}") from exc
        info_fn = _function(cdll, name, "cake_info", ctypes.c_int, [ctypes.POINTER(CakeInfo)])
        info = CakeInfo()
        rc = info_fn(ctypes.byref(info))
        if rc != 0:
            raise ProviderError(f"library {name} ({path}): cake_info returned error {rc}")
        expected = {
            "abi_version": CAKE_ABI_VERSION,
            "direction": DIRECTION_CODES[direction],
            "hidden": hidden,
            "weight_dtype": WEIGHT_CODES[weight_dtype],
            "residual": int(bool(residual)),
        }
        wrong = [f"{k} {getattr(info, k)} (expected {v})" for k, v in expected.items()
                 if getattr(info, k) != v]
        got_program = (info.program or b"").decode("utf-8", "replace")
        if got_program != program:
            wrong.append(f"program {got_program!r} (expected {program!r})")
        if wrong:
            raise ProviderError(f"library {name} ({path}) does not match the registry: "
                                + "; ".join(wrong) + ". Reinstall the provider wheel of this "
                                "cake-rmsnorm version.")
        return cls(name, Path(path), cdll, info, direction)

    # ---- calls (hot path) --------------------------------------------------------------------
    def _fwd_args(self, x, residual, weight, y, residual_out, rstd, tokens, eps) -> FwdArgs:
        """This thread's reused argument struct, filled (the fixed-H and generic calls share it)."""
        args = self._local.fwd
        if args is None:
            args = self._local.fwd = FwdArgs()
        args.x, args.residual, args.weight = x, residual, weight
        args.y, args.residual_out, args.rstd = y, residual_out, rstd
        args.T, args.eps = tokens, eps
        return args

    def _bwd_args(self, dy, dresidual_out, x, weight, rstd, dx, dw, workspace, workspace_bytes,
                  tokens, grid_cap) -> BwdArgs:
        args = self._local.bwd
        if args is None:
            args = self._local.bwd = BwdArgs()
        args.dy, args.dresidual_out, args.x, args.weight = dy, dresidual_out, x, weight
        args.rstd, args.dx, args.dw = rstd, dx, dw
        args.workspace, args.workspace_bytes = workspace, workspace_bytes
        args.T, args.grid_cap = tokens, grid_cap
        return args

    def fwd(self, x: int, residual: int, weight: int, y: int, residual_out: int, rstd: int,
            tokens: int, eps: float, stream: int) -> None:
        args = self._fwd_args(x, residual, weight, y, residual_out, rstd, tokens, eps)
        rc = self._fwd(args, stream)  # type: ignore[misc]
        if rc:
            raise LaunchError(_launch_message(self.name, "cake_fwd", rc))

    def bwd_workspace_bytes(self, tokens: int, sm_count: int) -> int:
        # remembered per (T, SM count): a ctypes call costs more than the lookup on the hot path
        key = (tokens, sm_count)
        n = self._ws_bytes.get(key)
        if n is None:
            if len(self._ws_bytes) >= _WS_CACHE_SIZE:
                self._ws_bytes.clear()
            n = self._ws_bytes[key] = int(self._ws(tokens, sm_count))  # type: ignore[misc]
        return n

    def bwd(self, dy: int, dresidual_out: int, x: int, weight: int, rstd: int, dx: int, dw: int,
            workspace: int, workspace_bytes: int, tokens: int, grid_cap: int, stream: int) -> None:
        args = self._bwd_args(dy, dresidual_out, x, weight, rstd, dx, dw, workspace, workspace_bytes,
                              tokens, grid_cap)
        rc = self._bwd(args, stream)  # type: ignore[misc]
        if rc:
            raise LaunchError(_launch_message(self.name, "cake_bwd", rc, self.info.smem_bytes))

    # ---- generic libraries: the same calls with H -------------------------------------------
    def fwd_h(self, x: int, residual: int, weight: int, y: int, residual_out: int, rstd: int,
              tokens: int, eps: float, hidden: int, stream: int) -> None:
        args = self._fwd_args(x, residual, weight, y, residual_out, rstd, tokens, eps)
        rc = self._fwd_h(args, hidden, stream)  # type: ignore[misc]
        if rc:
            raise LaunchError(_launch_message(self.name, "cake_fwd_h", rc) + f" (H={hidden})")

    def bwd_workspace_bytes_h(self, tokens: int, hidden: int, sm_count: int) -> int:
        return int(self._ws_h(tokens, hidden, sm_count))  # type: ignore[misc]

    def bwd_h(self, dy: int, dresidual_out: int, x: int, weight: int, rstd: int, dx: int, dw: int,
              workspace: int, workspace_bytes: int, tokens: int, grid_cap: int, hidden: int,
              stream: int) -> None:
        args = self._bwd_args(dy, dresidual_out, x, weight, rstd, dx, dw, workspace, workspace_bytes,
                              tokens, grid_cap)
        rc = self._bwd_h(args, hidden, stream)  # type: ignore[misc]
        if rc:
            raise LaunchError(_launch_message(self.name, "cake_bwd_h", rc, self.info.smem_bytes)
                              + f" (H={hidden})")

    def at(self, hidden: int) -> "AtHidden":
        """This generic library's calls at one H, with the plain calls' signatures."""
        if not self.generic:
            raise ValueError(f"library {self.name} is built for H={self.info.hidden}; only a "
                             f"generic library (hidden 0) takes H")
        return AtHidden(self, hidden)

    def __repr__(self) -> str:
        return f"<cake library {self.name} at {self.path}>"


class AtHidden:
    """A generic library at one H: fwd, bwd and bwd_workspace_bytes as a prebuilt library's."""

    __slots__ = ("library", "hidden")

    def __init__(self, library: Library, hidden: int) -> None:
        self.library = library
        self.hidden = hidden

    def fwd(self, x: int, residual: int, weight: int, y: int, residual_out: int, rstd: int,
            tokens: int, eps: float, stream: int) -> None:
        self.library.fwd_h(x, residual, weight, y, residual_out, rstd, tokens, eps, self.hidden,
                           stream)

    def bwd_workspace_bytes(self, tokens: int, sm_count: int) -> int:
        return self.library.bwd_workspace_bytes_h(tokens, self.hidden, sm_count)

    def bwd(self, dy: int, dresidual_out: int, x: int, weight: int, rstd: int, dx: int, dw: int,
            workspace: int, workspace_bytes: int, tokens: int, grid_cap: int, stream: int) -> None:
        self.library.bwd_h(dy, dresidual_out, x, weight, rstd, dx, dw, workspace, workspace_bytes,
                           tokens, grid_cap, self.hidden, stream)

    @property
    def entry_hidden(self) -> int:
        return self.hidden

    def __getattr__(self, name: str):  # name, path, cdll, info, direction, program: the library's
        return getattr(self.library, name)

    def __repr__(self) -> str:
        return f"<cake library {self.library.name} at H={self.hidden}>"


def _needs_hidden(lib_name: str):
    def call(*args):
        raise ProviderError(f"library {lib_name} is generic (H is an argument of its calls): call "
                            f"it through .at(H), or fwd_h / bwd_workspace_bytes_h / bwd_h")
    return call


def _function(cdll: ctypes.CDLL, lib_name: str, symbol: str, restype, argtypes):
    try:
        fn = getattr(cdll, symbol)
    except AttributeError:
        raise ProviderError(f"library {lib_name} does not export {symbol}: not a cake-rmsnorm "
                            f"library of ABI version {CAKE_ABI_VERSION}") from None
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


_error_name = None  # set by the loader once libcudart is known: int -> str


def set_error_namer(namer) -> None:
    global _error_name
    _error_name = namer


# Above this a launch needs its shared memory granted (cudaFuncSetAttribute), which may be refused.
DEFAULT_DYN_SMEM_BYTES = 48 * 1024


def _launch_message(lib_name: str, symbol: str, rc: int, smem_bytes: int = 0) -> str:
    name = ""
    if _error_name is not None:
        try:
            name = f" ({_error_name(rc)})"
        except Exception:  # naming the error must never hide it
            name = ""
    hint = ""
    if smem_bytes > DEFAULT_DYN_SMEM_BYTES:
        hint = (f"; it needs {smem_bytes} B of shared memory per block, which this device, driver "
                f"or CUDA runtime may not grant (see `cake-rmsnorm doctor`); the library cleared the "
                f"error, so the process can keep using CUDA")
    return f"{symbol} of library {lib_name} failed: CUDA error {rc}{name}{hint}"
