"""The registry of programs and routes: the one source of truth for the build planner, the runtime
router, the tests and the CLI. Data and queries only; it imports nothing else of the project
(except the error classes), no torch and no CUDA.

    reg = load_registry()
    reg.route("sm_90a", "det", "bwd", hidden=4096, tokens=65536, weight_dtype="fp32", residual=False)
    reg.libraries("sm_90a")

Widths that are not prebuilt (a multiple of 8 up to `max_hidden`) route, at every T and for both
backends, to the generic (runtime-H) program of their direction; one generic library per (arch,
direction, weight dtype, residual) serves them all and is part of every arch's plan.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple

from ..errors import RouteError
from .load import (DATA_DIR, apply_overrides, check_gated, generic_programs, parse_archs,
                   parse_programs, parse_routes, read_toml)
from .model import (FORMS, GENERIC_HIDDEN, REDUCTIONS, Arch, Kernel, Library, LibraryKey, Program,
                    Route, TableKey, Window)

__all__ = ["Registry", "load_registry", "Arch", "Kernel", "Program", "Library", "LibraryKey",
           "Route", "TableKey", "Window", "FORMS", "REDUCTIONS", "GENERIC_HIDDEN", "GENERIC_LABEL"]

# The label of the one window (T 1..inf) of a generic width's table.
GENERIC_LABEL = "generic"


@dataclass(frozen=True)
class Registry:
    archs: Tuple[Arch, ...]
    widths: Tuple[int, ...]
    weight_dtypes: Tuple[str, ...]
    backends: Tuple[str, ...]
    directions: Tuple[str, ...]
    smem_optin_bytes: int
    programs: Dict[str, Program]
    tables: Dict[TableKey, Tuple[Window, ...]]
    generic: Dict[str, Program]  # direction -> the runtime-H program for widths not prebuilt

    # ---- archs -------------------------------------------------------------------------------
    @property
    def arch_names(self) -> Tuple[str, ...]:
        return tuple(a.name for a in self.archs)

    def arch(self, name: str) -> Arch:
        for arch in self.archs:
            if arch.name == name:
                return arch
        raise RouteError(f"unknown arch {name!r}; known: {', '.join(self.arch_names)}")

    def arch_for_capability(self, major: int, minor: int) -> Optional[Arch]:
        """The arch built for exactly this compute capability (no 'same major' guessing)."""
        for arch in self.archs:
            if arch.compute_capability == (major, minor):
                return arch
        return None

    def parse_arch_list(self, text: str) -> Tuple[Arch, ...]:
        """`sm_90a`, `sm_90a,sm_100a` or `all` → archs, in registry order."""
        if text.strip() == "all":
            return self.archs
        names = [t.strip() for t in text.split(",") if t.strip()]
        if not names:
            raise RouteError(f"no arch named in {text!r}; known: {', '.join(self.arch_names)}, all")
        picked = {self.arch(n).name for n in names}
        return tuple(a for a in self.archs if a.name in picked)

    # ---- widths ------------------------------------------------------------------------------
    @property
    def max_hidden(self) -> int:
        """The largest H the op takes: what every generic program takes."""
        return min(p.max_hidden for p in self.generic.values())  # type: ignore[type-var]

    def is_generic_width(self, hidden: int) -> bool:
        """Not a prebuilt width, but a multiple of 8 from 8 to max_hidden: the generic programs
        run it."""
        return (hidden not in self.widths and hidden % 8 == 0
                and 8 <= hidden <= self.max_hidden)

    def accepts_hidden(self, hidden: int) -> bool:
        return hidden in self.widths or self.is_generic_width(hidden)

    def describe_hidden(self) -> str:
        """What H may be, for error messages."""
        return (f"a multiple of 8 from 8 to {self.max_hidden}; the prebuilt widths "
                f"{', '.join(map(str, self.widths))} are the fast ones, any other runs the generic "
                f"program")

    # ---- routes ------------------------------------------------------------------------------
    def table(self, key: TableKey) -> Tuple[Window, ...]:
        """The key's windows; a generic width's table is one window, T 1..inf, of the generic
        program of its direction (both backends)."""
        try:
            return self.tables[key]
        except KeyError:
            pass
        if (self.is_generic_width(key.hidden) and key.arch in self.arch_names
                and key.backend in self.backends and key.direction in self.generic
                and key.weight_dtype in self.weight_dtypes):
            return (Window(1, None, self.generic[key.direction], GENERIC_LABEL),)
        raise RouteError(f"no route table for {key.describe()}")

    def route(self, arch: str, backend: str, direction: str, hidden: int, tokens: int,
              weight_dtype: str = "fp32", residual: bool = False) -> Route:
        """Which program and library run this point, and the window that says so."""
        self.arch(arch)
        for label, value, allowed in (("backend", backend, self.backends),
                                      ("direction", direction, self.directions),
                                      ("weight_dtype", weight_dtype, self.weight_dtypes)):
            if value not in allowed:
                raise RouteError(f"{label} {value!r} is not one of {list(allowed)}")
        if not self.accepts_hidden(hidden):
            raise RouteError(f"H={hidden} is not a prebuilt width and no generic program takes it; "
                             f"H must be {self.describe_hidden()}")
        if tokens < 1:
            raise RouteError(f"T={tokens}: routes start at T 1")
        key = TableKey(arch, backend, direction, weight_dtype, bool(residual), hidden)
        windows = self.table(key)
        idx = bisect.bisect_right([w.first for w in windows], tokens) - 1
        window = windows[idx]
        return Route(key, tokens, window, self._library(arch, window.program, key))

    # ---- libraries ---------------------------------------------------------------------------
    def _library(self, arch: str, program: Program, key: TableKey) -> Library:
        hidden = GENERIC_HIDDEN if program.runtime_h else key.hidden
        return Library(arch, program, LibraryKey(hidden, key.weight_dtype, key.residual),
                       self.smem_optin_bytes)

    def fallback(self, library: Library) -> Optional[Library]:
        """The library that runs in place of a gated `library` (same arch, H, dtype, residual), or
        None when its program declares no fallback."""
        name = library.program.fallback
        if name is None:
            return None
        return Library(library.arch, self.programs[name], library.key, self.smem_optin_bytes)

    def gated(self, arch: str) -> Tuple[Library, ...]:
        """The libraries of `arch` above the opt-in limit (run only where the capability allows)."""
        return tuple(lib for lib in self.libraries(arch) if lib.oversized)

    def generic_libraries(self, arch: str) -> Tuple[Library, ...]:
        """One library per (direction, weight dtype, residual): the generic programs, for `arch`."""
        return tuple(Library(arch, program, LibraryKey(GENERIC_HIDDEN, wd, res),
                             self.smem_optin_bytes)
                     for program in self.generic.values() for wd in self.weight_dtypes
                     for res in (False, True))

    def libraries(self, arch: str, widths: Optional[Iterable[int]] = None) -> Tuple[Library, ...]:
        """Every library `arch` needs, sorted by name: derived from its routes (of `widths`, default
        every prebuilt width), plus the fallbacks of its gated (oversized) libraries, plus its
        generic libraries (whatever `widths` says: they serve every width that is not prebuilt)."""
        self.arch(arch)
        wanted = set(self.widths if widths is None else widths)
        unknown = wanted - set(self.widths)
        if unknown:
            raise RouteError(f"width(s) {sorted(unknown)} are not prebuilt widths; prebuilt: "
                             f"{', '.join(map(str, self.widths))}")
        libs = {}
        for key, windows in self.tables.items():
            if key.arch != arch or key.hidden not in wanted:
                continue
            for window in windows:
                lib = self._library(arch, window.program, key)
                libs[lib.name] = lib
                fallback = self.fallback(lib) if lib.oversized else None
                if fallback is not None:
                    libs[fallback.name] = fallback
        for lib in self.generic_libraries(arch):
            libs[lib.name] = lib
        return tuple(libs[name] for name in sorted(libs))


def build_registry(data_dir: Path) -> Registry:
    archs_file, programs_file, routes_file = (data_dir / n for n in
                                              ("archs.toml", "programs.toml", "routes.toml"))
    archs, axes = parse_archs(read_toml(archs_file), archs_file.name)
    programs = parse_programs(read_toml(programs_file), programs_file.name)
    routes_doc = read_toml(routes_file)
    tables = parse_routes(routes_doc, routes_file.name, archs, axes, programs)
    # The tuner's windows (data/tuned/<arch>.toml, generated, reviewed and committed) splice in too.
    tuned = [(read_toml(path), f"tuned/{path.name}")
             for path in sorted((data_dir / "tuned").glob("*.toml"))]
    apply_overrides([(routes_doc, routes_file.name)] + tuned, archs, axes, programs, tables)
    check_gated(tables, programs, axes["smem_optin_bytes"], routes_file.name)
    return Registry(archs=archs, widths=axes["widths"], weight_dtypes=axes["weight_dtypes"],
                    backends=axes["backends"], directions=axes["directions"],
                    smem_optin_bytes=axes["smem_optin_bytes"], programs=programs, tables=tables,
                    generic=generic_programs(programs, axes["directions"], programs_file.name))


@functools.lru_cache(maxsize=None)
def load_registry(data_dir: Optional[str] = None) -> Registry:
    """The registry from `data_dir` (default: the package's own data), validated, cached."""
    return build_registry(Path(data_dir) if data_dir else DATA_DIR)
