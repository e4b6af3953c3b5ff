"""The upstream route windows of tests/data/windows.toml, and the check that a registry holds one.

Shared by tests/test_fixed_windows.py (every window, against our registry and mutated copies) and the
GPU gate tests (the [gates] token counts). Checks go through Registry.route, the query the runtime
router and `cake-rmsnorm explain` use.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

WINDOWS_FILE = Path(__file__).resolve().parent / "data" / "windows.toml"
LARGE_T = 524288  # a far point for windows with no end


@dataclass(frozen=True)
class WindowSpec:
    id: str
    archs: Tuple[str, ...]
    backends: Tuple[str, ...]
    direction: str
    widths: Tuple[int, ...]
    weight_dtypes: Tuple[str, ...]
    residuals: Tuple[bool, ...]
    first: int
    last: Optional[int]
    form: Optional[str] = None
    reduction: Optional[str] = None
    differs_from: Tuple[int, ...] = ()
    same_as_det: bool = False
    same_as_arch: Optional[str] = None
    deterministic: bool = False
    smem_bytes: Optional[int] = None
    uniform: bool = True

    def samples(self) -> Tuple[int, ...]:
        """Token counts checked inside the window: its ends, their neighbours, a middle, a far point."""
        if self.last is None:
            pts = {self.first, self.first + 1, 2 * self.first, max(LARGE_T, 4 * self.first)}
        else:
            pts = {self.first, self.last, (self.first + self.last) // 2,
                   min(self.first + 1, self.last), max(self.last - 1, self.first)}
        return tuple(sorted(pts))

    def keys(self):
        for arch in self.archs:
            for backend in self.backends:
                for hidden in self.widths:
                    for wd in self.weight_dtypes:
                        for res in self.residuals:
                            yield arch, backend, hidden, wd, res


def _tuple(value, universe=None):
    if value == "all":
        return tuple(universe)
    return tuple(value) if isinstance(value, list) else (value,)


def load_windows(reg) -> Tuple[WindowSpec, ...]:
    doc = tomllib.loads(WINDOWS_FILE.read_text())
    specs = []
    for raw in doc["window"]:
        specs.append(WindowSpec(
            id=raw["id"], archs=_tuple(raw["arch"], reg.arch_names),
            backends=_tuple(raw["backend"], reg.backends), direction=raw.get("direction", "bwd"),
            widths=tuple(h for h in _tuple(raw["H"], reg.widths) if h not in raw.get("except_H", ())),
            weight_dtypes=_tuple(raw.get("weight_dtype", ["fp32"])),
            residuals=_tuple(raw.get("residual", [False])), first=raw["first"], last=raw.get("last"),
            form=raw.get("form"), reduction=raw.get("reduction"),
            differs_from=tuple(raw.get("differs_from", ())), same_as_det=raw.get("same_as_det", False),
            same_as_arch=raw.get("same_as_arch"), deterministic=raw.get("deterministic", False),
            smem_bytes=raw.get("smem_bytes"), uniform=raw.get("uniform", True)))
    return tuple(specs)


def load_gates() -> dict:
    return tomllib.loads(WINDOWS_FILE.read_text())["gates"]


def check_window(reg, spec: WindowSpec) -> int:
    """Assert that `reg` holds `spec` at every key and sample point; returns the points checked."""
    checked = 0
    for arch, backend, hidden, wd, res in spec.keys():
        def route(tokens, arch=arch, backend=backend):
            return reg.route(arch, backend, spec.direction, hidden, tokens, wd, res)
        where = f"{spec.id}: {arch} {backend} {spec.direction} H {hidden} {wd} res={res}"
        seen = set()
        for tokens in spec.samples():
            r = route(tokens)
            p = r.program
            at = f"{where} T {tokens} runs {p.name} ({p.form}, {p.reduction})"
            seen.add(p.name)
            if spec.form:
                assert p.form == spec.form, f"{at}: expected form {spec.form}"
            if spec.reduction:
                assert p.reduction == spec.reduction, f"{at}: expected reduction {spec.reduction}"
            if spec.deterministic:
                assert p.deterministic, f"{at}: expected a deterministic program"
            for other in spec.differs_from:
                q = route(other).program
                assert q.name != p.name, f"{at}: expected another program than at T {other}"
            if spec.same_as_det:
                q = route(tokens, backend="det").program
                assert q.name == p.name, f"{at}: expected det's program {q.name}"
            if spec.same_as_arch:
                q = route(tokens, arch=spec.same_as_arch).program
                assert q.name == p.name, f"{at}: expected {spec.same_as_arch}'s program {q.name}"
            if spec.smem_bytes is not None:
                lib = r.library
                assert lib.smem_bytes == spec.smem_bytes, f"{at}: takes {lib.smem_bytes} B"
                assert lib.oversized == (spec.smem_bytes > reg.smem_optin_bytes), f"{at}: gating"
                if lib.oversized:
                    assert reg.fallback(lib) is not None, f"{at}: gated without a fallback"
            checked += 1
        if spec.uniform:
            assert len(seen) == 1, f"{where}: one program expected over the window, saw {sorted(seen)}"
    return checked
