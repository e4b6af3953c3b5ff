"""Shared-memory checks of the build: the oversized flag before compiling, ptxas's figures after.

- A library whose declared shared memory passes the opt-in limit needs its program's `oversized = true`
  (its generated source then defines CAKE_OVERSIZED, and its binding sets CUDA 13.4's oversized mode);
  without it the build stops before compiling anything.
- After compiling: ptxas's static shared memory plus the declared dynamic bytes (what the program
  launches with: the generated source static_asserts kSmemBytes == the declaration) must equal the
  declaration, for every kernel of the library; all shared memory is dynamic (common.cuh), so any
  static __shared__ is a disagreement.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from ..errors import BuildError
from ..registry import Library


def check_oversized_flags(arch: str, libs: Iterable[Library]) -> None:
    """BuildError naming every library above the opt-in whose program lacks `oversized = true`."""
    bad = [lib for lib in libs if lib.oversized and not lib.program.oversized]
    if bad:
        limit = bad[0].smem_optin_bytes
        names = ", ".join(f"{lib.name} (program {lib.program.name}: {lib.smem_bytes} B)" for lib in bad)
        raise BuildError(f"{arch}: shared memory above the {limit} B opt-in limit without the "
                         f"oversized flag: {names}; declare `oversized = true` (and a `fallback`) "
                         f"on the program in programs.toml, or make it smaller")


def check_ptxas_smem(lib: Library, kernels: Sequence[Mapping[str, object]]) -> None:
    """BuildError when a kernel's static shared memory plus the declared dynamic bytes is not the
    library's declared shared memory (ptxas's record, from nvcc_step)."""
    if not kernels:
        raise BuildError(f"{lib.name}: ptxas reported no kernels; cannot check its shared memory")
    declared = lib.smem_bytes
    static = max(int(k.get("smem_static", 0)) for k in kernels)
    if static + declared != declared:
        worst = max(kernels, key=lambda k: int(k.get("smem_static", 0)))
        raise BuildError(f"{lib.name}: ptxas reports {static} B of static shared memory in "
                         f"{worst.get('name')} plus {declared} B declared dynamic = "
                         f"{static + declared} B per block, but program {lib.program.name} declares "
                         f"{declared} B; shared memory must all be dynamic and declared")
