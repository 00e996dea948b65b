"""Fail if a wheel's compiled code needs a newer glibc or libstdc++ than manylinux_2_28 allows.

    python ci/wheel_symbols.py WHEEL_OR_SO...      (ci/package.sh runs it on every wheel)

Reads every ELF shared object (``*.so``, ``*.so.N``) in each wheel, or each ``.so`` given
directly, and lists the versioned symbols it imports (``.dynsym`` with ``.gnu.version`` and
``.gnu.version_r``, as ``objdump -T`` shows them) with pyelftools, which auditwheel itself
depends on. A symbol whose version is newer than the policy's newest for its library family
(GLIBC_2.28, GLIBCXX_3.4.24, CXXABI_1.3.11, GCC_7.0.0: auditwheel's manylinux_2_28 policy) is
reported with its file; the exit status is 1 if there is any. Otherwise one line per input
says the newest version each family needs.
"""
from __future__ import annotations

import io
import re
import sys
import zipfile
from pathlib import Path

from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

#: the newest version of each family a manylinux_2_28 wheel may import (auditwheel's policy)
NEWEST = {"GLIBC": (2, 28), "GLIBCXX": (3, 4, 24), "CXXABI": (1, 3, 11), "GCC": (7, 0, 0)}
_VERSION = re.compile(r"^(GLIBC|GLIBCXX|CXXABI|GCC)_([0-9]+(?:\.[0-9]+)*)$")


def imported_versions(elf_bytes: bytes) -> list[tuple[str, str, tuple[int, ...]]]:
    """(symbol, family, version) of every undefined dynamic symbol bound to a version of one
    of the families in NEWEST."""
    elf = ELFFile(io.BytesIO(elf_bytes))
    needs = {}                                      # version index -> version name
    verneed = elf.get_section_by_name(".gnu.version_r")
    if verneed is not None:
        for _, auxes in verneed.iter_versions():
            for aux in auxes:
                needs[aux["vna_other"]] = aux.name
    versym = elf.get_section_by_name(".gnu.version")
    dynsym = elf.get_section_by_name(".dynsym")
    if versym is None or not isinstance(dynsym, SymbolTableSection):
        return []
    found = []
    for i, sym in enumerate(dynsym.iter_symbols()):
        if sym["st_shndx"] != "SHN_UNDEF" or not sym.name:
            continue
        ndx = versym.get_symbol(i)["ndx"]
        match = _VERSION.match(needs.get(ndx if isinstance(ndx, int) else -1, ""))
        if match:
            found.append((sym.name, match[1], tuple(int(p) for p in match[2].split("."))))
    return found


def shared_objects(path: Path) -> list[tuple[str, bytes]]:
    """(name, bytes) of each ELF shared object in a wheel, or of a .so file itself."""
    if path.suffix != ".whl":
        return [(path.name, path.read_bytes())]
    with zipfile.ZipFile(path) as whl:
        found = [(n, whl.read(n)) for n in whl.namelist() if re.search(r"\.so(\.[0-9]+)*$", n)]
    return [(n, data) for n, data in found if data[:4] == b"\x7fELF"]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    too_new = []
    for arg in argv:
        path = Path(arg)
        newest: dict[str, tuple[int, ...]] = {}
        objects = shared_objects(path)
        for name, data in objects:
            for symbol, family, version in imported_versions(data):
                newest[family] = max(newest.get(family, version), version)
                if version > NEWEST[family]:
                    too_new.append(f"{path.name}: {name} imports {symbol}@{family}_"
                                   + ".".join(map(str, version)))
        needs = ", ".join(f"{fam}_{'.'.join(map(str, v))}" for fam, v in sorted(newest.items()))
        print(f"{path.name}: {len(objects)} shared objects; newest versions imported: "
              f"{needs or 'none'}")
    for line in too_new:
        print(f"too new for manylinux_2_28: {line}", file=sys.stderr)
    return 1 if too_new else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
