"""Fuzz harnesses for what gpumem parses from its users (issue 24). Run: ``bash ci/fuzz.sh``.

Why a folder of tests/: the harnesses are test code (they assert properties of gpumem), the
inputs that once broke gpumem are kept here (``crashes/<harness>/``) and replayed by
tests/test_fuzz_regressions.py in every test run, and none of it ships with the package.

One module per harness (``trace_csv``, ``trace_sidecar``, ``torch_snapshot``, ``sizes``,
``devices``, ``env_config``, ``views``), each with

- ``check(data: bytes) -> None``: feed the input to gpumem; returns when gpumem gave a result
  or raised a :class:`gpumem.errors.GpuMemoryError` subclass (the only outcomes allowed, plus
  the protocol exceptions a harness names, e.g. DLPack's ``BufferError``); anything else
  propagates (a finding). It also asserts what a result must satisfy;
- ``seeds() -> Iterable[bytes]``: the starting corpus (from the shipped traces where the input
  is a file).

``check`` needs no fuzzer: the structured harnesses decode their bytes with :class:`Bytes`
(not atheris' FuzzedDataProvider), so a saved input replays in any test environment.
tests/fuzz/run.py drives one harness with atheris (coverage-guided, libFuzzer).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence, TypeVar

__all__ = ["HARNESSES", "HERE", "Bytes", "shared_trace_files"]

HERE = Path(__file__).resolve().parent
HARNESSES = ("trace_csv", "trace_sidecar", "torch_snapshot", "sizes", "devices", "env_config",
             "views")

T = TypeVar("T")


class Bytes:
    """Structured values read off the front of a fuzzer's input. Reading past the end gives
    zeros (the smallest choice), so every input decodes to something and short inputs stay
    simple: the fuzzer lengthens an input to reach further choices."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def remaining(self) -> int:
        return max(0, len(self._data) - self._pos)

    def byte(self) -> int:
        if self._pos >= len(self._data):
            self._pos += 1
            return 0
        self._pos += 1
        return self._data[self._pos - 1]

    def uint(self, nbytes: int) -> int:
        """An unsigned integer of ``nbytes`` bytes (little-endian)."""
        return int.from_bytes(bytes(self.byte() for _ in range(nbytes)), "little")

    def below(self, n: int) -> int:
        """An integer in [0, n)."""
        return self.byte() % n if n <= 256 else self.uint(8) % n

    def pick(self, choices: Sequence[T]) -> T:
        return choices[self.below(len(choices))]

    def flag(self) -> bool:
        return bool(self.byte() & 1)

    def blob(self, max_len: int) -> bytes:
        """Up to ``max_len`` bytes: a length byte, then that many bytes."""
        n = min(self.byte(), max_len)
        out = self._data[self._pos:self._pos + n]
        self._pos += n
        return out

    def text(self, max_len: int = 255) -> str:
        """A string of up to ``max_len`` bytes of UTF-8 (undecodable bytes kept as surrogate
        escapes: still a str, as os.environ gives them)."""
        return self.blob(max_len).decode("utf-8", "surrogateescape")

    def rest(self) -> bytes:
        out = self._data[self._pos:]
        self._pos = len(self._data)
        return out


def shared_trace_files() -> list[Path]:
    """The traces shipped with gpumem (gpumem/data: real PyTorch allocation streams) and those
    of ``$GPUMEM_TRACES`` when set (e.g. the shared traces): the
    seed corpus of the file harnesses."""
    import os

    import gpumem
    data = Path(gpumem.__file__).resolve().parent / "data"
    roots = [data, data / "traces"]
    if os.environ.get("GPUMEM_TRACES"):
        root = Path(os.environ["GPUMEM_TRACES"])
        roots.append(root)
    found: dict[str, Path] = {}
    for root in roots:
        for p in sorted(root.glob("*.csv.gz")):
            found.setdefault(p.name, p)        # the same trace in two places: once
    return list(found.values())
