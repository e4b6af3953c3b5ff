"""Read the registry's TOML data and validate it; every inconsistency is a RegistryError that
names the file, the table and the window at fault."""

from __future__ import annotations

import dataclasses
import itertools
import tomllib
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Tuple

from ..errors import RegistryError
from .model import FORMS, REDUCTIONS, Arch, Kernel, Program, TableKey, Window

DATA_DIR = Path(__file__).resolve().parent / "data"


def read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RegistryError(f"{path.name}: cannot read registry data: {exc}") from exc


def _require(mapping: Mapping, key: str, where: str):
    if key not in mapping:
        raise RegistryError(f"{where}: missing field {key!r}")
    return mapping[key]


def _check_unknown(mapping: Mapping, allowed: Iterable[str], where: str) -> None:
    extra = sorted(set(mapping) - set(allowed))
    if extra:
        raise RegistryError(f"{where}: unknown field(s) {extra}; allowed: {sorted(allowed)}")


def parse_archs(doc: dict, source: str) -> Tuple[Tuple[Arch, ...], dict]:
    archs = []
    for i, raw in enumerate(_require(doc, "arch", source)):
        where = f"{source} arch #{i + 1}"
        _check_unknown(raw, ("name", "compute_capability", "sm_count", "gpus"), where)
        name = _require(raw, "name", where)
        if not (name.startswith("sm_") and name.endswith("a")):
            raise RegistryError(f"{where}: arch name {name!r} must look like 'sm_90a'")
        cc = tuple(_require(raw, "compute_capability", where))
        if len(cc) != 2 or not all(isinstance(v, int) for v in cc):
            raise RegistryError(f"{where}: compute_capability {list(cc)} must be [major, minor]")
        archs.append(Arch(name, cc, int(_require(raw, "sm_count", where)), raw.get("gpus", "")))
    names = [a.name for a in archs]
    if len(set(names)) != len(names):
        raise RegistryError(f"{source}: an arch is listed twice: {names}")
    axes = {
        "widths": tuple(_require(doc, "widths", source)),
        "weight_dtypes": tuple(_require(doc, "weight_dtypes", source)),
        "backends": tuple(_require(doc, "backends", source)),
        "directions": tuple(_require(doc, "directions", source)),
        "smem_optin_bytes": int(_require(doc, "smem_optin_bytes", source)),
    }
    for width in axes["widths"]:
        if not isinstance(width, int) or width <= 0 or width % 8:
            raise RegistryError(f"{source}: width {width!r} must be a positive multiple of 8")
    return tuple(archs), axes


def parse_programs(doc: dict, source: str) -> Dict[str, Program]:
    kernels: Dict[str, Kernel] = {}
    for name, raw in _require(doc, "kernel", source).items():
        where = f"{source} kernel {name!r}"
        _check_unknown(raw, ("header", "template", "direction", "form", "params", "reductions",
                             "runtime_h"), where)
        form = _require(raw, "form", where)
        if form not in FORMS:
            raise RegistryError(f"{where}: form {form!r} is not one of {list(FORMS)}")
        direction = _require(raw, "direction", where)
        if direction not in ("fwd", "bwd") or (direction == "fwd") != (form == "forward"):
            raise RegistryError(f"{where}: direction {direction!r} does not fit form {form!r}")
        reductions = tuple(_require(raw, "reductions", where))
        bad = [r for r in reductions if r not in REDUCTIONS]
        if bad or not reductions:
            raise RegistryError(f"{where}: reductions {list(reductions)} must be a non-empty list "
                                f"from {list(REDUCTIONS)}")
        kernels[name] = Kernel(name, _require(raw, "header", where), _require(raw, "template", where),
                               direction, form, tuple(_require(raw, "params", where)), reductions,
                               runtime_h=bool(raw.get("runtime_h", False)))
    programs: Dict[str, Program] = {}
    for name, raw in _require(doc, "program", source).items():
        where = f"{source} program {name!r}"
        _check_unknown(raw, ("kernel", "reduction", "deterministic", "params", "smem", "about",
                             "oversized", "fallback", "max_tokens", "max_hidden"), where)
        kname = _require(raw, "kernel", where)
        if kname not in kernels:
            raise RegistryError(f"{where}: unknown kernel {kname!r}; known: {sorted(kernels)}")
        kernel = kernels[kname]
        reduction = _require(raw, "reduction", where)
        if reduction not in kernel.reductions:
            raise RegistryError(f"{where}: reduction {reduction!r} is not one kernel {kname!r} "
                                f"implements: {list(kernel.reductions)}")
        params = dict(_require(raw, "params", where))
        if set(params) != set(kernel.params):
            raise RegistryError(f"{where}: params {sorted(params)} must be exactly kernel "
                                f"{kname!r}'s {list(kernel.params)}")
        for pname, value in params.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RegistryError(f"{where}: param {pname} = {value!r} must be a non-negative "
                                    f"integer")
        smem = _require(raw, "smem", where)
        _check_unknown(smem, ("fixed", "per_h"), where + " smem")
        programs[name] = Program(
            name=name, kernel=kernel, reduction=reduction,
            deterministic=bool(_require(raw, "deterministic", where)),
            params=tuple((p, params[p]) for p in kernel.params),
            smem_fixed=int(smem.get("fixed", 0)), smem_per_h=int(smem.get("per_h", 0)),
            about=raw.get("about", ""), oversized=bool(raw.get("oversized", False)),
            fallback=raw.get("fallback"), max_tokens=raw.get("max_tokens"),
            max_hidden=raw.get("max_hidden"))
        if programs[name].max_tokens is not None and (
                not isinstance(programs[name].max_tokens, int) or programs[name].max_tokens < 1):
            raise RegistryError(f"{where}: max_tokens {programs[name].max_tokens!r} must be a "
                                f"positive integer")
        check_runtime_h(programs[name], where)
    for program in programs.values():
        check_fallback(program, programs, f"{source} program {program.name!r}")
    return programs


def check_runtime_h(program: Program, where: str) -> None:
    """A generic (runtime-H) program declares the largest H it takes, a positive multiple of 8, and
    nothing that depends on H or T at build time; no other program declares max_hidden."""
    if not program.runtime_h:
        if program.max_hidden is not None:
            raise RegistryError(f"{where}: max_hidden is for programs whose kernel takes H at run "
                                f"time (runtime_h = true); kernel {program.kernel.name!r} does not")
        return
    value = program.max_hidden
    if not isinstance(value, int) or isinstance(value, bool) or value < 8 or value % 8:
        raise RegistryError(f"{where}: a runtime-H program must declare max_hidden, a positive "
                            f"multiple of 8; got {value!r}")
    if program.smem_per_h:
        raise RegistryError(f"{where}: a runtime-H program's shared memory cannot depend on H "
                            f"(smem per_h must be 0)")
    if program.oversized or program.fallback is not None or program.max_tokens is not None:
        raise RegistryError(f"{where}: a runtime-H program runs every T of every H it serves: no "
                            f"oversized, fallback or max_tokens")


def generic_programs(programs: Mapping[str, Program], directions: Iterable[str],
                     source: str) -> Dict[str, Program]:
    """The runtime-H program of each direction: exactly one each, deterministic (det and fast both
    run it at every width that is not prebuilt)."""
    found: Dict[str, List[str]] = {d: [] for d in directions}
    for program in programs.values():
        if program.runtime_h:
            found.setdefault(program.direction, []).append(program.name)
    out = {}
    for direction, names in found.items():
        if len(names) != 1:
            raise RegistryError(f"{source}: expected exactly one runtime-H (generic) {direction} "
                                f"program, found {sorted(names) or 'none'}")
        program = programs[names[0]]
        if not program.deterministic:
            raise RegistryError(f"{source}: generic program {program.name!r} must be deterministic "
                                f"(det runs it)")
        out[direction] = program
    return out


# Kernel parameters a fallback may differ in: how much is staged or kept in flight, and which block
# takes which chunk (pull), never what is summed in which order.
STAGING_PARAMS = ("stage_bytes", "ring_rows", "pull")


def check_fallback(program: Program, programs: Mapping[str, Program], where: str) -> None:
    """A declared fallback exists and computes the same thing in the same order (see programs.toml)."""
    if program.fallback is None:
        return
    name = program.fallback
    if not isinstance(name, str) or name not in programs:
        raise RegistryError(f"{where}: fallback {name!r} is not a program; known: {sorted(programs)}")
    fb = programs[name]
    if fb.name == program.name:
        raise RegistryError(f"{where}: a program cannot be its own fallback")
    if fb.fallback is not None or fb.oversized:
        raise RegistryError(f"{where}: fallback {name!r} must be an ordinary program (no fallback "
                            f"of its own, not oversized)")
    for label, mine, theirs in (("direction", program.direction, fb.direction),
                                ("form", program.form, fb.form),
                                ("reduction", program.reduction, fb.reduction)):
        if mine != theirs:
            raise RegistryError(f"{where}: fallback {name!r} has {label} {theirs!r}, not {mine!r}")
    if program.deterministic and not fb.deterministic:
        raise RegistryError(f"{where}: fallback {name!r} of a deterministic program must be "
                            f"deterministic")
    mine = {k: v for k, v in program.params if k not in STAGING_PARAMS}
    theirs = {k: v for k, v in fb.params if k not in STAGING_PARAMS}
    if mine != theirs:
        raise RegistryError(f"{where}: fallback {name!r} has kernel params {theirs}, not {mine} "
                            f"(only {list(STAGING_PARAMS)} may differ)")


def check_gated(tables: Mapping[TableKey, Tuple[Window, ...]], programs: Mapping[str, Program],
                optin: int, source: str) -> None:
    """Every program routed where its shared memory passes the opt-in limit names a fallback that
    stays under the limit there."""
    for key, windows in sorted(tables.items()):
        for window in windows:
            program = window.program
            need = program.smem_bytes(key.hidden)
            if need <= optin:
                continue
            where = (f"{source}: program {program.name!r} ({need} B of shared memory at H "
                     f"{key.hidden}, table {key.describe()}) passes the {optin} B opt-in limit")
            if program.fallback is None:
                raise RegistryError(f"{where} and declares no fallback: a gated program must "
                                    f"name one that stays under the limit")
            fb_need = programs[program.fallback].smem_bytes(key.hidden)
            if fb_need > optin:
                raise RegistryError(f"{where}; its fallback {program.fallback!r} takes {fb_need} B, "
                                    f"also above the limit")


def _expand(raw: dict, field: str, universe: tuple, where: str) -> tuple:
    value = _require(raw, field, where)
    if value == "all":
        return universe
    values = tuple(value) if isinstance(value, list) else (value,)
    for v in values:
        if v not in universe:
            raise RegistryError(f"{where}: {field} {v!r} is not one of {list(universe)}")
    return values


def _window(raw: dict, key: TableKey, programs: Mapping[str, Program], table: str,
            label: str = "") -> Window:
    """One window of `key`'s table: a known program of the table's direction (det: deterministic)."""
    _check_unknown(raw, ("first", "last", "program"), table)
    pname = _require(raw, "program", table)
    first, last = _require(raw, "first", table), raw.get("last")
    span = f"T {first}..{'inf' if last is None else last}"
    if not isinstance(first, int) or first < 1 or (last is not None and not isinstance(last, int)):
        raise RegistryError(f"{table}, window {span}: first and last must be integers, first >= 1")
    if pname not in programs:
        raise RegistryError(f"{table}, window {span}: unknown program {pname!r}")
    program = programs[pname]
    if program.direction != key.direction:
        raise RegistryError(f"{table}, window {span}: program {pname!r} is a "
                            f"{program.direction} program")
    if key.backend == "det" and not program.deterministic:
        raise RegistryError(f"{table}, window {span}: det may not run non-deterministic "
                            f"program {pname!r}")
    if last is not None and last < first:
        raise RegistryError(f"{table}, window {span}: last is below first")
    if program.max_tokens is not None and (last is None or last > program.max_tokens):
        raise RegistryError(f"{table}, window {span}: program {pname!r} may run only up to "
                            f"T {program.max_tokens} (its max_tokens)")
    return Window(first, last, program, label)


def check_tiling(windows: List[Window], table: str) -> Tuple[Window, ...]:
    """The windows, sorted, if they tile 1..infinity exactly once."""
    windows = sorted(windows, key=lambda w: w.first)
    expected = 1
    for i, window in enumerate(windows):
        if window.first != expected:
            kind = "gap" if window.first > expected else "overlap"
            raise RegistryError(f"{table}: {kind} at window {window.describe()}: "
                                f"expected it to start at T {expected}")
        if window.last is None:
            if i != len(windows) - 1:
                raise RegistryError(f"{table}: overlap: window {window.describe()} is unbounded "
                                    f"but more windows follow")
            return tuple(windows)
        expected = window.last + 1
    raise RegistryError(f"{table}: gap after T {expected - 1}: no window reaches infinity")


def parse_windows(raw_windows: List[dict], key: TableKey, programs: Mapping[str, Program],
                  where: str) -> Tuple[Window, ...]:
    """Check that the windows tile 1..infinity exactly once and name known, fitting programs."""
    table = f"{where} (table {key.describe()})"
    return check_tiling([_window(raw, key, programs, table) for raw in raw_windows], table)


def splice(windows: Tuple[Window, ...], new: Window) -> Tuple[Window, ...]:
    """`windows` with [new.first, new.last] cut out of them and `new` put there."""
    out = [new]
    for w in windows:
        if w.first < new.first:  # the part before `new`
            out.append(dataclasses.replace(
                w, last=new.first - 1 if w.last is None else min(w.last, new.first - 1)))
        if new.last is not None and (w.last is None or w.last > new.last):  # the part after it
            out.append(dataclasses.replace(w, first=max(w.first, new.last + 1)))
    return tuple(sorted(out, key=lambda w: w.first))


def parse_routes(doc: dict, source: str, archs: Tuple[Arch, ...], axes: dict,
                 programs: Mapping[str, Program]) -> Dict[TableKey, Tuple[Window, ...]]:
    tables: Dict[TableKey, Tuple[Window, ...]] = {}
    origin: Dict[TableKey, str] = {}
    for i, raw in enumerate(_require(doc, "table", source)):
        where = f"{source} table entry #{i + 1}"
        _check_unknown(raw, ("arch", "backend", "direction", "weight_dtype", "residual", "H",
                             "windows"), where)
        for key in _keys(raw, archs, axes, where):
            if key in tables:
                raise RegistryError(f"{where}: overlap: table {key.describe()} is already "
                                    f"given by {origin[key]}")
            tables[key] = parse_windows(_require(raw, "windows", where), key, programs, where)
            origin[key] = where
    for combo in itertools.product((a.name for a in archs), axes["backends"], axes["directions"],
                                   axes["weight_dtypes"], (False, True), axes["widths"]):
        if TableKey(*combo) not in tables:
            raise RegistryError(f"{source}: gap: no table for {TableKey(*combo).describe()}")
    return tables


def _keys(raw: dict, archs: Tuple[Arch, ...], axes: dict, where: str):
    return itertools.starmap(TableKey, itertools.product(
        _expand(raw, "arch", tuple(a.name for a in archs), where),
        _expand(raw, "backend", axes["backends"], where),
        _expand(raw, "direction", axes["directions"], where),
        _expand(raw, "weight_dtype", axes["weight_dtypes"], where),
        _expand(raw, "residual", (False, True), where),
        _expand(raw, "H", axes["widths"], where)))


def apply_overrides(docs: List[Tuple[dict, str]], archs: Tuple[Arch, ...], axes: dict,
                    programs: Mapping[str, Program], tables: Dict[TableKey, Tuple[Window, ...]]) -> None:
    """Splice each [[override]] window of each (document, file name) into the tables it names. Two
    overrides may not overlap on one table, in one file or across files (so order never matters).
    `measured` (the tuner's figures) is kept in the file for review only."""
    placed: Dict[TableKey, List[Tuple[Window, str]]] = {}
    raws = [(raw, source, i) for doc, source in docs for i, raw in enumerate(doc.get("override", []))]
    for raw, source, i in raws:
        label = raw.get("window", "")
        where = f"{source} override #{i + 1}" + (f" ({label})" if label else "")
        _check_unknown(raw, ("window", "arch", "backend", "direction", "weight_dtype", "residual",
                             "H", "first", "last", "program", "measured"), where)
        window_raw = {k: raw[k] for k in ("first", "last", "program") if k in raw}
        for key in _keys(raw, archs, axes, where):
            table = f"{where} (table {key.describe()})"
            new = _window(window_raw, key, programs, table, label)
            for other, other_where in placed.get(key, []):
                if other.overlaps(new):
                    raise RegistryError(f"{table}: overlap: window {new.describe()} meets "
                                        f"{other.describe()} of {other_where}")
            placed.setdefault(key, []).append((new, where))
            tables[key] = check_tiling(list(splice(tables[key], new)), table)
