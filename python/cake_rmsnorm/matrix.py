"""The CI build matrix (ci/matrix.toml): cells of (arch, host platform, CUDA toolkit) and the
optional native eager step's cells of (torch release, host platform), with selectors.

The archs are the registry's, never listed in the matrix: the provider cells are every registry arch
on every host platform of the matrix, built with its one toolkit; the native cells are every torch
release of its [native] table on every host platform. Identifiers follow cibuildwheel's style,
`<arch tag>-<platform id>` (sm100a-manylinux_x86_64) and `native-torch<release>-<platform id>`
(native-torch2.11.0-manylinux_x86_64), and `select()` takes globs on them.

    matrix = load_matrix()                        # ci/matrix.toml of this checkout
    matrix.select("sm10*-*_x86_64")               # the cells, in matrix order
    matrix.cell("sm100a-manylinux_aarch64").platform.wheel_tag
    matrix.cell("native-torch2.11.0-manylinux_x86_64").torch
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Iterable, Mapping, Optional, Sequence, Tuple, Union

from .build.elf import MACHINES, MANYLINUX
from .errors import CakeError
from .registry import Registry, load_registry

SCHEMA = 1
MATRIX_ENV = "CAKE_RMSNORM_MATRIX"
ID_RE = re.compile(r"[a-z0-9_]+")
VERSION_RE = re.compile(r"\d+\.\d+\.\d+")
PIN_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)")
GLOB_CHARS = "*?["


class MatrixError(CakeError, ValueError):
    """The matrix file is missing or malformed, or a selector matches no cell."""


def default_matrix_path() -> Path:
    """$CAKE_RMSNORM_MATRIX, else ci/matrix.toml of the checkout this package lives in."""
    if os.environ.get(MATRIX_ENV):
        return Path(os.environ[MATRIX_ENV])
    return Path(__file__).resolve().parents[2] / "ci" / "matrix.toml"


@dataclass(frozen=True)
class Toolkit:
    id: str
    nvcc: str  # the full version `nvcc --version` must print, e.g. "13.5.37"
    requirements: Tuple[str, ...]  # pins that install it (ci/run-cell.sh --install-toolkit)
    runtime: str  # pin of the CUDA runtime wheel the providers link and need
    verify_tools: Tuple[str, ...]  # pins shipped in the wheelhouse for `verify installed`


@dataclass(frozen=True)
class HostPlatform:
    id: str  # "manylinux_x86_64"
    machine: str  # `uname -m` of a host that runs the wheel: x86_64, aarch64
    wheel_tag: str  # the provider wheels' platform tag, e.g. "manylinux_2_28_x86_64"
    runner: str  # GitHub Actions runs-on label of a native runner
    cross_from: Tuple[str, ...]  # host machines that can cross-build it (ci/cross/)
    cross_compiler: Optional[str]  # pip requirement of the cross host compiler

    @property
    def glibc(self) -> Tuple[int, int]:
        match = MANYLINUX.fullmatch(self.wheel_tag)
        assert match, self.wheel_tag  # checked at load
        return int(match.group(1)), int(match.group(2))

    @property
    def pip_platforms(self) -> Tuple[str, ...]:
        """`pip download --platform` values that admit wheels this platform installs (pip does not
        widen an explicit --platform to older manylinux tags by itself)."""
        major, minor = self.glibc
        tags = [f"manylinux_{major}_{m}_{self.machine}" for m in range(minor, 16, -1)]
        return tuple(tags + [f"manylinux2014_{self.machine}"])

    def job_fields(self) -> dict:
        """A CI job entry's platform fields, for a cell of either kind: where it runs, its tag."""
        return {"platform": self.id, "machine": self.machine, "wheel_tag": self.wheel_tag,
                "runner": self.runner}

    def builds_on(self, host_machine: str) -> str:
        """'native', 'cross' or '' (this host cannot build the platform's cells)."""
        if host_machine == self.machine:
            return "native"
        return "cross" if host_machine in self.cross_from else ""


@dataclass(frozen=True)
class Native:
    """The optional native eager step's wheel (build/native.py): the torch releases it is built for.
    The wheel requires exactly its torch, so there is one per release (and host platform)."""
    torch: Tuple[str, ...]  # "2.11.0", ...


@dataclass(frozen=True)
class Cell:
    """A provider cell: the shim and one arch's provider wheel for one host platform."""
    arch: str  # "sm_100a"
    arch_tag: str  # "sm100a"
    platform: HostPlatform
    toolkit: Toolkit
    kind: ClassVar[str] = "provider"

    @property
    def identifier(self) -> str:
        return f"{self.arch_tag}-{self.platform.id}"

    def to_dict(self) -> dict:
        """One entry of the CI job matrix (and what ci/run-cell.sh reads)."""
        return {"identifier": self.identifier, "kind": self.kind, "arch": self.arch,
                "arch_tag": self.arch_tag, **self.platform.job_fields(),
                "cross_from": list(self.platform.cross_from),
                "cross_compiler": self.platform.cross_compiler or "",
                "toolkit": self.toolkit.id, "nvcc": self.toolkit.nvcc,
                "toolkit_requirements": list(self.toolkit.requirements),
                "runtime": self.toolkit.runtime, "verify_tools": list(self.toolkit.verify_tools)}


@dataclass(frozen=True)
class NativeCell:
    """A native cell: the cake-rmsnorm-native wheel for one torch release and host platform. It
    needs no CUDA toolkit, and builds only on the platform's own machine (build/native.py downloads
    the host machine's torch wheel and compiles with the host's g++)."""
    torch: str  # "2.11.0"
    platform: HostPlatform
    kind: ClassVar[str] = "native"

    @property
    def identifier(self) -> str:
        return f"native-torch{self.torch}-{self.platform.id}"

    def to_dict(self) -> dict:
        """One entry of the CI job matrix (and what ci/run-cell.sh reads)."""
        return {"identifier": self.identifier, "kind": self.kind, "torch": self.torch,
                **self.platform.job_fields()}


AnyCell = Union[Cell, NativeCell]


@dataclass(frozen=True)
class Matrix:
    source: str
    toolkit: Toolkit
    native: Native
    platforms: Tuple[HostPlatform, ...]
    skip: Tuple[str, ...]
    # provider cells arch-major (registry then platform order), then native cells torch-major;
    # skips removed
    cells: Tuple[AnyCell, ...]

    @property
    def identifiers(self) -> Tuple[str, ...]:
        return tuple(c.identifier for c in self.cells)

    def cell(self, identifier: str) -> AnyCell:
        for cell in self.cells:
            if cell.identifier == identifier:
                return cell
        raise MatrixError(f"no cell {identifier!r} in {self.source}; cells: "
                          f"{', '.join(self.identifiers)}")

    def select(self, patterns: Union[str, Sequence[str], None] = None) -> Tuple[AnyCell, ...]:
        """The cells any glob matches (globs: separated by spaces or commas; None: all cells).
        A glob that matches no cell is an error, so a typo never silently selects nothing."""
        globs = split_globs(patterns)
        if not globs:
            return self.cells
        for glob in globs:
            if not any(fnmatch.fnmatchcase(c.identifier, glob) for c in self.cells):
                raise MatrixError(f"--select {glob!r} matches no cell of {self.source}; cells: "
                                  f"{', '.join(self.identifiers)}")
        return tuple(c for c in self.cells
                     if any(fnmatch.fnmatchcase(c.identifier, g) for g in globs))


def split_globs(patterns: Union[str, Sequence[str], None]) -> Tuple[str, ...]:
    if patterns is None:
        return ()
    items = [patterns] if isinstance(patterns, str) else list(patterns)
    return tuple(g for item in items for g in re.split(r"[\s,]+", item) if g)


# ---- parsing ---------------------------------------------------------------------------------
def _fields(table: Mapping, where: str, required: Iterable[str], optional: Iterable[str] = ()) -> None:
    required, optional = tuple(required), tuple(optional)
    missing = [k for k in required if k not in table]
    unknown = sorted(set(table) - set(required) - set(optional))
    if missing or unknown:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown {', '.join(unknown)}"] if unknown else [])
        raise MatrixError(f"{where}: {'; '.join(parts)}; accepted fields: "
                          f"{', '.join(required + optional)}")


def _string(table: Mapping, key: str, where: str, pattern: Optional[re.Pattern] = None,
            what: str = "a non-empty string") -> str:
    value = table[key]
    if not isinstance(value, str) or not value or (pattern and not pattern.fullmatch(value)):
        raise MatrixError(f"{where}: {key} = {value!r}: expected {what}")
    return value


def _strings(table: Mapping, key: str, where: str, pattern: Optional[re.Pattern] = None,
             what: str = "a list of non-empty strings") -> Tuple[str, ...]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(
            isinstance(v, str) and v and (not pattern or pattern.fullmatch(v)) for v in value):
        raise MatrixError(f"{where}: {key} = {value!r}: expected {what}")
    return tuple(value)


def _toolkit(doc: Mapping, where: str) -> Toolkit:
    table = doc.get("toolkit")
    if not isinstance(table, dict):
        raise MatrixError(f"{where}: needs one [toolkit] table (one toolkit per matrix: the wheel "
                          f"file name does not hold the toolkit), got {table!r}")
    at = f"{where} [toolkit]"
    _fields(table, at, ("id", "nvcc", "requirements", "runtime", "verify_tools"))
    pins = "a list of pip pins 'name==version'"
    return Toolkit(id=_string(table, "id", at, ID_RE, "lower-case letters, digits and _"),
                   nvcc=_string(table, "nvcc", at, VERSION_RE, "a full nvcc version like 13.5.37"),
                   requirements=_strings(table, "requirements", at, PIN_RE, pins),
                   runtime=_string(table, "runtime", at, PIN_RE, "a pip pin 'name==version'"),
                   verify_tools=_strings(table, "verify_tools", at, PIN_RE, pins))


def _native(doc: Mapping, where: str) -> Native:
    table = doc.get("native", {"torch": []})  # optional: no table, no native cells
    if not isinstance(table, dict):
        raise MatrixError(f"{where}: native = {table!r}: expected a [native] table")
    at = f"{where} [native]"
    _fields(table, at, ("torch",))
    releases = _strings(table, "torch", at, VERSION_RE, "a list of torch releases like 2.11.0")
    dupes = sorted({r for r in releases if releases.count(r) > 1})
    if dupes:
        raise MatrixError(f"{at}: torch = {list(releases)!r}: release(s) {', '.join(dupes)} appear "
                          f"more than once; expected each release once (one wheel per release and "
                          f"host platform)")
    return Native(releases)


def _platform(table: object, index: int, where: str) -> HostPlatform:
    at = f"{where} [[platform]] #{index + 1}"
    if not isinstance(table, dict):
        raise MatrixError(f"{at}: expected a table, got {table!r}")
    _fields(table, at, ("id", "machine", "wheel_tag", "runner", "cross_from"), ("cross_compiler",))
    pid = _string(table, "id", at, ID_RE, "lower-case letters, digits and _ (it is part of "
                                          "every cell identifier)")
    at = f"{where} platform {pid!r}"
    machine = table["machine"]
    if machine not in MACHINES:
        raise MatrixError(f"{at}: machine = {machine!r}: expected one of {', '.join(MACHINES)}")
    tag = _string(table, "wheel_tag", at, MANYLINUX, "a tag like manylinux_2_28_<machine>")
    if not tag.endswith(f"_{machine}"):
        raise MatrixError(f"{at}: wheel_tag = {tag!r} does not end in its machine {machine!r}")
    cross_from = _strings(table, "cross_from", at, what=f"a list of machines from "
                                                        f"{', '.join(MACHINES)}")
    bad = [m for m in cross_from if m not in MACHINES or m == machine]
    if bad:
        raise MatrixError(f"{at}: cross_from = {list(cross_from)!r}: {', '.join(bad)} is not "
                          f"another known machine ({', '.join(m for m in MACHINES if m != machine)})")
    compiler = table.get("cross_compiler")
    if cross_from and compiler is None:
        raise MatrixError(f"{at}: cross_from is set, so cross_compiler (a pip pin) is required")
    if compiler is not None:
        compiler = _string(table, "cross_compiler", at, PIN_RE, "a pip pin 'name==version'")
    return HostPlatform(id=pid, machine=machine, wheel_tag=tag,
                        runner=_string(table, "runner", at), cross_from=cross_from,
                        cross_compiler=compiler)


def parse_matrix(doc: Mapping, reg: Registry, source: str = "matrix") -> Matrix:
    """A Matrix from the parsed TOML document: its platforms crossed with the registry's archs, then
    with its native torch releases."""
    _fields(doc, source, ("schema", "toolkit", "platform"), ("skip", "native"))
    if doc["schema"] != SCHEMA:
        raise MatrixError(f"{source}: schema = {doc['schema']!r}; this cake-rmsnorm reads {SCHEMA}")
    toolkit = _toolkit(doc, source)
    native = _native(doc, source)
    tables = doc["platform"]
    if not isinstance(tables, list) or not tables:
        raise MatrixError(f"{source}: needs at least one [[platform]] table, got {tables!r}")
    platforms = tuple(_platform(t, i, source) for i, t in enumerate(tables))
    ids = [p.id for p in platforms]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise MatrixError(f"{source}: platform id(s) {', '.join(dupes)} appear more than once")
    tags = [p.wheel_tag for p in platforms]
    if len(set(tags)) != len(tags):
        raise MatrixError(f"{source}: two platforms share a wheel_tag ({', '.join(tags)}): their "
                          f"wheels would have one file name")
    skip = _strings(doc, "skip", source, what="a list of identifier globs")
    cells = tuple(Cell(arch.name, arch.tag, platform, toolkit)
                  for arch in reg.archs for platform in platforms) + \
        tuple(NativeCell(torch, platform) for torch in native.torch for platform in platforms)
    for glob in skip:
        if not any(fnmatch.fnmatchcase(c.identifier, glob) for c in cells):
            raise MatrixError(f"{source}: skip {glob!r} matches no cell; cells: "
                              f"{', '.join(c.identifier for c in cells)}")
    kept = tuple(c for c in cells if not any(fnmatch.fnmatchcase(c.identifier, g) for g in skip))
    if not kept:
        raise MatrixError(f"{source}: skip {list(skip)!r} removes every cell")
    return Matrix(source, toolkit, native, platforms, skip, kept)


def load_matrix(path: Union[str, Path, None] = None, reg: Optional[Registry] = None) -> Matrix:
    """Read and check the matrix file (default: default_matrix_path())."""
    path = Path(path) if path is not None else default_matrix_path()
    try:
        text = path.read_text()
    except OSError as exc:
        raise MatrixError(f"cannot read the build matrix {path}: {exc.strerror or exc} (it lives "
                          f"in a source checkout, ci/matrix.toml: pass --matrix PATH or set "
                          f"${MATRIX_ENV})") from exc
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{path}: not valid TOML: {exc}") from exc
    return parse_matrix(doc, reg or load_registry(), str(path))
