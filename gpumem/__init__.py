"""gpumem: a caching GPU memory allocator with a Cython core.

>>> import gpumem
>>> mm = gpumem.MemoryManager("sim:0")   # gpumem.get_manager(): the default device's shared one
>>> buf = mm.malloc(1 << 20)
>>> buf.free()
"""
import logging as _logging

from gpumem._core.buffer import Buffer
from gpumem._core.pool import CachingPool
from gpumem.backends import default_device, devices
from gpumem.buffer_protocol import AnyBuffer
from gpumem.config import MemoryConfig
from gpumem.errors import (BackendUnavailableError, BufferInUseError, ClosedManagerError,
                           CpuFallbackWarning, DoubleFreeError, DriverError, DriverOutOfMemory,
                           ForeignBufferError, GpuMemoryError, GpumemWarning, InvalidDeviceError,
                           InvalidInputError, OutOfMemoryError, SharedLedgerError,
                           TraceFormatError, UnknownSettingWarning, UnsupportedOperationError)
from gpumem.manager.batch import BufferBatch, allocate_batch, warmup
from gpumem.planning.estimate import (MODEL_PRESETS, MemoryEstimate, estimate_inference_memory,
                             estimate_model)
from gpumem.manager.fallback import FallbackBuffer
from gpumem.manager.memory_manager import MemoryManager
from gpumem.placement.multi import MultiDeviceManager
from gpumem.manager.pressure import MemoryPressure
from gpumem.placement.selection import select_backend_for_model
from gpumem.placement.shared import configure, get_manager
from gpumem.stats import MemoryStats
from gpumem.units import format_bytes, parse_size

__version__ = "0.1.0"

# A library logs, the application decides where to: without this, Python's last-resort handler
# would print every WARNING (OOMs, fallbacks) to stderr.
_logging.getLogger("gpumem").addHandler(_logging.NullHandler())

__all__ = [
    "get_manager", "configure",
    "AnyBuffer", "Buffer", "CachingPool", "MemoryManager", "MemoryConfig", "MemoryStats",
    "MemoryPressure",
    "FallbackBuffer", "BufferBatch", "MultiDeviceManager", "allocate_batch", "warmup",
    "estimate_inference_memory", "estimate_model", "MemoryEstimate", "MODEL_PRESETS",
    "select_backend_for_model", "devices", "default_device", "format_bytes", "parse_size",
    "GpuMemoryError", "OutOfMemoryError", "InvalidInputError", "InvalidDeviceError",
    "DoubleFreeError", "ForeignBufferError", "BufferInUseError", "ClosedManagerError",
    "BackendUnavailableError",
    "DriverError", "DriverOutOfMemory", "TraceFormatError", "UnsupportedOperationError",
    "SharedLedgerError",
    "GpumemWarning", "CpuFallbackWarning", "UnknownSettingWarning",
]

# --- seeing memory: loaded on first use, so "import gpumem" stays light (no csv, gzip, plots)
_LAZY = {
    "replay": ("gpumem.observe.replay", None),          # the module, callable: gpumem.replay(trace, ...)
    "ReplayResult": ("gpumem.observe.replay", "ReplayResult"),
    "read_trace": ("gpumem.observe.trace", "read_trace"),
    "write_trace": ("gpumem.observe.trace", "write_trace"),
    "TraceData": ("gpumem.observe.trace", "TraceData"),
    "take_snapshot": ("gpumem.observe.snapshot", "take_snapshot"),
    "save_snapshot": ("gpumem.observe.snapshot", "save_snapshot"),
    "load_snapshot": ("gpumem.observe.snapshot", "load_snapshot"),
    "AllocationTracker": ("gpumem.observe.tracking", "AllocationTracker"),
    "BufferMetadata": ("gpumem.observe.tracking", "BufferMetadata"),
    "HistoryRecorder": ("gpumem.observe.history", "HistoryRecorder"),
    "Measurement": ("gpumem.manager.measure", "Measurement"),
    "MeasuredStats": ("gpumem.manager.measure", "MeasuredStats"),
    "read_torch_snapshot": ("gpumem.observe.torch_snapshot", "read_torch_snapshot"),
    "export_memory_viz": ("gpumem.observe.torch_snapshot", "export_memory_viz"),
    "estimate_training_memory": ("gpumem.planning.estimate_training", "estimate_training_memory"),
    "TrainingEstimate": ("gpumem.planning.estimate_training", "TrainingEstimate"),
    "TorchAllocatorModel": ("gpumem.planning.torch_model", "TorchAllocatorModel"),
    "replay_torch_model": ("gpumem.planning.torch_replay", "replay_torch_model"),
    "TorchReplayResult": ("gpumem.planning.torch_replay", "TorchReplayResult"),
    "tune": ("gpumem.planning.tune", "tune"),
    "TuneResult": ("gpumem.planning.tune", "TuneResult"),
    "dump_on_oom": ("gpumem.observe.history", "dump_on_oom"),
    "pool_trace": ("gpumem.observe.history", "pool_trace"),
}


def __getattr__(name: str):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'gpumem' has no attribute {name!r}") from None
    import importlib
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ += list(_LAZY)
