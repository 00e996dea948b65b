"""MemoryConfig: every knob of a MemoryManager, validated at construction.

``MemoryConfig.from_env()`` reads ``GPUMEM_<FIELD>`` variables and warns
(:class:`gpumem.UnknownSettingWarning`) about any other ``GPUMEM_*`` variable it does not know,
naming the known ones: a misspelled setting is never silently ignored.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from gpumem.errors import InvalidInputError, UnknownSettingWarning
from gpumem.units import GiB, MiB, parse_size

__all__ = ["MemoryConfig", "MAX_BYTES", "SIZE_FIELDS", "OTHER_VARIABLES", "USER_VARIABLES",
           "INTERNAL_VARIABLES", "HANDLE_PER_GROWTH", "SEGMENT_POLICIES", "LIMIT_FIELDS",
           "parse_handle_size", "env_settings"]

#: GPUMEM_* variables a user sets, read elsewhere (besides GPUMEM_<FIELD> of MemoryConfig):
#: from_env does not warn about these, and its warning about an unknown one lists them.
USER_VARIABLES = frozenset({
    "GPUMEM_SHARED_DIR",        # the folder of shared-budget ledgers (gpumem.placement.ledger)
    "GPUMEM_DEBUG",             # tracking on (config)
    "GPUMEM_DEVICE",            # the default device (gpumem.default_device, get_manager)
    "GPUMEM_SIM_DEVICES",       # simulated devices (gpumem_sim)
    "GPUMEM_HOST_PINNED",       # host backend pinning
    "GPUMEM_CUDA_NATIVE",       # cuda backend: use the Cython fast path
    "GPUMEM_DUMP_ON_OOM",       # history and snapshot dumps on OOM (gpumem.observe.history)
    "GPUMEM_TEST_DEVICES",      # the pytest plug-in (gpumem.testing)
    "GPUMEM_BUILD_CUDA",        # setup.py: build the CUDA fast path (docs/install.md)
})

#: GPUMEM_* variables of this project's own CI, tests and benchmarks: from_env does not warn
#: about these either, but never offers them to a user. Add a variable to one of the two sets
#: when a module starts reading one.
INTERNAL_VARIABLES = frozenset({
    "GPUMEM_TEST_BACKENDS",     # tests
    "GPUMEM_TRACES",            # benchmarks
    "GPUMEM_VENV",              # ci scripts
    "GPUMEM_OFFLINE",           # ci/setup_env.sh: install nothing (a pre-provisioned machine)
    "GPUMEM_CBENCH_DIR",        # benchmarks
    "GPUMEM_TEST_EXPANDABLE_SEGMENTS",  # tests: 0 runs the suite with expandable segments off
    "GPUMEM_TEST_SEGMENTS",     # tests: the segment policy of the shared base configs
    "GPUMEM_TEST_SANITIZED",    # tests: ci/sanitize.sh's run (timing bounds widened)
    "GPUMEM_FRAMEWORK_EXTRAS",  # ci/gpu.sh
    "GPUMEM_TEST_INSTALLED",    # tests: gpumem must be an installed wheel (ci/package.sh)
    "GPUMEM_PACKAGE_PYTHONS",   # ci/package.sh: the interpreters to build wheels for
    "GPUMEM_PACKAGE_KEEP",      # ci/package.sh: keep its work folder
})

#: every GPUMEM_* variable read besides GPUMEM_<FIELD>
OTHER_VARIABLES = USER_VARIABLES | INTERNAL_VARIABLES

#: the MemoryConfig fields that hold a byte count: each takes an int or a size string
SIZE_FIELDS = ("min_free_bytes", "reserve_bytes", "granularity", "small_size", "small_segment",
               "large_segment", "large_threshold", "large_round", "max_split_size",
               "large_split_min", "oversize_slack", "max_pool_size", "expandable_handle_size")

#: the largest byte count (and count) a setting may hold: 4 EiB, far past any device, and small
#: enough that the pool's size_t arithmetic (rounding, segment plus slack) cannot overflow
MAX_BYTES = 1 << 62

#: the MemoryConfig fields that limit what a manager holds (docs/pressure_and_oom.md, "Soft and
#: hard limits"): left at its default each is soft (it bounds the cache and sets the pressure
#: scale, never refuses what the device can serve); set by the user it is hard
LIMIT_FIELDS = ("gpu_memory_fraction", "min_free_bytes", "reserve_bytes", "max_pool_size")

#: MemoryConfig.expandable_handle_size for one physical handle per growth
HANDLE_PER_GROWTH = "growth"

#: MemoryConfig.segments: how the large pool gets memory from the device (docs/segments.md).
#: ``auto``: large physical handles while there is room, compaction near the limits;
#: ``tight``: one page per handle, always compacting; ``fast``: one handle per growth, never
#: compacting before the OOM ladder; ``plain``: one driver allocation per segment (no virtual
#: memory; what devices without it always use)
SEGMENT_POLICIES = ("auto", "tight", "fast", "plain")


def parse_handle_size(raw: str, what: str = "expandable_handle_size") -> int | str:
    """An expandable_handle_size from text (environment, command lines): a size such as
    ``20MiB`` (0: one page) or ``growth`` in any case. InvalidInputError names ``what``."""
    if raw.strip().lower() == HANDLE_PER_GROWTH:
        return HANDLE_PER_GROWTH
    try:
        return parse_size(raw, what=what)
    except ValueError:
        raise InvalidInputError(f"{what}: expected a size (e.g. 20MiB; 0: one page) or "
                                f"{HANDLE_PER_GROWTH!r}, got {raw!r}") from None


#: a shared_group name: it becomes part of a file name
SHARED_GROUP_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def parse_shared_budget(raw: str) -> int | float:
    """A shared_budget written as text: a fraction of the device (``"0.5"``, ``"1"``) or a
    size (``"6GiB"``, ``"1000000"`` bytes)."""
    text = raw.strip()
    try:
        value = float(text)
    except ValueError:
        return parse_size(text, what="shared_budget")
    if not math.isfinite(value):
        raise InvalidInputError(f"shared_budget must be a size or a fraction in (0, 1], got "
                                f"{raw!r}")
    if value <= 1.0 and ("." in text or value == 1.0):
        return value                       # "0.5", "1", "1.0": a fraction of the device
    if value != int(value):
        raise InvalidInputError(f"shared_budget must be a size or a fraction in (0, 1], got "
                                f"{raw!r}")
    return parse_size(text, what="shared_budget")


def _debug_env() -> bool:
    return os.environ.get("GPUMEM_DEBUG", "") not in ("", "0", "false", "False")


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class MemoryConfig:
    """How a manager uses its device. Every size field takes an int number of bytes or a size
    string (``"4GiB"``, ``"512MiB"``: :func:`gpumem.units.parse_size`), stored as an int.

    Limits (:data:`LIMIT_FIELDS`; docs/pressure_and_oom.md): ``usable_memory = min(total *
    gpu_memory_fraction, total - reserve)`` and ``min_free_bytes`` left free on the device.
    Left at their defaults they are *soft*: they bound what the pool keeps cached (a growth
    past them first releases cached memory) and set the pressure scale (past usable memory is
    CRITICAL), but never refuse a request the device can serve. A limit the user sets (a value
    passed here, to :meth:`replace` or a ``with_*`` method, to ``gpumem.configure``, a
    ``GPUMEM_*`` variable, a capping preset) is *hard*: the manager never holds more than it
    allows, and an OutOfMemoryError names it. :attr:`user_limits` says which are hard;
    :meth:`with_soft_limits` sets a value that stays soft.
    """

    gpu_memory_fraction: float = 0.9
    cpu_fallback_enabled: bool = True
    min_free_bytes: int = 512 * MiB
    track_allocations: bool = field(default_factory=_debug_env)
    track_stacks: bool = False              # keep the creation stack of each tracked buffer
    max_pooled_per_bucket: int = 8          # wholly free large segments cached per size class
    reserve_bytes: int | None = None        # None: the backend's advice (CUDA: driver+context)
    # pool knobs
    granularity: int = 512
    small_size: int = 1 * MiB
    small_segment: int = 2 * MiB
    large_segment: int = 20 * MiB
    large_threshold: int = 10 * MiB
    large_round: int = 512                  # big requests get a segment of their own, exact size
    max_split_size: int | None = None
    large_split_min: int = 1 * MiB
    oversize_slack: int = 20 * MiB
    max_pool_size: int | None = None        # cached (free) bytes kept; None: no cap
    release_before_grow: bool = True        # before growing past the reserved high-water mark,
                                            # return idle segments that offset the growth
    segments: str = "auto"                  # SEGMENT_POLICIES: the large pool's segment policy
    # the two settings `segments` names by intent (None: as `segments` says): False means
    # plain; a size means tight with handles of that size (0: one page), "growth" means fast
    expandable_segments: bool | None = None
    expandable_handle_size: int | str | None = None
    # pressure: fractions of usable memory where MEDIUM, HIGH, CRITICAL begin
    pressure_thresholds: tuple[float, float, float] = (0.60, 0.80, 0.95)
    auto_release_at_high: bool = True       # at HIGH, trim the cache to high_cache_fraction
    high_cache_fraction: float = 0.10       # of usable memory, kept cached at HIGH
    auto_cleanup_at_critical: bool = True   # at CRITICAL, release every wholly free segment
    # a budget shared with this user's other processes on the device (docs/shared_budget.md)
    shared_group: str | None = None         # the group to join (None: no sharing)
    shared_budget: int | float | str | None = None  # bytes (an int or a size string), or a
                                            # fraction in (0, 1] of the device's total memory;
                                            # None: 1.0 (the whole device)
    shared_hand_back: bool = True           # a growth past the budget first asks the others
                                            # to release cached memory

    def __post_init__(self) -> None:
        self._normalise_sizes()
        f = self.gpu_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) \
                or not 0.0 < f <= 1.0:
            raise InvalidInputError(
                f"gpu_memory_fraction must be a number in (0, 1], got {f!r}")
        for name in ("cpu_fallback_enabled", "track_allocations", "track_stacks",
                     "release_before_grow", "auto_release_at_high", "auto_cleanup_at_critical"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.expandable_segments is not None and not isinstance(self.expandable_segments, bool):
            raise InvalidInputError(f"expandable_segments must be a bool or None, got "
                                    f"{self.expandable_segments!r}")
        for name in ("min_free_bytes", "granularity", "small_size", "small_segment",
                     "large_segment", "large_threshold", "large_round", "large_split_min",
                     "oversize_slack", "max_pooled_per_bucket"):
            self._check_int(name, getattr(self, name))
        if self.expandable_handle_size not in (None, HANDLE_PER_GROWTH):   # strings parsed above
            self._check_int("expandable_handle_size", self.expandable_handle_size)
        self._resolve_segments()
        for name in ("reserve_bytes", "max_split_size", "max_pool_size"):
            if getattr(self, name) is not None:
                self._check_int(name, getattr(self, name))
        if not _power_of_two(self.granularity):
            raise InvalidInputError(
                f"granularity must be a power of two, got {self.granularity}")
        for name in ("small_segment", "large_segment", "large_round"):
            if getattr(self, name) == 0:
                raise InvalidInputError(f"{name} must be > 0")
        if self.small_size > self.small_segment:
            raise InvalidInputError(
                f"small_size ({self.small_size}) must not exceed small_segment "
                f"({self.small_segment})")
        if self.large_threshold > self.large_segment:
            raise InvalidInputError(
                f"large_threshold ({self.large_threshold}) must not exceed large_segment "
                f"({self.large_segment})")
        t = self.pressure_thresholds
        if (not isinstance(t, tuple) or len(t) != 3
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
                       for x in t)
                or not 0.0 < t[0] < t[1] < t[2] <= 1.0):
            raise InvalidInputError(
                f"pressure_thresholds must be three increasing fractions in (0, 1], got {t!r}")
        self._check_shared()
        h = self.high_cache_fraction
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h) \
                or not 0.0 <= h <= 1.0:
            raise InvalidInputError(f"high_cache_fraction must be in [0, 1], got {h!r}")

    def _resolve_segments(self) -> tuple[str, int]:
        """``(policy, handle bytes of the tight policy, 0: one page)`` from ``segments`` (any
        case, like GPUMEM_SEGMENTS) and the two older settings. An older setting set
        explicitly names the policy over ``auto`` (the default); one that contradicts the
        policy ``segments`` names (``segments="plain"`` with ``expandable_segments=True`` or
        a handle size, ``tight`` with ``"growth"``, False with a handle size...) is an
        InvalidInputError naming both."""
        seg, on, handle = self.segments, self.expandable_segments, self.expandable_handle_size
        if isinstance(seg, str) and seg.strip().lower() != seg:
            # one rule with GPUMEM_SEGMENTS: a policy name in any case ("Auto" is auto)
            seg = seg.strip().lower()
            object.__setattr__(self, "segments", seg)
        if seg not in SEGMENT_POLICIES:
            raise InvalidInputError(f"segments must be one of {', '.join(SEGMENT_POLICIES)}, "
                                    f"got {seg!r}")
        implied = (None if handle is None else
                   "fast" if handle == HANDLE_PER_GROWTH else "tight")
        if seg == "plain" and (on is True or implied is not None):
            # plain named explicitly and an older setting that says expandable: neither wins
            said = ("expandable_segments=True" if on is True
                    else f"expandable_handle_size={handle!r}")
            raise InvalidInputError(
                f"segments='plain' (no virtual memory) contradicts {said} (expandable "
                f"segments); set only segments (auto, tight, fast or plain)")
        if on is False:
            if seg not in ("auto", "plain") or implied is not None:
                raise InvalidInputError(
                    f"expandable_segments=False means segments='plain', which contradicts "
                    f"segments={seg!r}" + (f" and expandable_handle_size={handle!r}"
                                           if implied else "") + "; set only segments")
            return "plain", 0
        if implied is not None:
            if seg not in ("auto", implied):   # a size says tight, "growth" fast
                raise InvalidInputError(
                    f"expandable_handle_size={handle!r} means segments={implied!r}, which "
                    f"contradicts segments={seg!r}; set only segments")
            return implied, (handle if implied == "tight" else 0)
        return seg, 0

    @property
    def segment_policy(self) -> str:
        """The large pool's policy in force: one of :data:`SEGMENT_POLICIES` (``segments``,
        or what ``expandable_segments`` / ``expandable_handle_size`` say when set)."""
        return self._resolve_segments()[0]

    @property
    def tight_handle_size(self) -> int:
        """Bytes of the physical handles the tight policy (and auto near its limits) makes:
        0 for one page of the device's granularity, else ``expandable_handle_size``."""
        return self._resolve_segments()[1]

    def _normalise_sizes(self) -> None:
        """Size strings ("4GiB") and integer-like numbers (numpy) to ints, in place (the
        dataclass is frozen, hence object.__setattr__); the checks below then see ints."""
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                value = (parse_handle_size(value) if name == "expandable_handle_size"
                         else parse_size(value, what=name))
            elif (not isinstance(value, (bool, int)) and value is not None
                  and hasattr(value, "__index__")):
                value = int(value.__index__())
            else:
                continue
            object.__setattr__(self, name, value)

    def _check_shared(self) -> None:
        """shared_group, shared_budget (a size string becomes bytes), shared_hand_back."""
        group, budget = self.shared_group, self.shared_budget
        if group is not None and (not isinstance(group, str)
                                  or not SHARED_GROUP_NAME.fullmatch(group)):
            raise InvalidInputError(
                f"shared_group must be None or 1 to 64 characters of letters, digits, '_', '.' "
                f"or '-' (not starting with '.' or '-'), got {group!r}")
        if not isinstance(self.shared_hand_back, bool):
            raise InvalidInputError(f"shared_hand_back must be a bool, got "
                                    f"{self.shared_hand_back!r}")
        if budget is None:
            return
        if group is None:
            raise InvalidInputError(f"shared_budget={budget!r} needs a shared_group (the "
                                    f"processes that share it)")
        if isinstance(budget, str):
            budget = parse_shared_budget(budget)
            object.__setattr__(self, "shared_budget", budget)
        if isinstance(budget, float):
            if not math.isfinite(budget) or not 0.0 < budget <= 1.0:
                raise InvalidInputError(f"shared_budget as a fraction of the device must be in "
                                        f"(0, 1], got {budget!r}")
            return
        self._check_int("shared_budget", budget)
        if budget == 0:
            raise InvalidInputError("shared_budget must be > 0 bytes (or a fraction in (0, 1])")

    @staticmethod
    def _check_int(name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInputError(
                f"{name} must be an int number of bytes or a size string such as '512MiB', "
                f"got {type(value).__name__} {value!r}")
        if value < 0:
            raise InvalidInputError(f"{name} must be >= 0, got {value}")
        if value > MAX_BYTES:
            raise InvalidInputError(
                f"{name} must be <= 2**62 (4 EiB), got {value}")

    # --- limits: soft or hard ---------------------------------------------------------------
    @property
    def user_limits(self) -> frozenset[str]:
        """The :data:`LIMIT_FIELDS` the user set: hard limits. The others are soft (at their
        defaults, or set through :meth:`with_soft_limits`)."""
        return self.__dict__.get("_user_limits", frozenset())

    def is_hard(self, name: str) -> bool:
        """Whether limit ``name`` (one of :data:`LIMIT_FIELDS`) refuses requests: True when the
        user set it. ``reserve_bytes`` and ``max_pool_size`` left at None limit nothing."""
        if name not in LIMIT_FIELDS:
            raise InvalidInputError(f"{name!r} is not a limit; the limits are "
                                    f"{', '.join(LIMIT_FIELDS)}")
        return name in self.user_limits and getattr(self, name) is not None

    def limit_kinds(self) -> dict[str, str]:
        """``{field: "hard" | "soft" | "off"}`` for each of :data:`LIMIT_FIELDS` ("off":
        ``reserve_bytes`` left to the backend's advice is soft; ``max_pool_size=None`` caps
        nothing)."""
        kinds = {}
        for name in LIMIT_FIELDS:
            if name == "max_pool_size" and self.max_pool_size is None:
                kinds[name] = "off"
            else:
                kinds[name] = "hard" if self.is_hard(name) else "soft"
        return kinds

    def describe_limits(self) -> str:
        """One line for ``gpumem info`` and summaries: each limit, its value and its kind."""
        from gpumem.units import format_bytes
        parts = []
        for name, kind in self.limit_kinds().items():
            value = getattr(self, name)
            if name == "reserve_bytes" and value is None:
                text = "backend's advice"
            elif value is None:
                text = "none"
            elif name == "gpu_memory_fraction":
                text = str(value)
            else:
                text = format_bytes(value)
            parts.append(f"{name}={text} ({kind})")
        return ", ".join(parts)

    def with_soft_limits(self, **values: Any) -> "MemoryConfig":
        """A copy whose named limits (of :data:`LIMIT_FIELDS`) take these values as *soft*
        limits: they bound the cache and set the pressure scale but never refuse a request the
        device can serve, e.g. ``MemoryConfig().with_soft_limits(gpu_memory_fraction=0.8)``."""
        wrong = sorted(set(values) - set(LIMIT_FIELDS))
        if wrong:
            raise InvalidInputError(f"with_soft_limits takes limits only ({', '.join(LIMIT_FIELDS)}); "
                                    f"got {wrong}")
        new = self.replace(**values)
        object.__setattr__(new, "_user_limits", self.user_limits - set(values))
        return new

    # --- presets ----------------------------------------------------------------------------
    @classmethod
    def default(cls) -> "MemoryConfig":
        """Balanced settings; caps nothing: 90 % of the device and 512 MiB kept free as soft
        limits (the cache is trimmed to them; requests the device can serve are served), CPU
        fallback on."""
        return cls()

    @classmethod
    def for_inference(cls) -> "MemoryConfig":
        """Long-running serving; caps the cache, not the data: a cache of at most 2 GiB
        (max_pool_size), 95 % of the device and 256 MiB kept free as soft limits, no fallback
        (a server should fail fast rather than run slowly on the CPU)."""
        return cls(cpu_fallback_enabled=False, max_pool_size=2 * GiB).with_soft_limits(
            gpu_memory_fraction=0.95, min_free_bytes=256 * MiB)

    @classmethod
    def for_constrained(cls) -> "MemoryConfig":
        """Small or shared devices; caps: at most 70 % of the device and 128 MiB left free
        (hard limits), a cache of at most 256 MiB, released early."""
        return cls(gpu_memory_fraction=0.7, min_free_bytes=128 * MiB,
                   max_pool_size=256 * MiB, max_pooled_per_bucket=2,
                   large_segment=10 * MiB, max_split_size=64 * MiB,
                   pressure_thresholds=(0.5, 0.7, 0.9))

    # --- builder ------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> "MemoryConfig":
        """A copy with some fields changed (validated); unknown field names are an error."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise InvalidInputError(
                f"unknown MemoryConfig field(s) {unknown}; fields are {sorted(names)}")
        new = dataclasses.replace(self, **changes)
        # the limits set here become hard; the others keep their kind (dataclasses.replace
        # passes every field to __init__, which would mark them all)
        object.__setattr__(new, "_user_limits",
                           self.user_limits | set(changes).intersection(LIMIT_FIELDS))
        return new

    def with_gpu_memory_fraction(self, fraction: float) -> "MemoryConfig":
        """A copy using this fraction of the device (0, 1]."""
        return self.replace(gpu_memory_fraction=fraction)

    def with_cpu_fallback(self, enabled: bool) -> "MemoryConfig":
        """A copy with CPU fallback on or off."""
        return self.replace(cpu_fallback_enabled=enabled)

    def with_min_free_bytes(self, nbytes: int | str) -> "MemoryConfig":
        """A copy that leaves at least `nbytes` (int or "512MiB") free on the device."""
        return self.replace(min_free_bytes=parse_size(nbytes, what="min_free_bytes"))

    def with_tracking(self, enabled: bool = True, *, stacks: bool = False) -> "MemoryConfig":
        """A copy with allocation tracking on or off (`stacks`: keep creation stacks)."""
        return self.replace(track_allocations=enabled, track_stacks=stacks)

    def with_max_pool_size(self, nbytes: int | str | None) -> "MemoryConfig":
        """A copy that caps cached bytes at `nbytes` (int, "1GiB" or None: no cap)."""
        return self.replace(max_pool_size=None if nbytes is None
                            else parse_size(nbytes, what="max_pool_size"))

    def with_max_split_size(self, nbytes: int | str | None) -> "MemoryConfig":
        """A copy whose cached blocks above `nbytes` are never split (None: all split)."""
        return self.replace(max_split_size=None if nbytes is None
                            else parse_size(nbytes, what="max_split_size"))

    def with_max_pooled_per_bucket(self, count: int) -> "MemoryConfig":
        """A copy keeping at most `count` wholly free large segments per size class."""
        return self.replace(max_pooled_per_bucket=count)

    def with_reserve_bytes(self, nbytes: int | str | None) -> "MemoryConfig":
        """A copy reserving `nbytes` of the device for others (None: the backend's advice)."""
        return self.replace(reserve_bytes=None if nbytes is None
                            else parse_size(nbytes, what="reserve_bytes"))

    def with_pressure_thresholds(self, medium: float, high: float,
                                 critical: float) -> "MemoryConfig":
        """A copy with the fractions of usable memory where MEDIUM, HIGH, CRITICAL begin."""
        return self.replace(pressure_thresholds=(medium, high, critical))

    # --- from PyTorch -------------------------------------------------------------------------
    @classmethod
    def from_torch_conf(cls, conf: str, base: "MemoryConfig | None" = None, *,
                        warn: bool = True) -> "MemoryConfig":
        """The settings of a ``PYTORCH_CUDA_ALLOC_CONF`` value (``"expandable_segments:True,
        max_split_size_mb:128"``) over ``base`` (default ``MemoryConfig()``): each key with a
        gpumem equivalent becomes its field (``expandable_segments``, ``max_split_size_mb``
        -> ``max_split_size``, ``max_non_split_rounding_mb`` -> ``oversize_slack``;
        ``backend:native`` sets nothing). The keys without one are named, with why, in one
        :class:`gpumem.errors.GpumemWarning` (``warn=False``: silent;
        :func:`gpumem.planning.from_torch.torch_conf_changes` returns them). A value PyTorch
        would refuse is an InvalidInputError naming the key."""
        from gpumem.planning.from_torch import torch_conf_changes   # planning: the parser
        changes, unmapped = torch_conf_changes(conf)
        if unmapped and warn:
            from gpumem.errors import GpumemWarning
            warnings.warn(
                "PYTORCH_CUDA_ALLOC_CONF keys without a gpumem equivalent, not applied: "
                + "; ".join(f"{k} ({why})" for k, why in unmapped.items()),
                GpumemWarning, stacklevel=2)
        return (base if base is not None else cls()).replace(**changes)

    # --- environment --------------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 base: "MemoryConfig | None" = None) -> "MemoryConfig":
        """Read ``GPUMEM_<FIELD>`` variables (e.g. ``GPUMEM_GPU_MEMORY_FRACTION=0.8``,
        ``GPUMEM_MIN_FREE_BYTES=1GiB``, ``GPUMEM_CPU_FALLBACK_ENABLED=0``) over `base`."""
        env = os.environ if environ is None else environ
        base = base if base is not None else cls()
        _warn_unknown_variables(env)
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = "GPUMEM_" + f.name.upper()
            if key not in env:
                continue
            raw = env[key].strip()
            current = getattr(base, f.name)
            try:
                changes[f.name] = _parse_env_value(f.name, raw, current)
            except InvalidInputError as exc:
                raise InvalidInputError(f"{key}={env[key]!r}: {exc}") from None
        if "GPUMEM_DEBUG" in env and "GPUMEM_TRACK_ALLOCATIONS" not in env:
            changes["track_allocations"] = env["GPUMEM_DEBUG"] not in ("", "0", "false", "False")
        try:
            return base.replace(**changes)
        except InvalidInputError as exc:
            # name the variable: the user may never have built a MemoryConfig themselves
            # the variables invalid on their own; else (a contradiction) all that were set
            culprits = ([n for n in changes if not _valid_alone(base, n, changes[n])]
                        or [n for n in changes if "GPUMEM_" + n.upper() in env])
            names = ", ".join(f"GPUMEM_{n.upper()}={env.get('GPUMEM_' + n.upper(), '')!r}"
                              for n in culprits) or "GPUMEM_* variables"
            raise InvalidInputError(f"{names}: {exc}") from None


_dataclass_init = MemoryConfig.__init__
_INIT_ORDER = tuple(f.name for f in dataclasses.fields(MemoryConfig) if f.init)


@functools.wraps(_dataclass_init)
def _init_noting_limits(self: MemoryConfig, *args: Any, **kwargs: Any) -> None:
    # which limits the caller passed (a value equal to the default included: it is still the
    # user's): those are hard. Kept beside the fields, not as one: equality, the environment
    # and reconfigure() see the values only
    given = set(kwargs).union(_INIT_ORDER[:len(args)])
    object.__setattr__(self, "_user_limits", frozenset(given.intersection(LIMIT_FIELDS)))
    _dataclass_init(self, *args, **kwargs)


MemoryConfig.__init__ = _init_noting_limits  # type: ignore[method-assign]


def env_settings(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{field: "GPUMEM_<FIELD>=value"}`` for each MemoryConfig field the environment sets,
    a size with the reading taken (``GPUMEM_MIN_FREE_BYTES=1G (1.00 GB = 953.67 MiB)``): what
    ``gpumem info`` and ``gpumem replay`` show. Values that do not parse are shown as they
    are (from_env names them)."""
    from gpumem.units import describe_size
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for f in dataclasses.fields(MemoryConfig):
        key = "GPUMEM_" + f.name.upper()
        if key not in env:
            continue
        text = f"{key}={env[key]}"
        if f.name in SIZE_FIELDS or f.name == "shared_budget":
            try:
                value = _parse_env_value(f.name, env[key].strip(), None)
            except InvalidInputError:
                value = None
            if isinstance(value, int) and not isinstance(value, bool):
                text += f" ({describe_size(value)})"
        out[f.name] = text
    return out


def _warn_unknown_variables(env: Mapping[str, str]) -> None:
    """An UnknownSettingWarning for each GPUMEM_* name that nothing in gpumem reads, listing
    the settings a user may set (not the project's CI knobs)."""
    user = USER_VARIABLES | {"GPUMEM_" + f.name.upper() for f in dataclasses.fields(MemoryConfig)}
    known = user | INTERNAL_VARIABLES
    for key in sorted(k for k in env if k.startswith("GPUMEM_") and k not in known):
        close = difflib.get_close_matches(key, user, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        warnings.warn(f"gpumem: unknown environment variable {key}{hint}; the settings are: "
                      f"{', '.join(sorted(user))}", UnknownSettingWarning, stacklevel=3)


def _valid_alone(base: MemoryConfig, name: str, value: Any) -> bool:
    try:
        base.replace(**{name: value})
    except InvalidInputError:
        return False
    return True


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}
_FLOAT_FIELDS = {"gpu_memory_fraction", "high_cache_fraction"}
_COUNT_FIELDS = {"max_pooled_per_bucket"}
_OPTIONAL_BOOL_FIELDS = {"expandable_segments"}


def _parse_env_value(name: str, raw: str, current: Any) -> Any:
    if isinstance(current, bool) or name in _OPTIONAL_BOOL_FIELDS:
        if raw.lower() not in _BOOLS:
            raise InvalidInputError("expected a boolean (1/0, true/false, yes/no, on/off)")
        return _BOOLS[raw.lower()]
    if name in _FLOAT_FIELDS:
        try:
            return float(raw)
        except ValueError:
            raise InvalidInputError("expected a number") from None
    if name == "pressure_thresholds":
        try:
            parts = tuple(float(x) for x in raw.split(","))
        except ValueError:
            raise InvalidInputError("expected three comma-separated fractions") from None
        return parts
    if name in _COUNT_FIELDS:
        # ASCII digits: str.isdigit() also takes '²', which int() refuses
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 20:
            raise InvalidInputError("expected a non-negative integer (at most 20 digits)")
        return int(raw)
    if name == "expandable_handle_size":
        return parse_handle_size(raw)
    if name == "segments":
        return raw.lower()
    if name == "shared_group":
        return None if raw.lower() in ("none", "") else raw
    if name == "shared_budget":
        return None if raw.lower() in ("none", "") else parse_shared_budget(raw)
    if raw.lower() in ("none", ""):
        return None
    return parse_size(raw, what=name)
