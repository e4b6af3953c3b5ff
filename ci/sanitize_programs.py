"""Run every library of this GPU's arch at small and ragged T, each output and workspace inside
guard regions (the out-of-bounds canary), for compute-sanitizer to watch:

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 ci/sanitize_programs.py
    (likewise racecheck, initcheck, synccheck)

Libraries are called directly through the loader, not through the router, so every program runs
at every T here, also where its routes would not send it. Set PYTORCH_NO_CUDA_MEMORY_CACHING=1 so
that each buffer is its own allocation for memcheck. Exit 1 if a guard byte changed or an output
is not finite.
"""

from __future__ import annotations

import argparse
import sys

import torch

from cake_rmsnorm.registry import load_registry
from cake_rmsnorm.runtime import device, loader

GUARD = 4096  # bytes each side; a multiple of 256 keeps the payload aligned as the ABI requires
FILL = 0xA5
EPS = 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Guarded:
    """A tensor of `shape`/`dtype` inside a byte buffer whose margins hold FILL."""

    def __init__(self, shape, dtype, init=None):
        numel = 1
        for n in shape:
            numel *= n
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.buf = torch.full((self.nbytes + 2 * GUARD,), FILL, dtype=torch.uint8, device="cuda")
        self.tensor = self.buf[GUARD:GUARD + self.nbytes].view(dtype).view(shape)
        if init is not None:
            self.tensor.copy_(init)

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    def guards_intact(self) -> bool:
        return bool((self.buf[:GUARD] == FILL).all() and (self.buf[GUARD + self.nbytes:] == FILL).all())


def run_library(lib_entry, arch, tokens: int, sm_count: int) -> list:
    """Launch one library once at `tokens`; return the problems found."""
    hidden, wdtype = lib_entry.hidden, DTYPES[lib_entry.weight_dtype]
    lib = loader.load_library(arch, lib_entry)
    gen = torch.Generator(device="cuda").manual_seed(hidden + tokens)
    rand = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    x = rand(tokens, hidden).bfloat16()
    weight = (1 + 0.1 * rand(hidden)).to(wdtype)
    stream = torch.cuda.current_stream().cuda_stream
    outputs = {}
    if lib_entry.program.direction == "fwd":
        res = rand(tokens, hidden).bfloat16() if lib_entry.residual else None
        outputs["y"] = Guarded((tokens, hidden), torch.bfloat16)
        outputs["rstd"] = Guarded((tokens,), torch.float32)
        if res is not None:
            outputs["residual_out"] = Guarded((tokens, hidden), torch.bfloat16)
        lib.fwd(x.data_ptr(), res.data_ptr() if res is not None else 0, weight.data_ptr(),
                outputs["y"].ptr, outputs["residual_out"].ptr if res is not None else 0,
                outputs["rstd"].ptr, tokens, EPS, stream)
    else:
        dy = rand(tokens, hidden).bfloat16()
        dres = rand(tokens, hidden).bfloat16() if lib_entry.residual else None
        rstd = torch.rsqrt(x.float().pow(2).mean(1) + EPS)
        ws_bytes = lib.bwd_workspace_bytes(tokens, sm_count)
        outputs["dx"] = Guarded((tokens, hidden), torch.bfloat16)
        outputs["dw"] = Guarded((hidden,), wdtype)
        workspace = Guarded((max(ws_bytes, 1),), torch.uint8)
        lib.bwd(dy.data_ptr(), dres.data_ptr() if dres is not None else 0, x.data_ptr(),
                weight.data_ptr(), rstd.data_ptr(), outputs["dx"].ptr, outputs["dw"].ptr,
                workspace.ptr, ws_bytes, tokens, 0, stream)
        outputs["workspace"] = workspace
    torch.cuda.synchronize()
    problems = []
    for name, out in outputs.items():
        if not out.guards_intact():
            problems.append(f"{name}: a guard byte changed (write out of bounds)")
        if name != "workspace" and not torch.isfinite(out.tensor.float()).all():
            problems.append(f"{name}: not finite")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,3,1025")
    parser.add_argument("--widths", default=None, help="comma-separated (default: all prebuilt)")
    args = parser.parse_args()
    reg = load_registry()
    info = device.device_info(torch.cuda.current_device())
    widths = [int(w) for w in args.widths.split(",")] if args.widths else None
    # the generic (run-time H) libraries need an H bound at call time: ci/check_programs.py's
    # counterpart does not cover them yet, so the sanitizer runs the prebuilt ones
    libs = [lib for lib in reg.libraries(info.arch.name, widths) if not lib.program.runtime_h]
    tokens = [int(t) for t in args.tokens.split(",")]
    failures = 0
    for lib_entry in libs:
        for t in tokens:
            for problem in run_library(lib_entry, info.arch, t, info.sm_count):
                failures += 1
                print(f"FAIL {lib_entry.name} T={t}: {problem}")
    programs = sorted({lib.program.name for lib in libs})
    print(f"{info.arch.name}: {len(libs)} libraries ({', '.join(programs)}) x T {tokens}: "
          f"{len(libs) * len(tokens)} launches, {failures} problems")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
