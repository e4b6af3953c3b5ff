"""Write the wheels: the pure-Python `cake-rmsnorm` shim and one `cake-rmsnorm-<tag>` per arch.

Byte-for-byte reproducible: entries sorted (dist-info last, RECORD at the very end), one fixed
timestamp (SOURCE_DATE_EPOCH, else 1980-01-01), fixed modes (0644, 0755 for libraries), fixed
compression. Each wheel is written to a temp file in the output folder and renamed, so a full disk
or a kill never leaves a partial wheel under its final name. Provider wheels are made only from a
build whose every library of the plan is present and matches build.json.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import platform
import re
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ..errors import PackagingError
from ..manifest import (LIB_DIR, MANIFEST_NAME, SCHEMA_VERSION, LibraryEntry, Manifest,
                        provider_distribution, provider_package, sha256_file)
from ..registry import Arch, Registry, load_registry
from .atomic import atomic_write
from .elf import MACHINES, MANYLINUX
from .layout import ArchTree, build_lock, default_source_root
from .orchestrate import pending_outputs
from .toolchain import find_ninja

EPOCH_MIN = 315532800  # 1980-01-01: the earliest time a zip can hold
PROVIDER_REQUIRES = ("nvidia-cuda-runtime>=13.0,<14",)
PLATFORM = f"manylinux_2_28_{platform.machine()}"
PLATFORM_ENV = "CAKE_RMSNORM_WHEEL_PLATFORM"  # a cross build's tag, e.g. manylinux_2_28_aarch64
Files = Dict[str, Tuple[bytes, int]]  # archive path -> (content, mode)


def wheel_platform() -> str:
    """The provider wheels' platform tag: this machine's, or $CAKE_RMSNORM_WHEEL_PLATFORM."""
    tag = os.environ.get(PLATFORM_ENV) or PLATFORM
    if not MANYLINUX.fullmatch(tag):
        raise PackagingError(f"${PLATFORM_ENV} = {tag!r}: expected manylinux_<glibc major>_<minor>"
                             f"_<{' | '.join(MACHINES)}>, e.g. manylinux_2_28_{MACHINES[-1]}")
    return tag


def _timestamp() -> Tuple[int, int, int, int, int, int]:
    epoch = max(int(os.environ.get("SOURCE_DATE_EPOCH", EPOCH_MIN)), EPOCH_MIN)
    return time.gmtime(epoch)[:6]


def _normalize(dist: str) -> str:
    """Distribution name as wheel file and dist-info names spell it (PEP 427 / 503)."""
    return re.sub(r"[-_.]+", "_", dist).lower()


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def _write_wheel(out_dir: Path, filename: str, dist_info: str, files: Files) -> Path:
    """Zip `files` (+ RECORD) reproducibly into out_dir/filename, atomically."""
    record = f"{dist_info}/RECORD"
    order = sorted(files, key=lambda p: (p.startswith(dist_info + "/"), p))
    lines = [f"{p},{record_hash(files[p][0])},{len(files[p][0])}" for p in order]
    entries = [(p, *files[p]) for p in order]
    entries.append((record, ("\n".join(lines + [f"{record},,"]) + "\n").encode(), 0o644))
    stamp = _timestamp()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path, data, mode in entries:
            info = zipfile.ZipInfo(path, date_time=stamp)
            info.create_system = 3  # Unix, so the modes below are honoured
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data, compresslevel=9)
    atomic_write(out_dir / filename, buffer.getvalue())
    return out_dir / filename


def _wheel_file(root_is_purelib: bool, wheel_tag: str) -> bytes:
    return (f"Wheel-Version: 1.0\nGenerator: cake-rmsnorm\n"
            f"Root-Is-Purelib: {'true' if root_is_purelib else 'false'}\nTag: {wheel_tag}\n").encode()


def _project(source_root: Path) -> Tuple[dict, str]:
    """pyproject's [project] table and the version stated in python/cake_rmsnorm/_version.py."""
    try:
        project = tomllib.loads((source_root / "pyproject.toml").read_text())["project"]
        version_text = (source_root / "python/cake_rmsnorm/_version.py").read_text()
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise PackagingError(f"{source_root}: cannot read pyproject.toml or _version.py: {exc}") from exc
    match = re.search(r"^__version__\s*=\s*[\"']([^\"']+)[\"']", version_text, re.M)
    if not match:
        raise PackagingError(f"{source_root}/python/cake_rmsnorm/_version.py states no __version__")
    return project, match.group(1)


def _shim_metadata(project: dict, version: str, reg: Registry, readme: Optional[str]) -> bytes:
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {version}"]
    if project.get("description"):
        lines.append(f"Summary: {project['description']}")
    license_text = (project.get("license") or {}).get("text")
    if license_text:
        lines.append(f"License: {license_text}")
    if project.get("requires-python"):
        lines.append(f"Requires-Python: {project['requires-python']}")
    lines += [f"Requires-Dist: {dep}" for dep in project.get("dependencies", [])]
    extras = dict(project.get("optional-dependencies", {}))
    for arch in reg.archs:  # pip install cake-rmsnorm[sm90a] pulls the provider at this version
        extras[arch.tag] = [f"{provider_distribution(arch.tag)}=={version}"]
    for extra in sorted(extras):
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {dep}; extra == "{extra}"' for dep in extras[extra]]
    if readme is not None:
        lines.append("Description-Content-Type: text/markdown")
        return ("\n".join(lines) + "\n\n" + readme).encode()
    return ("\n".join(lines) + "\n").encode()


def _shim_files(source_root: Path, project: dict, version: str, reg: Registry) -> Files:
    package = source_root / "python" / "cake_rmsnorm"
    files: Files = {}
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if (not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo")
                or any(part.startswith(".") for part in rel.parts)):
            continue
        files[f"cake_rmsnorm/{rel.as_posix()}"] = (path.read_bytes(), 0o644)
    readme_path = source_root / "README.md"
    readme = readme_path.read_text() if readme_path.is_file() else None
    dist_info = f"cake_rmsnorm-{version}.dist-info"
    files[f"{dist_info}/METADATA"] = (_shim_metadata(project, version, reg, readme), 0o644)
    files[f"{dist_info}/WHEEL"] = (_wheel_file(True, "py3-none-any"), 0o644)
    scripts = project.get("scripts", {})
    if scripts:
        body = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(scripts.items()))
        files[f"{dist_info}/entry_points.txt"] = (body.encode(), 0o644)
    files[f"{dist_info}/top_level.txt"] = (b"cake_rmsnorm\n", 0o644)
    return files


def _provider_manifest(arch: Arch, reg: Registry, tree: ArchTree, version: str,
                       widths: Optional[Iterable[int]]) -> Manifest:
    record = tree.read_record()
    if record is None or record.get("arch") != arch.name:
        raise PackagingError(f"{arch.name} is not built ({tree.record} missing): "
                             f"run `cake-rmsnorm build --arch {arch.name}` first")
    ninja = find_ninja()
    pending = pending_outputs(tree, ninja) if ninja else []
    if pending:  # an interrupted build, or sources changed since: the libraries are stale
        raise PackagingError(f"{arch.name}: the build is not up to date ({len(pending)} step(s) "
                             f"pending: {', '.join(pending[:6])}); run `cake-rmsnorm build "
                             f"--arch {arch.name}` first")
    built = {entry["name"]: entry for entry in record.get("libraries", [])}
    entries, missing = [], []
    for lib in reg.libraries(arch.name, widths):
        entry, path = built.get(lib.name), tree.library(lib.filename)
        if entry is None or not path.is_file():
            missing.append(lib.name)
            continue
        if sha256_file(path) != entry["sha256"]:
            missing.append(f"{lib.name} (changed since the build recorded it)")
            continue
        fields = lib.plan_fields()
        entries.append(LibraryEntry(**fields, registers=int(entry["registers"]),
                                    file=f"{LIB_DIR}/{lib.filename}", sha256=entry["sha256"]))
    if missing:
        shown = ", ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
        raise PackagingError(f"{arch.name}: {len(missing)} librar(ies) of the plan are not built: "
                             f"{shown}; run `cake-rmsnorm build --arch {arch.name}`")
    return Manifest(SCHEMA_VERSION, version, arch.name, str(record["toolkit"]), tuple(entries))


def _provider_files(arch: Arch, manifest: Manifest, tree: ArchTree, project: dict,
                    tag: str) -> Files:
    pkg, dist = provider_package(arch.tag), provider_distribution(arch.tag)
    version = manifest.version
    init = (f'"""Prebuilt cake-rmsnorm libraries for {arch.name} ({arch.gpus}); loaded by '
            f'cake_rmsnorm on first use."""\n\nARCH = "{arch.name}"\n__version__ = "{version}"\n')
    files: Files = {f"{pkg}/__init__.py": (init.encode(), 0o644),
                    f"{pkg}/{MANIFEST_NAME}": (manifest.to_json().encode(), 0o644)}
    for entry in manifest.libraries:
        files[f"{pkg}/{entry.file}"] = (tree.library(Path(entry.file).name).read_bytes(), 0o755)
    dist_info = f"{_normalize(dist)}-{version}.dist-info"
    meta = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}",
            f"Summary: cake-rmsnorm libraries for {arch.name} ({arch.gpus}), toolkit {manifest.toolkit}"]
    if project.get("requires-python"):
        meta.append(f"Requires-Python: {project['requires-python']}")
    meta += [f"Requires-Dist: {dep}" for dep in PROVIDER_REQUIRES]
    files[f"{dist_info}/METADATA"] = (("\n".join(meta) + "\n").encode(), 0o644)
    files[f"{dist_info}/WHEEL"] = (_wheel_file(False, f"py3-none-{tag}"), 0o644)
    files[f"{dist_info}/top_level.txt"] = (f"{pkg}\n".encode(), 0o644)
    return files


def write_wheels(archs: Iterable[Union[Arch, str]], out_dir: Union[str, Path],
                 build_dir: Union[str, Path] = "build", source_root: Union[str, Path, None] = None,
                 widths: Optional[Sequence[int]] = None) -> List[Path]:
    """The shim wheel and one provider wheel per arch; `widths` (tests only) narrows the plan."""
    reg = load_registry()
    arch_list = tuple(reg.arch(a) if isinstance(a, str) else a for a in archs)
    root = Path(source_root).resolve() if source_root else default_source_root()
    project, version = _project(root)
    out = Path(out_dir)
    tag = wheel_platform()
    providers = []
    with build_lock(Path(build_dir)):  # a concurrent build must not swap libraries under us
        for arch in arch_list:  # every arch checked and read before any wheel is written
            tree = ArchTree.of(Path(build_dir), arch.name)
            manifest = _provider_manifest(arch, reg, tree, version, widths)
            dist = _normalize(provider_distribution(arch.tag))
            providers.append((f"{dist}-{version}-py3-none-{tag}.whl",
                              f"{dist}-{version}.dist-info",
                              _provider_files(arch, manifest, tree, project, tag)))
    wheels = [_write_wheel(out, f"cake_rmsnorm-{version}-py3-none-any.whl",
                           f"cake_rmsnorm-{version}.dist-info",
                           _shim_files(root, project, version, reg))]
    wheels += [_write_wheel(out, name, dist_info, files) for name, dist_info, files in providers]
    return wheels
