import enum
from typing import Any

import numpy as np

from gpumem._core.buffer import Buffer

MAX_NDIM: int

class DLDeviceType(enum.IntEnum):
    kDLCPU = 1
    kDLCUDA = 2
    kDLCUDAHost = 3

def dlpack_device(buffer: Buffer) -> tuple[DLDeviceType, int]: ...

class BufferView:
    buffer: Buffer
    dtype: np.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    readonly: bool
    c_contiguous: bool
    nbytes: int
    @property
    def ptr(self) -> int: ...
    @property
    def ndim(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def __array_interface__(self) -> dict: ...
    @property
    def __cuda_array_interface__(self) -> dict: ...
    def __dlpack__(self, *, stream: Any = ..., max_version: tuple[int, int] | None = ...,
                   dl_device: tuple[int, int] | None = ..., copy: bool | None = ...) -> Any: ...
    def __dlpack_device__(self) -> tuple[DLDeviceType, int]: ...
    def __len__(self) -> int: ...
