"""What a shared library asks of the system it loads on, read from its bytes: its ELF machine and
the newest symbol version it names of a versioned library (GLIBC_x.y, GLIBCXX_x.y.z). A wheel's
manylinux tag promises a glibc (and, by the manylinux policies, a libstdc++); these say whether a
library keeps that promise (ci/wheelhouse.py checks it, build/native.py tags by it). The
machines, the tag's pattern and the libstdc++ ceiling live here too, the one copy of each."""

from __future__ import annotations

import re
from typing import Optional, Tuple

ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
# the machines our wheels are built for (the matrix's, the wheelhouse's)
MACHINES = tuple(ELF_MACHINES.values())
# a provider or native wheel's tag: glibc major, minor, machine
MANYLINUX = re.compile(rf"manylinux_(\d+)_(\d+)_({'|'.join(MACHINES)})")
# the newest libstdc++ symbol version a manylinux_2_28 wheel may name (GCC 8's)
MAX_GLIBCXX = (3, 4, 25)


def elf_machine(data: bytes) -> str:
    """The ELF header's e_machine, named (x86_64, aarch64), or 'not ELF'."""
    if len(data) < 20 or data[:4] != b"\x7fELF":
        return "not ELF"
    number = int.from_bytes(data[18:20], "little" if data[5] == 1 else "big")
    return ELF_MACHINES.get(number, f"EM {number}")


def newest_version(data: bytes, library: str) -> Tuple[int, ...]:
    """The newest `<library>_x.y[.z]` symbol version a shared library names (its .dynstr holds one
    string per version it needs); () when it names none. library: GLIBC or GLIBCXX."""
    found = re.findall(rb"(?<![A-Z_])" + library.encode() + rb"_(\d+(?:\.\d+)+)(?![\d.])", data)
    return max((tuple(int(p) for p in v.split(b".")) for v in found), default=())


def glibc_needed(data: bytes) -> Tuple[int, int]:
    """The newest GLIBC_x.y a shared library needs; (0, 0) when it names none."""
    return (newest_version(data, "GLIBC") + (0, 0))[:2]


def libstdcxx_problem(library: bytes) -> Optional[str]:
    """Why a shared library breaks a wheel's manylinux promise of libstdc++, or None. Every wheel
    of ours is built from manylinux_2_28 (a provider keeps its tag; the native wheel only raises its
    glibc), whose policy pins libstdc++ to GCC 8's: GLIBCXX_3.4.25 at most."""
    needs = newest_version(library, "GLIBCXX")
    if needs <= MAX_GLIBCXX:
        return None
    return (f"needs GLIBCXX_{'.'.join(map(str, needs))}, newer than the "
            f"GLIBCXX_{'.'.join(map(str, MAX_GLIBCXX))} of manylinux_2_28's libstdc++")
