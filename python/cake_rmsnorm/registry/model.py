"""The registry's value objects: frozen, typed, and free of any project import, torch or CUDA."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

FORMS = ("forward", "pair", "single", "column_task")
REDUCTIONS = ("fp32", "blocked_fp32", "twosum", "fp64_fold", "fixed64")
# The hidden size of a generic library: its program takes H at run time and serves every width
# that is not prebuilt (a multiple of 8 up to its max_hidden). Its name says "hany".
GENERIC_HIDDEN = 0


@dataclass(frozen=True)
class Arch:
    name: str  # e.g. "sm_90a"
    compute_capability: Tuple[int, int]
    sm_count: int
    gpus: str

    @property
    def tag(self) -> str:
        """The arch as it appears in distribution names and extras: "sm90a"."""
        return self.name.replace("_", "")

    @property
    def gencode(self) -> str:
        """nvcc's -gencode value: SASS for exactly this arch, no PTX."""
        num = self.name[len("sm_"):]
        return f"arch=compute_{num},code=sm_{num}"

    @property
    def virtual_arch(self) -> str:
        """The `compute_NN` name `nvcc --list-gpu-arch` must list for this arch ("a" dropped)."""
        return "compute_" + self.name[len("sm_"):].rstrip("a")


@dataclass(frozen=True)
class Kernel:
    """A kernel family: one C++ template in csrc/include."""

    name: str
    header: str
    template: str
    direction: str
    form: str
    params: Tuple[str, ...]
    reductions: Tuple[str, ...]  # the dw reductions the template implements
    runtime_h: bool = False  # H is a run-time argument (Template<WeightT, kResidual, ...>, no H)


@dataclass(frozen=True)
class Program:
    """One compiled strategy and launch policy: a kernel family with fixed parameters."""

    name: str
    kernel: Kernel
    reduction: str
    deterministic: bool
    params: Tuple[Tuple[str, int], ...]  # in the kernel's declared order
    smem_fixed: int
    smem_per_h: int
    about: str
    oversized: bool = False  # declared: may pass the opt-in limit (CUDA 13.4 oversized mode)
    fallback: Optional[str] = None  # program run where this one's shared memory cannot be had
    max_tokens: Optional[int] = None  # the largest T a route may send it (programs.toml says why)
    max_hidden: Optional[int] = None  # runtime-H programs: the largest H they take

    @property
    def direction(self) -> str:
        return self.kernel.direction

    @property
    def runtime_h(self) -> bool:
        """A generic program: one library serves every H it takes (H given at run time)."""
        return self.kernel.runtime_h

    @property
    def form(self) -> str:
        return self.kernel.form

    def smem_bytes(self, hidden: int) -> int:
        return self.smem_fixed + self.smem_per_h * hidden


@dataclass(frozen=True, order=True)
class LibraryKey:
    """What a library is compiled for besides its program and arch."""

    hidden: int
    weight_dtype: str
    residual: bool

    @property
    def generic(self) -> bool:
        return self.hidden == GENERIC_HIDDEN

    @property
    def suffix(self) -> str:
        h = "hany" if self.generic else f"h{self.hidden}"
        return f"{h}_{self.weight_dtype}" + ("_res" if self.residual else "")


@dataclass(frozen=True)
class Library:
    """One program compiled for one (arch, H, weight dtype, residual); H = GENERIC_HIDDEN for a
    generic (runtime-H) program's library."""

    arch: str
    program: Program
    key: LibraryKey
    smem_optin_bytes: int

    @property
    def name(self) -> str:
        return f"{self.program.name}_{self.key.suffix}"

    @property
    def filename(self) -> str:
        return f"lib{self.name}.so"

    @property
    def hidden(self) -> int:
        return self.key.hidden

    @property
    def generic(self) -> bool:
        """H is an argument of its calls (cake_fwd_h / cake_bwd_h): it serves any H it takes."""
        return self.key.generic

    @property
    def weight_dtype(self) -> str:
        return self.key.weight_dtype

    @property
    def residual(self) -> bool:
        return self.key.residual

    @property
    def smem_bytes(self) -> int:
        return self.program.smem_bytes(self.key.hidden)

    @property
    def oversized(self) -> bool:
        """Needs CUDA 13.4's oversized shared-memory mode (more than the opt-in limit): a *gated*
        library, run only where the runtime capability check says its bytes fit."""
        return self.smem_bytes > self.smem_optin_bytes

    def plan_fields(self) -> dict:
        """The fields `plan --json` and the manifest share."""
        return {
            "name": self.name,
            "program": self.program.name,
            "H": self.key.hidden,
            "weight_dtype": self.key.weight_dtype,
            "residual": self.key.residual,
            "smem_bytes": self.smem_bytes,
            "oversized": self.oversized,
        }


@dataclass(frozen=True, order=True)
class TableKey:
    """One route table: the T windows for one of these."""

    arch: str
    backend: str
    direction: str
    weight_dtype: str
    residual: bool
    hidden: int

    def describe(self) -> str:
        res = "residual" if self.residual else "no residual"
        return (f"{self.arch} {self.backend} {self.direction} H={self.hidden} "
                f"{self.weight_dtype} weight, {res}")


@dataclass(frozen=True)
class Window:
    """Inclusive token range [first, last]; last None means no upper bound."""

    first: int
    last: Optional[int]
    program: Program
    label: str = ""  # the [[override]] that placed it (e.g. "F2": a WINDOWS.md row), else ""

    def contains(self, tokens: int) -> bool:
        return tokens >= self.first and (self.last is None or tokens <= self.last)

    def overlaps(self, other: "Window") -> bool:
        return ((other.last is None or self.first <= other.last)
                and (self.last is None or other.first <= self.last))

    def describe(self) -> str:
        hi = "inf" if self.last is None else str(self.last)
        return f"T {self.first}..{hi}"


@dataclass(frozen=True)
class Route:
    """The answer to a routing query: which program and library run a point, and why."""

    table: TableKey
    tokens: int
    window: Window
    library: Library = field(compare=False)

    @property
    def program(self) -> Program:
        return self.window.program
