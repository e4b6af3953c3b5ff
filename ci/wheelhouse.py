#!/usr/bin/env python3
"""The wheelhouse: every wheel of the matrix in one folder that pip installs from, with SHA256SUMS
and an index (index.json, index.md) listing each wheel's kind, arch, host platform, version, size,
library count and torch release, read from the wheels themselves (file name, WHEEL, METADATA, the
provider manifest).

    python ci/wheelhouse.py assemble --out wheelhouse [--deps DIR] CELL_DIR_OR_WHEEL...
    python ci/wheelhouse.py check CELL_DIR_OR_WHEEL...         # each wheel's own checks only
    python ci/wheelhouse.py deps --out DIR [--select GLOB]     # pip download what providers need

Kinds: the shim, the providers (one per arch), the optional native eager step (cake-rmsnorm-native,
one per torch release: version <ours>+torch<T>, requiring torch==T) and the dependencies.
`assemble` checks before it writes: one version across our wheels (a native wheel's +torch<T>
aside), one provider per (arch, host platform) and one native wheel per (torch, host platform), a
file name seen twice must be the same bytes (every cell writes the same shim), every provider and
native library's ELF machine is its wheel's and needs no newer glibc than the manylinux tag (nor a
newer libstdc++ than manylinux_2_28's), and the sizes hold (provider <= 25 MB, native <= 1 MB,
shim <= 300 kB). The folder is written aside and swapped in whole; SHA256SUMS (sha256sum -c
format) covers every wheel, and nothing in it depends on the time or the order of the inputs, so
two runs from one commit give the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from cake_rmsnorm.build.elf import MACHINES, MANYLINUX, elf_machine, glibc_needed, libstdcxx_problem
from cake_rmsnorm.build.native import LIBRARY_NAME as NATIVE_LIBRARY
from cake_rmsnorm.errors import CakeError
from cake_rmsnorm.manifest import MANIFEST_NAME, Manifest, ManifestError
from cake_rmsnorm.runtime.native import PACKAGE as NATIVE_DIST

INDEX_SCHEMA = 1
SHIM_DIST = "cake_rmsnorm"
PROVIDER_MAX_BYTES = 25_000_000
NATIVE_MAX_BYTES = 1_000_000  # one small library (~0.1 MB packed); more is debug info or torch
SHIM_MAX_BYTES = 300_000
OWN_FILES = ("SHA256SUMS", "index.json", "index.md")
WHEEL_NAME = re.compile(r"(?P<dist>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)"
                        r"-(?P<plat>[^-]+)\.whl")
NATIVE_VERSION = re.compile(r"(?P<ours>[^+]+)\+torch(?P<torch>\d+\.\d+\.\d+)")
KIND_ORDER = {"shim": 0, "provider": 1, "native": 2, "dependency": 3}


class WheelhouseError(CakeError, RuntimeError):
    """Wheels that cannot make one consistent wheelhouse; `problems` lists each."""

    def __init__(self, problems: Iterable[str]):
        self.problems = list(problems)
        super().__init__("wheelhouse refused:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class WheelEntry:
    file: str
    kind: str  # shim | provider | native | dependency
    distribution: str
    version: str  # a native wheel's without its +torch<T> tag: ours, as the other wheels state it
    arch: str  # sm_100a for a provider, "" otherwise
    platform: str  # the wheel's platform tag: manylinux_2_28_aarch64, any, ...
    machine: str  # x86_64 | aarch64 | any
    size: int
    sha256: str
    libraries: int  # provider: libraries in its manifest; 0 otherwise
    toolkit: str  # provider: the nvcc version its manifest records; "" otherwise
    torch: str  # native: the torch release it is built for and requires; "" otherwise


# ---- reading one wheel -----------------------------------------------------------------------
def _machine_of(platform_tag: str) -> str:
    if platform_tag == "any":
        return "any"
    for machine in MACHINES:
        if all(part.endswith(machine) for part in platform_tag.split(".")):
            return machine
    return "unknown"


def _library_problems(name: str, member: str, data: bytes, machine: str,
                      platform_tag: str) -> List[str]:
    """A shared library runs where its wheel installs: its ELF machine is the wheel's, and it needs
    no newer glibc than the wheel's manylinux tag promises, nor a newer libstdc++ than the
    manylinux_2_28 policy's that every wheel of ours is built to."""
    problems = []
    got = elf_machine(data)
    if got != machine:
        problems.append(f"{name}:{member}: ELF machine {got}, the wheel is tagged {platform_tag}")
    glibc = MANYLINUX.fullmatch(platform_tag)
    needs = glibc_needed(data)
    if glibc and needs > (int(glibc.group(1)), int(glibc.group(2))):
        problems.append(f"{name}:{member}: needs GLIBC_{needs[0]}.{needs[1]}, newer than its "
                        f"tag {platform_tag} allows")
    libstdcxx = libstdcxx_problem(data)
    if libstdcxx:
        problems.append(f"{name}:{member}: {libstdcxx}")
    return problems


def _provider_problems(zf: zipfile.ZipFile, name: str, manifest: Manifest, machine: str,
                       platform_tag: str) -> List[str]:
    problems = []
    pkg = name.split("-", 1)[0]
    for entry in manifest.libraries:
        member = f"{pkg}/{entry.file}"
        try:
            data = zf.read(member)
        except KeyError:
            problems.append(f"{name}: lacks {member}, which its manifest lists")
            continue
        problems += _library_problems(name, member, data, machine, platform_tag)
    return problems


def _wheel_tag_problems(zf: zipfile.ZipFile, name: str, dist_info: str, plat: str) -> List[str]:
    if f"Tag: py3-none-{plat}" not in zf.read(f"{dist_info}/WHEEL").decode().splitlines():
        return [f"{name}: its WHEEL file does not say Tag: py3-none-{plat}"]
    return []


def _describe_native(path: Path, entry: dict) -> Tuple[WheelEntry, List[str]]:
    """The native eager step's wheel: <ours>+torch<T>, requiring torch==T, one library."""
    version = entry["version"]
    match = NATIVE_VERSION.fullmatch(version)
    if not match:
        raise WheelhouseError([f"{path.name}: version {version!r}: a native wheel's is "
                               f"<ours>+torch<release>, e.g. 0.1.0+torch2.11.0"])
    torch = match.group("torch")
    member = f"{NATIVE_DIST}/{NATIVE_LIBRARY}"
    try:
        with zipfile.ZipFile(path) as zf:
            dist_info = f"{NATIVE_DIST}-{version}.dist-info"
            problems = _wheel_tag_problems(zf, path.name, dist_info, entry["platform"])
            metadata = zf.read(f"{dist_info}/METADATA").decode().splitlines()
            problems += _library_problems(path.name, member, zf.read(member), entry["machine"],
                                          entry["platform"])
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError) as exc:
        raise WheelhouseError([f"{path}: not a readable native wheel: {exc}"]) from exc
    if f"Requires-Dist: torch=={torch}" not in metadata:
        problems.append(f"{path.name}: its METADATA does not say Requires-Dist: torch=={torch}, "
                        f"which its version +torch{torch} promises")
    entry.update(version=match.group("ours"), torch=torch)
    return WheelEntry(kind="native", **entry), problems


def describe_wheel(path: Path) -> Tuple[WheelEntry, List[str]]:
    """What the index says of one wheel, and the problems found reading it."""
    match = WHEEL_NAME.fullmatch(path.name)
    if not match:
        raise WheelhouseError([f"{path}: not a wheel file name (dist-version-py-abi-platform.whl)"])
    dist, version, plat = match.group("dist"), match.group("version"), match.group("plat")
    data = path.read_bytes()
    entry = dict(file=path.name, distribution=dist, version=version, platform=plat,
                 machine=_machine_of(plat), size=len(data),
                 sha256=hashlib.sha256(data).hexdigest(), arch="", libraries=0, toolkit="",
                 torch="")
    if dist == SHIM_DIST:
        return WheelEntry(kind="shim", **entry), []
    if dist == NATIVE_DIST:
        return _describe_native(path, entry)
    if not dist.startswith(SHIM_DIST + "_"):
        return WheelEntry(kind="dependency", **entry), []
    problems: List[str] = []
    try:
        with zipfile.ZipFile(path) as zf:
            problems += _wheel_tag_problems(zf, path.name, f"{dist}-{version}.dist-info", plat)
            manifest = Manifest.from_json(zf.read(f"{dist}/{MANIFEST_NAME}").decode(),
                                          f"{path.name}:{dist}/{MANIFEST_NAME}")
            problems += _provider_problems(zf, path.name, manifest, entry["machine"], plat)
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, ManifestError) as exc:
        raise WheelhouseError([f"{path}: not a readable provider wheel: {exc}"]) from exc
    if manifest.version != version:
        problems.append(f"{path.name}: manifest version {manifest.version}, file name {version}")
    if dist != SHIM_DIST + "_" + manifest.arch.replace("_", ""):
        problems.append(f"{path.name}: manifest arch {manifest.arch} is not this provider's")
    entry.update(arch=manifest.arch, libraries=len(manifest.libraries), toolkit=manifest.toolkit)
    return WheelEntry(kind="provider", **entry), problems


# ---- the house -------------------------------------------------------------------------------
def find_wheels(inputs: Iterable[Path]) -> List[Path]:
    found = []
    for item in map(Path, inputs):
        if item.is_dir():
            found += sorted(item.rglob("*.whl"))
        elif item.is_file() and item.suffix == ".whl":
            found.append(item)
        else:
            raise WheelhouseError([f"{item}: no such wheel or folder"])
    return found


def _size_problems(e: WheelEntry) -> List[str]:
    limit = {"provider": PROVIDER_MAX_BYTES, "native": NATIVE_MAX_BYTES}.get(e.kind, SHIM_MAX_BYTES)
    if e.kind != "dependency" and e.size > limit:
        return [f"{e.file}: {e.size} bytes, over the {limit} limit"]
    return []


def check(inputs: Sequence[Path]) -> List[WheelEntry]:
    """Each wheel's own checks (as `assemble` makes them), not those across wheels: a cell's output
    before the release job assembles it with the others (a native cell has no shim beside it)."""
    entries, problems = [], []
    for path in find_wheels(inputs):
        entry, found = describe_wheel(path)
        entries.append(entry)
        problems += found + _size_problems(entry)
    if not entries:
        problems.append(f"no wheels in {', '.join(map(str, inputs))}")
    if problems:
        raise WheelhouseError(problems)
    return sorted(entries, key=_sort_key)


def collect(wheels: Sequence[Path], deps: Sequence[Path] = ()) -> Dict[str, Tuple[Path, WheelEntry]]:
    """file name -> (a source path, entry), after every consistency check."""
    chosen: Dict[str, Tuple[Path, WheelEntry]] = {}
    problems: List[str] = []
    for path in list(wheels) + list(deps):
        entry, found = describe_wheel(path)
        problems += found
        if path in deps and entry.kind != "dependency":
            problems.append(f"{path}: a cake-rmsnorm wheel among the dependencies")
        seen = chosen.get(entry.file)
        if seen is not None and seen[1].sha256 != entry.sha256:
            problems.append(f"{entry.file}: two different files under one name ({seen[0]}, {path}); "
                            f"a build is not reproducible or two commits are mixed")
        chosen.setdefault(entry.file, (path, entry))
    entries = [e for _, e in chosen.values()]
    ours = [e for e in entries if e.kind != "dependency"]
    versions = sorted({e.version for e in ours})
    if len(versions) > 1:
        problems.append(f"cake-rmsnorm wheels at several versions {versions}: "
                        + ", ".join(sorted(e.file for e in ours)))
    if ours and not any(e.kind == "shim" for e in ours):
        problems.append("no cake-rmsnorm shim wheel: `pip install cake-rmsnorm[...]` would fail")
    if not ours:
        problems.append("no cake-rmsnorm wheels among the inputs")
    pairs: Dict[Tuple[str, str], List[str]] = {}
    natives: Dict[Tuple[str, str], List[str]] = {}
    for e in ours:
        if e.kind == "provider":
            pairs.setdefault((e.arch, e.machine), []).append(e.file)
        elif e.kind == "native":
            natives.setdefault((e.torch, e.machine), []).append(e.file)
        problems += _size_problems(e)
    problems += [f"{arch} on {machine}: several providers {files}"
                 for (arch, machine), files in sorted(pairs.items()) if len(files) > 1]
    problems += [f"torch {torch} on {machine}: several native wheels {files}"
                 for (torch, machine), files in sorted(natives.items()) if len(files) > 1]
    if problems:
        raise WheelhouseError(problems)
    return chosen


def _sort_key(e: WheelEntry):
    return (KIND_ORDER[e.kind], e.arch, e.torch, e.machine, e.file)


def index_json(entries: Sequence[WheelEntry]) -> str:
    ours = [e for e in entries if e.kind != "dependency"]
    doc = {"schema": INDEX_SCHEMA, "version": ours[0].version if ours else "",
           "wheels": [asdict(e) for e in sorted(entries, key=_sort_key)]}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def index_markdown(entries: Sequence[WheelEntry]) -> str:
    lines = ["# cake-rmsnorm wheelhouse", "",
             "    pip install --no-index --find-links WHEELHOUSE 'cake-rmsnorm[sm100a]'", "",
             "| wheel | kind | arch | host platform | version | size (bytes) | libraries | toolkit "
             "| torch |",
             "|---|---|---|---|---|---:|---:|---|---|"]
    for e in sorted(entries, key=_sort_key):
        lines.append(f"| {e.file} | {e.kind} | {e.arch or '-'} | {e.platform} | {e.version} | "
                     f"{e.size} | {e.libraries if e.kind == 'provider' else '-'} | "
                     f"{e.toolkit or '-'} | {e.torch or '-'} |")
    return "\n".join(lines) + "\n"


def sha256sums(entries: Sequence[WheelEntry]) -> str:
    return "".join(f"{e.sha256}  {e.file}\n" for e in sorted(entries, key=lambda e: e.file))


def assemble(inputs: Sequence[Path], out: Path, deps: Sequence[Path] = ()) -> List[WheelEntry]:
    """Check, then write the wheelhouse at `out` (replaced whole; only a former wheelhouse)."""
    out = Path(out)
    if out.exists():
        stray = sorted(p.name for p in out.iterdir()
                       if not (p.suffix == ".whl" or p.name in OWN_FILES))
        if stray:
            raise WheelhouseError([f"{out} holds files a wheelhouse does not ({', '.join(stray)}); "
                                   f"refusing to replace it: pick an empty or new --out"])
    chosen = collect(find_wheels(inputs), find_wheels(deps) if deps else [])
    entries = [entry for _, entry in chosen.values()]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name, (src, _) in sorted(chosen.items()):
            shutil.copyfile(src, tmp / name)
            os.chmod(tmp / name, 0o644)
        (tmp / "SHA256SUMS").write_text(sha256sums(entries))
        (tmp / "index.json").write_text(index_json(entries))
        (tmp / "index.md").write_text(index_markdown(entries))
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return sorted(entries, key=_sort_key)


# ---- dependencies (pip download) -------------------------------------------------------------
def download_deps(out: Path, select: Optional[Sequence[str]] = None,
                  matrix_path: Optional[str] = None) -> List[Path]:
    """The CUDA runtime and the verify tools of the matrix's toolkit, for each host platform of the
    selected cells (pip download: this needs the package index)."""
    from cake_rmsnorm.matrix import load_matrix

    cells = load_matrix(matrix_path).select(select)
    out.mkdir(parents=True, exist_ok=True)
    seen = set()
    for cell in cells:
        if cell.kind != "provider" or cell.platform.id in seen:  # native cells ship no dependency
            continue
        seen.add(cell.platform.id)
        pins = [cell.toolkit.runtime, *cell.toolkit.verify_tools]
        stamp = out / f".{cell.platform.id}.pins"  # pins, then the files they gave: a rerun skips pip
        if stamp.is_file():
            lines = stamp.read_text().splitlines()
            if lines[:len(pins)] == pins and all((out / f).is_file() for f in lines[len(pins):]):
                continue
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "--no-deps", "--only-binary=:all:", "-d", str(out)]
        for tag in cell.platform.pip_platforms:
            cmd += ["--platform", tag]
        proc = subprocess.run(cmd + pins, capture_output=True, text=True)
        if proc.returncode != 0:
            raise WheelhouseError([f"pip download for {cell.platform.id} failed "
                                   f"({' '.join(cmd + pins)}):\n{proc.stderr.strip()[-2000:]}"])
        got = sorted(p.name for p in out.glob("*.whl")
                     if _machine_of(p.name.rsplit("-", 1)[-1][:-4]) == cell.platform.machine)
        stamp.write_text("\n".join(pins + got) + "\n")
    return sorted(out.glob("*.whl"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("assemble", help="check and write the wheelhouse")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--deps", action="append", type=Path, default=[],
                   help="wheels (or folders of them) that ours need: the CUDA runtime, cuobjdump")
    p.add_argument("inputs", nargs="+", type=Path, help="wheels, or folders searched for *.whl")
    p = sub.add_parser("check", help="each wheel's own checks, without writing a wheelhouse")
    p.add_argument("inputs", nargs="+", type=Path, help="wheels, or folders searched for *.whl")
    p = sub.add_parser("deps", help="pip download the dependency wheels of the selected cells")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--select", action="append", help="cell identifier globs (default: all)")
    p.add_argument("--matrix", help="matrix file (default: ci/matrix.toml)")
    args = parser.parse_args(argv)
    try:
        if args.command == "deps":
            for path in download_deps(args.out, args.select, args.matrix):
                print(path)
            return 0
        checking = args.command == "check"
        for e in check(args.inputs) if checking else assemble(args.inputs, args.out, args.deps):
            extra = {"provider": f" {e.arch} {e.libraries} libraries",
                     "native": f" torch {e.torch}"}.get(e.kind, "")
            print(f"{e.file}  {e.size} bytes  {e.kind}{extra}")
        print("check: OK" if checking else
              f"wheelhouse: {args.out} (SHA256SUMS, index.json, index.md)")
        return 0
    except CakeError as exc:
        print(f"wheelhouse {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
