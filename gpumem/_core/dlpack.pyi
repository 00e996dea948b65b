from typing import Any

DLPACK_VERSION: tuple[int, int]
FLAG_READ_ONLY: int

def make_capsule(owner: Any, data: int, device_type: int, device_id: int,
                 shape: tuple[int, ...], strides: tuple[int, ...], code: int, bits: int,
                 readonly: bool, versioned: bool) -> Any: ...
