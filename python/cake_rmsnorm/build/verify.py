"""Verify built libraries: in a wheel folder, a build tree, or the installed provider packages.

Every library of the plan present, its sha256 matching, SASS for exactly its arch and no PTX
(cuobjdump --list-elf / --list-ptx), the manifest valid and its version the package version.
Each function returns the list of problems, each naming the file at fault; empty means OK.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import os
import re
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple, Union

from .._version import __version__
from ..manifest import (MANIFEST_NAME, SCHEMA_VERSION, LibraryEntry, Manifest, ManifestError,
                        provider_package, sha256_file)
from ..registry import Arch, load_registry
from ..runtime.native import PACKAGE as NATIVE_PACKAGE
from .layout import ArchTree
from .native import LIBRARY_NAME as NATIVE_LIBRARY
from .toolchain import require_cuobjdump
from .wheel import record_hash

ELF_LINE = re.compile(r"ELF file\s+\d+:\s*(\S+)")
PTX_LINE = re.compile(r"PTX file\s+\d+:\s*(\S+)")


def check_sass(path: Path, arch: str, cuobjdump: Path, label: Optional[str] = None) -> List[str]:
    """Problems with `path`'s device code: it must hold SASS for `arch` only, and no PTX."""
    label = label or str(path)
    problems = []
    elf = subprocess.run([str(cuobjdump), "--list-elf", str(path)], capture_output=True, text=True)
    if elf.returncode != 0:
        return [f"{label}: cuobjdump cannot read it: {(elf.stderr or elf.stdout).strip()}"]
    cubins = ELF_LINE.findall(elf.stdout)
    if not cubins:
        problems.append(f"{label}: holds no SASS (no ELF image)")
    wrong = [c for c in cubins if not c.endswith(f".{arch}.cubin")]
    if wrong:
        problems.append(f"{label}: SASS for another arch than {arch}: {', '.join(wrong)}")
    ptx = subprocess.run([str(cuobjdump), "--list-ptx", str(path)], capture_output=True, text=True)
    found = PTX_LINE.findall(ptx.stdout)
    if found:
        problems.append(f"{label}: holds PTX ({', '.join(found)}); SASS only is allowed")
    return problems


def _check_sass_all(jobs: Sequence[Tuple[Path, str, str]], cuobjdump: Path) -> List[str]:
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = pool.map(lambda j: check_sass(j[0], j[1], cuobjdump, j[2]), jobs)
        return [p for r in results for p in r]


def _check_manifest(manifest: Manifest, arch: Arch, source: str,
                    widths: Optional[Iterable[int]], version: Optional[str]) -> List[str]:
    """The manifest against the registry's plan and the package version."""
    problems = []
    if manifest.arch != arch.name:
        problems.append(f"{source}: arch {manifest.arch!r}, expected {arch.name!r}")
    if manifest.version != __version__:
        problems.append(f"{source}: version {manifest.version}, this cake-rmsnorm is {__version__}")
    if version is not None and manifest.version != version:
        problems.append(f"{source}: version {manifest.version}, the package says {version}")
    plan = {lib.name: lib for lib in load_registry().libraries(arch.name, widths)}
    listed = {entry.name: entry for entry in manifest.libraries}
    for name in sorted(set(plan) - set(listed)):
        problems.append(f"{source}: library {name} of the plan is missing")
    for name in sorted(set(listed) - set(plan)):
        problems.append(f"{source}: library {name} is not in the plan")
    for name in sorted(set(plan) & set(listed)):
        entry, want = listed[name], plan[name].plan_fields()
        got = {key: getattr(entry, key) for key in want}
        if got != want:
            diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
            problems.append(f"{source}: library {name} differs from the plan (got, want): {diff}")
        if entry.file != f"lib/{plan[name].filename}":
            problems.append(f"{source}: library {name} file {entry.file!r}, expected "
                            f"'lib/{plan[name].filename}'")
    return problems


def _arch_for_tag(tag: str) -> Optional[Arch]:
    return next((a for a in load_registry().archs if a.tag == tag), None)


def _verify_wheel(path: Path, widths: Optional[Iterable[int]], cuobjdump: Path) -> List[str]:
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        return [f"{path}: not a readable wheel: {exc}"]
    with zf:
        names = set(zf.namelist())
        dist, _, rest = path.name.partition("-")
        version = rest.split("-", 1)[0]
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            return [f"{path}: expected one dist-info/RECORD, found {len(records)}"]
        problems = []
        listed = set()
        for line in zf.read(records[0]).decode().splitlines():
            entry, digest, _size = (line.rsplit(",", 2) + ["", ""])[:3]
            listed.add(entry)
            if entry == records[0]:
                continue
            if entry not in names:
                problems.append(f"{path}: RECORD lists {entry}, which the wheel lacks")
            elif record_hash(zf.read(entry)) != digest:
                problems.append(f"{path}: {entry} does not match its RECORD hash")
        problems += [f"{path}: {n} is not in RECORD" for n in sorted(names - listed)]
        if dist == "cake_rmsnorm":
            if version != __version__:
                problems.append(f"{path}: version {version}, this cake-rmsnorm is {__version__}")
            for need in ("cake_rmsnorm/__init__.py", "cake_rmsnorm/registry/data/routes.toml"):
                if need not in names:
                    problems.append(f"{path}: lacks {need}")
            return problems
        if dist == NATIVE_PACKAGE:  # build/native.py: <ours>+torch<T>, the library inside
            if version.split("+", 1)[0] != __version__:
                problems.append(f"{path}: version {version}, this cake-rmsnorm is {__version__}")
            for need in (f"{NATIVE_PACKAGE}/__init__.py", f"{NATIVE_PACKAGE}/{NATIVE_LIBRARY}"):
                if need not in names:
                    problems.append(f"{path}: lacks {need}")
            return problems
        arch = _arch_for_tag(dist[len("cake_rmsnorm_"):]) if dist.startswith("cake_rmsnorm_") else None
        if arch is None:
            return problems + [f"{path}: not a cake-rmsnorm wheel (distribution {dist!r})"]
        pkg = provider_package(arch.tag)
        try:
            manifest = Manifest.from_json(zf.read(f"{pkg}/{MANIFEST_NAME}").decode(),
                                          f"{path.name}:{pkg}/{MANIFEST_NAME}")
        except KeyError:
            return problems + [f"{path}: lacks {pkg}/{MANIFEST_NAME}"]
        except ManifestError as exc:
            return problems + [f"{path}: {exc}"]
        problems += _check_manifest(manifest, arch, path.name, widths, version)
        with tempfile.TemporaryDirectory(prefix="cake-verify-") as tmp:
            jobs = []
            for entry in manifest.libraries:
                member, label = f"{pkg}/{entry.file}", f"{path.name}:{pkg}/{entry.file}"
                if member not in names:
                    problems.append(f"{label}: missing from the wheel")
                    continue
                data = zf.read(member)
                if hashlib.sha256(data).hexdigest() != entry.sha256:
                    problems.append(f"{label}: sha256 does not match the manifest")
                target = Path(tmp) / Path(entry.file).name
                target.write_bytes(data)
                jobs.append((target, arch.name, label))
            problems += _check_sass_all(jobs, cuobjdump)
        return problems


def _verify_files(manifest: Manifest, arch: Arch, root: Path, source: str,
                  widths: Optional[Iterable[int]], cuobjdump: Path,
                  version: Optional[str] = None) -> List[str]:
    """A manifest whose library files lie under `root` (an installed provider or a build tree)."""
    problems = _check_manifest(manifest, arch, source, widths, version)
    jobs = []
    for entry in manifest.libraries:
        path = root / entry.file
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        if sha256_file(path) != entry.sha256:
            problems.append(f"{path}: sha256 does not match {source}")
        jobs.append((path, arch.name, str(path)))
    return problems + _check_sass_all(jobs, cuobjdump)


def _build_tree_manifest(tree: ArchTree, arch: Arch) -> Tuple[Optional[Manifest], List[int]]:
    """build.json seen as a manifest (same checks), and the widths it was built for."""
    record = tree.read_record()
    if record is None:
        return None, []
    entries = []
    for raw in record.get("libraries", []):
        fields = {k: raw[k] for k in LibraryEntry.__dataclass_fields__ if k in raw and k != "file"}
        entries.append(LibraryEntry(**fields, file=f"lib/{raw['file']}"))
    return Manifest(SCHEMA_VERSION, str(record.get("version")), arch.name, str(record.get("toolkit")),
                    tuple(entries)), list(record.get("widths", []))


def verify_path(path: Union[str, Path], widths: Optional[Iterable[int]] = None) -> List[str]:
    """A wheel, a folder of wheels, or a build tree (build/ or build/<arch>/)."""
    path = Path(path)
    cuobjdump = require_cuobjdump()
    if path.is_file() and path.suffix == ".whl":
        return _verify_wheel(path, widths, cuobjdump)
    if not path.is_dir():
        return [f"{path}: no such wheel or folder"]
    wheels = sorted(path.glob("*.whl"))
    if wheels:
        return [p for w in wheels for p in _verify_wheel(w, widths, cuobjdump)]
    reg = load_registry()
    arch_dirs = [path] if path.name in reg.arch_names else [path / a for a in reg.arch_names]
    problems, seen = [], 0
    for folder in arch_dirs:
        if not (folder / "build.json").is_file():
            continue
        seen += 1
        arch, tree = reg.arch(folder.name), ArchTree(folder.resolve())
        manifest, built_widths = _build_tree_manifest(tree, arch)
        if manifest is None:
            problems.append(f"{tree.record}: unreadable build record")
            continue
        problems += _verify_files(manifest, arch, tree.root, str(tree.record),
                                  widths if widths is not None else built_widths, cuobjdump)
    if not seen:
        problems.append(f"{path}: no wheels and no build tree (no */build.json) to verify")
    return problems


def verify_installed(widths: Optional[Iterable[int]] = None) -> List[str]:
    """Every provider package importable here (found on sys.path without importing it)."""
    cuobjdump = require_cuobjdump()
    problems, found = [], 0
    for arch in load_registry().archs:
        spec = importlib.util.find_spec(provider_package(arch.tag))
        if spec is None or not spec.origin:
            continue
        found += 1
        root = Path(spec.origin).parent
        try:
            manifest = Manifest.read(root / MANIFEST_NAME)
        except ManifestError as exc:
            problems.append(str(exc))
            continue
        problems += _verify_files(manifest, arch, root, str(root / MANIFEST_NAME), widths, cuobjdump)
    if not found:
        problems.append("no cake-rmsnorm provider package is installed; e.g. "
                        "pip install 'cake-rmsnorm[sm90a]'")
    return problems
