"""Acceptance 3 of issue 6, on an H200 (driver 580 / CUDA 13.0 runtime), in one process:

    python ci/oversized_libs.py                      # here, once: builds .carry/oversized (sm_90a)
    python ci/oversized_check.py [--libs .carry/oversized]     # on the GPU machine

1. `cake-rmsnorm doctor` (python -m cake_rmsnorm doctor) reports oversized shared memory unsupported.
2. The capability probe gets 0 for device attribute 150 and leaves no CUDA error behind
   (cudaGetLastError is 0 after it, and a following CUDA call succeeds).
3. The staged reduce at stage_bytes under the opt-in (4096 and 200704 B) gives det dx/dw bits
   identical to det_pair_c64's (its fallback) at H 4096, T 1025, 65536 (and 131072: many stages).
4. The test library staged above the opt-in (271360 B) raises a clear LaunchError; afterwards no
   CUDA error is pending, det_pair_c64 still gives the same bits, and a normal op call
   (cake_rmsnorm.rms_norm, det, forward + backward, through the installed sm_90a provider) is correct.
Prints one line per check and `OVERSIZED CHECK: PASS` (exit 0) or `OVERSIZED CHECK: FAIL` (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

from cake_rmsnorm.accuracy import same_bits  # noqa: E402
from cake_rmsnorm.errors import LaunchError  # noqa: E402
from cake_rmsnorm.runtime import abi, capability, loader  # noqa: E402

H = 4096
TOKENS = (1025, 65536, 131072)
failures = []


def report(ok: bool, what: str) -> None:
    print(f"[{'PASS' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        failures.append(what)


def open_lib(folder: Path, entry: dict) -> abi.Library:
    return abi.Library.open(folder / entry["file"], name=entry["name"], program=entry["program"],
                            direction="bwd", hidden=H, weight_dtype="fp32", residual=False)


def inputs(T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).float()
    rstd = torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6).float()
    return x, dy, w, rstd


def run_bwd(lib: abi.Library, x, dy, w, rstd, sm: int):
    T = x.shape[0]
    dx = torch.empty_like(x)
    dw = torch.empty(H, device="cuda", dtype=torch.float32)
    ws_bytes = lib.bwd_workspace_bytes(T, sm)
    ws = torch.empty(max(ws_bytes, 1), device="cuda", dtype=torch.uint8)
    stream = torch.cuda.current_stream().cuda_stream
    lib.bwd(dy.data_ptr(), 0, x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
            dw.data_ptr(), ws.data_ptr(), ws_bytes, T, 0, stream)
    torch.cuda.synchronize()
    return dx, dw


def reference_dw(x, dy, w, rstd):
    xhat = x.double() * rstd.double()[:, None]
    return (dy.double() * xhat).sum(0)


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--libs", default=str(ROOT / ".carry" / "oversized"))
    args = ap.parse_args(argv)
    folder = Path(args.libs).resolve()
    index = {e["name"]: e for e in json.loads((folder / "index.json").read_text())["libraries"]}
    torch.cuda.init()
    print(f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} "
          f"(CUDA {torch.version.cuda})", flush=True)

    # 1. doctor
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-m", "cake_rmsnorm", "doctor"], capture_output=True,
                          text=True, env=env)
    print("---- cake-rmsnorm doctor ----\n" + proc.stdout + proc.stderr + "-----------------------------")
    report(proc.returncode == 0 and "oversized shared memory: unsupported" in proc.stdout,
           "doctor exits 0 and reports oversized shared memory unsupported")

    # 2. capability probe: attribute 150 -> 0, nothing sticky
    cudart = loader.ensure_cudart()
    cap = capability.query(cudart, torch.cuda.current_device())
    print(f"capability: {cap}")
    ok, why = cap.fits(271360)
    report(cap.oversized_bytes == 0 and not ok,
           f"probe: attribute 150 -> {cap.oversized_bytes} (CUDA error {cap.oversized_error}); "
           f"271360 B refused: {why}")
    pending = cudart.cudaPeekAtLastError()
    sync = cudart.cudaDeviceSynchronize()
    torch.ones(4, device="cuda").sum().item()
    report(pending == 0 and sync == 0 and cudart.cudaGetLastError() == 0,
           f"no sticky error after the probe (peek {pending}, synchronize {sync}, torch op ran)")

    # 3. staged (under the opt-in) vs det_pair_c64: identical bits
    sm = cap.sm_count
    fallback = open_lib(folder, index["det_pair_c64_h4096_fp32"])
    staged = [open_lib(folder, e) for e in index.values()
              if e["program"].startswith("test_staged") and not e["oversized"]]
    saved = {}
    for T in TOKENS:
        x, dy, w, rstd = inputs(T, seed=T)
        dx0, dw0 = run_bwd(fallback, x, dy, w, rstd, sm)
        ref = reference_dw(x, dy, w, rstd)
        rel = ((dw0.double() - ref).norm() / ref.norm()).item()
        report(rel <= 1e-4, f"det_pair_c64 T {T}: dw relL2 vs FP64 reference {rel:.2e}")
        dx_again, dw_again = run_bwd(fallback, x, dy, w, rstd, sm)
        report(same_bits(dx0, dx_again) and same_bits(dw0, dw_again),
               f"det_pair_c64 T {T}: repeat bits identical")
        for lib in staged:
            dx1, dw1 = run_bwd(lib, x, dy, w, rstd, sm)
            report(same_bits(dx0, dx1) and same_bits(dw0, dw1),
                   f"{lib.name} ({lib.info.smem_bytes} B) T {T}: dx and dw bits == det_pair_c64's")
        if T == TOKENS[0]:
            saved = {"in": (x, dy, w, rstd), "dx": dx0, "dw": dw0}
        del x, dy, w, rstd
        torch.cuda.empty_cache()

    # 4. above the opt-in: clear error, process keeps working
    over = open_lib(folder, next(e for e in index.values() if e["oversized"]))
    x, dy, w, rstd = saved["in"]
    try:
        run_bwd(over, x, dy, w, rstd, sm)
        report(False, f"{over.name}: launch above the opt-in raised no error")
    except LaunchError as exc:
        print(f"LaunchError: {exc}")
        report("271360 B" in str(exc) and over.name in str(exc),
               f"{over.name}: LaunchError names the library and its 271360 B")
    pending = cudart.cudaPeekAtLastError()
    sync = cudart.cudaDeviceSynchronize()
    report(pending == 0 and sync == 0, f"no CUDA error pending after it (peek {pending}, "
           f"synchronize {sync})")
    dx2, dw2 = run_bwd(fallback, x, dy, w, rstd, sm)
    report(same_bits(saved["dx"], dx2) and same_bits(saved["dw"], dw2),
           "det_pair_c64 after the error: same bits as before")

    import cake_rmsnorm
    try:
        xo = x.clone().requires_grad_(True)
        wo = w.clone().requires_grad_(True)
        y = cake_rmsnorm.rms_norm(xo, wo, eps=1e-6, backend="det")
        y.backward(dy)
        torch.cuda.synchronize()
        rstd64 = torch.rsqrt(x.double().pow(2).mean(-1) + 1e-6)
        y_ref = (x.double() * rstd64[:, None] * w.double())
        y_err = (y.double() - y_ref).abs().max().item()
        dw_ref = reference_dw(x, dy, w, rstd64.float())
        dw_rel = ((wo.grad.double() - dw_ref).norm() / dw_ref.norm()).item()
        report(y_err <= 2 ** -7 * y_ref.abs().max().item() and dw_rel <= 1e-4,
               f"op call after the error (rms_norm det, T {x.shape[0]}): y max err {y_err:.2e}, "
               f"dw relL2 {dw_rel:.2e}")
    except Exception as exc:  # a missing provider or a broken op both fail the check
        report(False, f"op call after the error: {type(exc).__name__}: {exc}")

    print(f"OVERSIZED CHECK: {'PASS' if not failures else 'FAIL'}"
          + (f" ({len(failures)} failed: {'; '.join(failures)})" if failures else ""))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
