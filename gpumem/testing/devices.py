"""The devices a test runs on: parsing ``"sim:16GiB,sim:8GiB"``, mapping simulated devices to a
real backend (``--gpumem-backend cuda``), installing fresh simulated devices for one test, and
injecting driver faults into them.

Thread safety: nothing here is shared between tests; a :class:`GpumemDevices` belongs to the one
test that installed it (pytest runs a process's tests one at a time; xdist workers are separate
processes with their own simulated-device registry).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from gpumem.backends import (DeviceKind, backend_names, canonical_device, get_backend,
                             open_device)
from gpumem.errors import GpuMemoryError, InvalidDeviceError, InvalidInputError
from gpumem.units import format_bytes, parse_size

__all__ = ["ENV_VAR", "DEFAULT_DEVICES", "DeviceSpec", "parse_device_specs", "backend_choices",
           "map_to_backend", "GpumemDevices", "DevicesUnavailable", "install_devices",
           "FaultInjector"]

#: Environment variable read when ``--gpumem-devices`` is not given.
ENV_VAR = "GPUMEM_TEST_DEVICES"
#: What a test gets when neither the option, the variable nor its marker names devices.
DEFAULT_DEVICES = "sim:16GiB"
#: The keyword arguments of SimDevice.inject that a marker's ``faults=`` may use.
FAULT_KEYS = ("fail_after", "fail_rate", "fail_free", "fail_kind", "seed")


class DeviceSpec(NamedTuple):
    """One requested device: a simulated one of ``capacity`` bytes (``device`` None), or a real
    device string such as ``"cuda:0"`` (``capacity`` None)."""

    capacity: int | None
    device: str | None

    def __str__(self) -> str:
        return self.device if self.device is not None else f"sim:{format_bytes(self.capacity)}"


def _kind(backend: str) -> DeviceKind | None:
    """The registered backend's kind, None for a name no backend has."""
    return get_backend(backend).kind if backend in backend_names() else None


def parse_device_specs(text: str, *, what: str = "--gpumem-devices") -> list[DeviceSpec]:
    """``"sim:16GiB, sim:8GiB"`` -> two simulated devices; ``"cuda:0"``, ``"opencl:1"``,
    ``"cpu"`` (any registered backend's device string) name real devices. A simulated device
    needs a capacity (``sim:0`` would be a device of 0 bytes). Raises InvalidInputError naming
    `what` and the bad item."""
    if not isinstance(text, str):
        raise InvalidInputError(f"{what} must be a string such as 'sim:16GiB,sim:8GiB', got "
                                f"{type(text).__name__} {text!r}")
    specs: list[DeviceSpec] = []
    for i, raw in enumerate(text.split(",")):
        item = raw.strip()
        backend, _, arg = item.partition(":")
        kind = _kind(backend.strip().lower())
        if kind is DeviceKind.SIMULATED:
            try:
                capacity = parse_size(arg.strip(), what="capacity")
            except InvalidInputError as exc:
                raise InvalidInputError(f"{what}={text!r}: item {i} {item!r}: {exc}; a simulated "
                                        f"device is 'sim:SIZE', e.g. 'sim:16GiB'") from None
            if capacity <= 0:
                raise InvalidInputError(f"{what}={text!r}: item {i} {item!r} has no capacity; a "
                                        f"simulated device is 'sim:SIZE', e.g. 'sim:16GiB'")
            specs.append(DeviceSpec(capacity, None))
            continue
        try:
            device = canonical_device(item) if kind is not None else None
        except InvalidDeviceError:
            device = None
        if device is None:
            raise InvalidInputError(
                f"{what}={text!r}: item {i} {item!r} is not a device; expected comma-separated "
                f"'sim:SIZE' (e.g. 'sim:16GiB'), 'cuda:N', 'opencl:N' or 'cpu'")
        specs.append(DeviceSpec(None, device))
    return specs


def backend_choices() -> list[str]:
    """Backend names for --gpumem-backend: the simulated ones (the default) first."""
    names = backend_names()
    return sorted(names, key=lambda n: _kind(n) is not DeviceKind.SIMULATED)


def check_backend(backend: str, *, what: str = "--gpumem-backend") -> str:
    names = backend_choices()
    if not isinstance(backend, str) or backend.strip().lower() not in names:
        raise InvalidInputError(f"{what} must be one of {', '.join(names)}; got {backend!r}")
    return backend.strip().lower()


def map_to_backend(specs: Sequence[DeviceSpec], backend: str) -> list[DeviceSpec]:
    """The specs with the i-th simulated device replaced by ``backend``'s device i (a host
    backend has one device, ``"cpu"``); real devices are kept. A simulated backend
    (``"sim"``) changes nothing."""
    backend = check_backend(backend)
    kind = _kind(backend)
    if kind is DeviceKind.SIMULATED:
        return list(specs)
    out, i = [], 0
    for spec in specs:
        if spec.device is None:
            spec = DeviceSpec(None, canonical_device(f"{backend}:{i}"))
            i += kind is not DeviceKind.HOST
        out.append(spec)
    return out


class DevicesUnavailable(Exception):
    """A requested real device is absent here; the message says which and why (the plug-in
    skips the test with it)."""


class GpumemDevices(Sequence[str]):
    """The device strings of one test (``devices[0] == "sim:0"``...), with ``sim``: the
    :class:`gpumem_sim.SimDevice` objects installed for it (empty on a real backend)."""

    def __init__(self, strings: Sequence[str], sim: Sequence[Any],
                 sim_at: Sequence[Any] | None = None) -> None:
        """``sim_at``: per string, its SimDevice or None for a real device (default: the
        first ``len(sim)`` strings are the simulated ones)."""
        self._strings = tuple(strings)
        self.sim = tuple(sim)
        self._sim_at = (tuple(sim_at) if sim_at is not None
                        else self.sim + (None,) * (len(self._strings) - len(self.sim)))

    def __getitem__(self, i):  # type: ignore[override]
        return self._strings[i]

    def __len__(self) -> int:
        return len(self._strings)

    @property
    def simulated(self) -> bool:
        """True when every device of the test is simulated (faults can be injected)."""
        return len(self.sim) == len(self._strings)

    def sim_device(self, device: int | str = 0) -> Any:
        """The SimDevice for an index into this list or a device string such as ``"sim:1"``."""
        if isinstance(device, str):
            if device not in self._strings:
                raise InvalidInputError(f"device {device!r} is not one of this test's devices "
                                        f"{list(self._strings)}")
            index = self._strings.index(device)
        elif isinstance(device, int) and not isinstance(device, bool) \
                and -len(self) <= device < len(self):
            index = device
        else:
            raise InvalidInputError(f"device must be an index below {len(self)} or one of "
                                    f"{list(self._strings)}; got {device!r}")
        if self._sim_at[index] is None:
            raise InvalidInputError(f"{self._strings[index]} is a real device: faults can only "
                                    f"be injected into simulated devices")
        return self._sim_at[index]

    def __repr__(self) -> str:
        return f"GpumemDevices({list(self._strings)!r})"


@contextlib.contextmanager
def install_devices(specs: Sequence[DeviceSpec]) -> Iterator[GpumemDevices]:
    """Install fresh simulated devices for the specs (``sim:0``, ``sim:1``... in order, backed
    by host memory) and check that the real ones exist; the previous simulated devices come
    back on exit. Raises DevicesUnavailable when a real device is missing."""
    import gpumem_sim

    for spec in specs:
        if spec.device is not None:
            try:
                open_device(spec.device)
            except GpuMemoryError as exc:
                raise DevicesUnavailable(f"{spec.device} is not available here: {exc}") from None
    sims = [gpumem_sim.SimDevice(s.capacity, back_memory=True) for s in specs if s.device is None]
    strings, sim_at, k = [], [], 0
    for spec in specs:
        if spec.device is None:
            strings.append(f"sim:{k}")
            sim_at.append(sims[k])
            k += 1
        else:
            strings.append(spec.device)
            sim_at.append(None)
    with gpumem_sim.using(*sims):
        yield GpumemDevices(strings, sims, sim_at)


class FaultInjector:
    """Driver faults for one test's simulated devices (the ``gpumem_faults`` fixture). Each
    method acts on one device: ``device`` is an index into the test's devices or a device
    string, the first device by default. Faults are counted per device.

    >>> gpumem_faults.fail_allocations(after=2)   # 2 more raw allocations pass, then all fail
    >>> gpumem_faults.fail_rate(0.25, seed=7)     # each raw allocation fails with p = 0.25
    >>> gpumem_faults.fail_frees()                # every segment free fails (count=n: n frees)
    >>> gpumem_faults.clear()                     # every device healthy again

    These are *driver* faults (a new segment refused, a free refused): requests served from
    gpumem's cache do not reach the driver and cannot fail this way.
    """

    def __init__(self, devices: GpumemDevices) -> None:
        self.devices = devices

    def fail_allocations(self, after: int = 0, *, device: int | str = 0,
                         kind: str = "oom") -> None:
        """The next ``after`` raw allocations pass, every later one fails: with an
        out-of-memory (``kind="oom"``) or another driver error (``kind="error"``)."""
        self.devices.sim_device(device).inject(fail_after=after, fail_kind=kind)

    def fail_rate(self, rate: float, *, seed: int = 0, device: int | str = 0,
                  kind: str = "oom") -> None:
        """Each raw allocation fails with probability ``rate``; the same seed fails the same
        calls on every run."""
        self.devices.sim_device(device).inject(fail_rate=rate, seed=seed, fail_kind=kind)

    def fail_frees(self, count: bool | int = True, *, device: int | str = 0) -> None:
        """Segment frees fail: every one (``True``) or the next ``count``. A refused free leaves
        the segment allocated; gpumem keeps it cached and can free it later."""
        self.devices.sim_device(device).inject(fail_free=count)

    def apply(self, faults: Mapping[str, Any], *, device: int | str = 0,
              what: str = "faults") -> None:
        """Arm faults from a mapping of SimDevice.inject arguments (``fail_after``,
        ``fail_rate``, ``fail_free``, ``fail_kind``, ``seed``): what the marker's ``faults=``
        takes. Validated before anything changes."""
        if not isinstance(faults, Mapping):
            raise InvalidInputError(f"{what} must be a dict such as {{'fail_after': 2}}, got "
                                    f"{type(faults).__name__} {faults!r}")
        unknown = sorted(set(faults) - set(FAULT_KEYS))
        if unknown:
            raise InvalidInputError(f"{what}: unknown key(s) {unknown}; allowed: "
                                    f"{', '.join(FAULT_KEYS)}")
        try:
            self.devices.sim_device(device).inject(**faults)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{what}={dict(faults)!r}: {exc}") from None

    def clear(self, device: int | str | None = None) -> None:
        """Disarm the faults of one device, or of every device (None)."""
        if device is None:
            for sim in self.devices.sim:
                sim.clear_faults()
        else:
            self.devices.sim_device(device).clear_faults()

    def injected(self, device: int | str = 0) -> int:
        """How many failures were injected on the device so far."""
        return self.devices.sim_device(device).injected_failures
