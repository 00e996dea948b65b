"""Harness: device strings (``"cuda:0"``, ``" SIM : 80 GiB "``, ``"cpu"``) as the API, the CLI
and ``GPUMEM_DEVICE`` take them: ``gpumem.backends.parse_device``, ``canonical_device`` and,
for ``sim:<size>`` and ``cpu`` (cheap to open), ``open_device``.

Allowed outcomes: a result, or InvalidDeviceError / InvalidInputError /
BackendUnavailableError (GpuMemoryError). Properties: the canonical spelling is a fixed point
(canonical of canonical is itself) and names the same (backend, index) as the original.
"""
from __future__ import annotations

from typing import Iterable

from gpumem.backends import canonical_device, open_device, parse_device
from gpumem.errors import GpuMemoryError


def check(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    try:
        canon = canonical_device(text)
    except GpuMemoryError:
        canon = None
    try:
        parsed = parse_device(text)
    except GpuMemoryError:
        parsed = None
    if canon is not None:
        assert canonical_device(canon) == canon, (text, canon)
        if parsed is not None:
            assert parse_device(canon) == parsed, (text, canon, parsed)
        if canon == "cpu" or (canon.startswith("sim:") and not canon[4:].isdigit()):
            try:
                dev = open_device(text)
            except GpuMemoryError:
                return
            try:
                assert dev.device_string.split(":")[0] == canon.split(":")[0]
            finally:
                dev.close()


def seeds() -> Iterable[bytes]:
    for s in ("cuda:0", "cuda:1", "opencl:0", "sim", "sim:0", "sim:2", "sim:80GiB",
              " SIM : 1.5 GB ", "cpu", "cpu:0", "CUDA : 1 ", "sim:0x10", "tpu:0", "sim:-1",
              "sim:\u00b2", "cuda:\u0661", "sim:1e3GiB", ":", ""):
        yield s.encode()
