#!/usr/bin/env python3
"""The wheelhouse: every wheel of the matrix in one folder that pip installs from, with SHA256SUMS
and an index (index.json, index.md) listing each wheel's kind, arch, host platform, version, size
and library count, read from the wheels themselves (file name, WHEEL, the provider manifest).

    python ci/wheelhouse.py assemble --out wheelhouse [--deps DIR] CELL_DIR_OR_WHEEL...
    python ci/wheelhouse.py deps --out DIR [--select GLOB]     # pip download what providers need

`assemble` checks before it writes: one version across our wheels, one provider per (arch, host
platform), a file name seen twice must be the same bytes (every cell writes the same shim), every
provider library's ELF machine is its wheel's and needs no newer glibc than the manylinux tag, and
the sizes hold (provider <= 25 MB, shim <= 300 kB). The folder is written aside and swapped in
whole; SHA256SUMS (sha256sum -c format) covers every wheel, and nothing in it depends on the time
or the order of the inputs, so two runs from one commit give the same bytes.
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

from cake_rmsnorm.errors import CakeError
from cake_rmsnorm.manifest import MANIFEST_NAME, Manifest, ManifestError

INDEX_SCHEMA = 1
SHIM_DIST = "cake_rmsnorm"
PROVIDER_MAX_BYTES = 25_000_000
SHIM_MAX_BYTES = 300_000
OWN_FILES = ("SHA256SUMS", "index.json", "index.md")
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
WHEEL_NAME = re.compile(r"(?P<dist>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)"
                        r"-(?P<plat>[^-]+)\.whl")
GLIBC_TAG = re.compile(r"manylinux_(\d+)_(\d+)_(\w+)")
KIND_ORDER = {"shim": 0, "provider": 1, "dependency": 2}


class WheelhouseError(CakeError, RuntimeError):
    """Wheels that cannot make one consistent wheelhouse; `problems` lists each."""

    def __init__(self, problems: Iterable[str]):
        self.problems = list(problems)
        super().__init__("wheelhouse refused:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class WheelEntry:
    file: str
    kind: str  # shim | provider | dependency
    distribution: str
    version: str
    arch: str  # sm_100a for a provider, "" otherwise
    platform: str  # the wheel's platform tag: manylinux_2_28_aarch64, any, ...
    machine: str  # x86_64 | aarch64 | any
    size: int
    sha256: str
    libraries: int  # provider: libraries in its manifest; 0 otherwise
    toolkit: str  # provider: the nvcc version its manifest records; "" otherwise


# ---- reading one wheel -----------------------------------------------------------------------
def elf_machine(data: bytes) -> str:
    """The ELF header's e_machine, named (x86_64, aarch64), or 'not ELF'."""
    if len(data) < 20 or data[:4] != b"\x7fELF":
        return "not ELF"
    number = int.from_bytes(data[18:20], "little" if data[5] == 1 else "big")
    return ELF_MACHINES.get(number, f"EM {number}")


def glibc_needed(data: bytes) -> Tuple[int, int]:
    """The newest GLIBC_x.y symbol version a shared library names (its .dynstr holds one string per
    version it needs); (0, 0) when it names none."""
    found = [(int(a), int(b)) for a, b in re.findall(rb"GLIBC_(\d+)\.(\d+)", data)]
    return max(found, default=(0, 0))


def _machine_of(platform_tag: str) -> str:
    if platform_tag == "any":
        return "any"
    for machine in ("x86_64", "aarch64"):
        if all(part.endswith(machine) for part in platform_tag.split(".")):
            return machine
    return "unknown"


def _provider_problems(zf: zipfile.ZipFile, name: str, manifest: Manifest, machine: str,
                       platform_tag: str) -> List[str]:
    problems = []
    glibc = GLIBC_TAG.fullmatch(platform_tag)
    limit = (int(glibc.group(1)), int(glibc.group(2))) if glibc else None
    pkg = name.split("-", 1)[0]
    for entry in manifest.libraries:
        member = f"{pkg}/{entry.file}"
        try:
            data = zf.read(member)
        except KeyError:
            problems.append(f"{name}: lacks {member}, which its manifest lists")
            continue
        got = elf_machine(data)
        if got != machine:
            problems.append(f"{name}:{member}: ELF machine {got}, the wheel is tagged {platform_tag}")
        needs = glibc_needed(data)
        if limit is not None and needs > limit:
            problems.append(f"{name}:{member}: needs GLIBC_{needs[0]}.{needs[1]}, newer than its "
                            f"tag {platform_tag} allows")
    return problems


def describe_wheel(path: Path) -> Tuple[WheelEntry, List[str]]:
    """What the index says of one wheel, and the problems found reading it."""
    match = WHEEL_NAME.fullmatch(path.name)
    if not match:
        raise WheelhouseError([f"{path}: not a wheel file name (dist-version-py-abi-platform.whl)"])
    dist, version, plat = match.group("dist"), match.group("version"), match.group("plat")
    data = path.read_bytes()
    entry = dict(file=path.name, distribution=dist, version=version, platform=plat,
                 machine=_machine_of(plat), size=len(data),
                 sha256=hashlib.sha256(data).hexdigest(), arch="", libraries=0, toolkit="")
    if dist == SHIM_DIST:
        return WheelEntry(kind="shim", **entry), []
    if not dist.startswith(SHIM_DIST + "_"):
        return WheelEntry(kind="dependency", **entry), []
    problems: List[str] = []
    try:
        with zipfile.ZipFile(path) as zf:
            wheel_meta = zf.read(f"{dist}-{version}.dist-info/WHEEL").decode()
            if f"Tag: py3-none-{plat}" not in wheel_meta.splitlines():
                problems.append(f"{path.name}: its WHEEL file does not say Tag: py3-none-{plat}")
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
    for e in ours:
        if e.kind == "provider":
            pairs.setdefault((e.arch, e.machine), []).append(e.file)
            if e.size > PROVIDER_MAX_BYTES:
                problems.append(f"{e.file}: {e.size} bytes, over the {PROVIDER_MAX_BYTES} limit")
        elif e.size > SHIM_MAX_BYTES:
            problems.append(f"{e.file}: {e.size} bytes, over the {SHIM_MAX_BYTES} limit")
    problems += [f"{arch} on {machine}: several providers {files}"
                 for (arch, machine), files in sorted(pairs.items()) if len(files) > 1]
    if problems:
        raise WheelhouseError(problems)
    return chosen


def _sort_key(e: WheelEntry):
    return (KIND_ORDER[e.kind], e.arch, e.machine, e.file)


def index_json(entries: Sequence[WheelEntry]) -> str:
    ours = [e for e in entries if e.kind != "dependency"]
    doc = {"schema": INDEX_SCHEMA, "version": ours[0].version if ours else "",
           "wheels": [asdict(e) for e in sorted(entries, key=_sort_key)]}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def index_markdown(entries: Sequence[WheelEntry]) -> str:
    lines = ["# cake-rmsnorm wheelhouse", "",
             "    pip install --no-index --find-links WHEELHOUSE 'cake-rmsnorm[sm100a]'", "",
             "| wheel | kind | arch | host platform | version | size (bytes) | libraries | toolkit |",
             "|---|---|---|---|---|---:|---:|---|"]
    for e in sorted(entries, key=_sort_key):
        lines.append(f"| {e.file} | {e.kind} | {e.arch or '-'} | {e.platform} | {e.version} | "
                     f"{e.size} | {e.libraries if e.kind == 'provider' else '-'} | "
                     f"{e.toolkit or '-'} |")
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
        if cell.platform.id in seen:
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
        for e in assemble(args.inputs, args.out, args.deps):
            extra = f" {e.arch} {e.libraries} libraries" if e.kind == "provider" else ""
            print(f"{e.file}  {e.size} bytes  {e.kind}{extra}")
        print(f"wheelhouse: {args.out} (SHA256SUMS, index.json, index.md)")
        return 0
    except CakeError as exc:
        print(f"wheelhouse {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
