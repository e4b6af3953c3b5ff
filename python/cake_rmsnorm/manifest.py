"""The provider manifest: written by the packager, read by the loader and by `verify`.

It sits beside the registry on the ground floor so that neither the build nor the runtime has to
import the other. A provider package `cake_rmsnorm_<tag>` (e.g. cake_rmsnorm_sm90a) holds
`manifest.json` and `lib/<library file>` for every library of its arch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Tuple

from .errors import CakeError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
LIB_DIR = "lib"


class ManifestError(CakeError, ValueError):
    """A manifest is missing, unreadable or does not follow the schema."""


def provider_package(arch_tag: str) -> str:
    """Import name of the provider package for an arch tag ("sm90a" → "cake_rmsnorm_sm90a")."""
    return f"cake_rmsnorm_{arch_tag}"


def provider_distribution(arch_tag: str) -> str:
    """Distribution (pip) name of the provider wheel ("sm90a" → "cake-rmsnorm-sm90a")."""
    return f"cake-rmsnorm-{arch_tag}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class LibraryEntry:
    name: str
    program: str
    H: int  # 0: a generic library (its program takes H at run time; registry GENERIC_HIDDEN)
    weight_dtype: str
    residual: bool
    smem_bytes: int
    oversized: bool
    registers: int
    file: str  # relative to the provider package, e.g. "lib/libdet_pair_c64_h4096_fp32.so"
    sha256: str


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    version: str
    arch: str
    toolkit: str
    libraries: Tuple[LibraryEntry, ...]

    def to_json(self) -> str:
        doc = asdict(self)
        doc["libraries"] = [asdict(e) for e in sorted(self.libraries, key=lambda e: e.name)]
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"

    def library(self, name: str) -> LibraryEntry:
        for entry in self.libraries:
            if entry.name == name:
                return entry
        raise ManifestError(f"manifest of {self.arch} has no library {name!r}")

    @classmethod
    def from_json(cls, text: str, source: str = "manifest") -> "Manifest":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{source}: not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise ManifestError(f"{source}: expected a JSON object")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise ManifestError(f"{source}: schema_version {doc.get('schema_version')!r}, "
                                f"this cake-rmsnorm reads {SCHEMA_VERSION}")
        fields = {"schema_version", "version", "arch", "toolkit", "libraries"}
        if set(doc) != fields:
            raise ManifestError(f"{source}: fields {sorted(doc)}, expected {sorted(fields)}")
        entry_fields = set(LibraryEntry.__dataclass_fields__)
        entries = []
        for i, raw in enumerate(doc["libraries"]):
            if not isinstance(raw, dict) or set(raw) != entry_fields:
                got = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
                raise ManifestError(f"{source}: library #{i + 1} has fields {got}, "
                                    f"expected {sorted(entry_fields)}")
            entries.append(LibraryEntry(**raw))
        return cls(doc["schema_version"], doc["version"], doc["arch"], doc["toolkit"],
                   tuple(entries))

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ManifestError(f"cannot read manifest {path}: {exc}") from exc
        return cls.from_json(text, str(path))
