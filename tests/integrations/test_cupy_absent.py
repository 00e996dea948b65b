"""gpumem's CuPy bridge where CuPy is absent (real: no device, no CuPy needed).

The bridge's C extension (gpumem/integrations/_cupy_alloc.pyx) knows no CuPy type at compile
time: gpumem builds and imports without CuPy, and only making an allocator needs it. Runs in a
child interpreter in which ``import cupy`` fails, whether or not CuPy is installed.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import sys
    sys.modules["cupy"] = None                    # `import cupy` raises ImportError
    from gpumem.integrations import cupy as gm_cupy
    from gpumem.integrations.cupy import *        # every name in __all__ is there
    from gpumem.integrations._cupy_alloc import CupyAllocatorCore
    try:
        gm_cupy.allocator()
    except ImportError as exc:
        assert "cupy" in str(exc), exc
    else:
        raise AssertionError("allocator() without CuPy did not raise ImportError")
    try:
        CupyAllocatorCore()(10)
    except TypeError as exc:
        assert "gpumem.integrations.cupy.allocator()" in str(exc), exc
    else:
        raise AssertionError("an unconfigured CupyAllocatorCore served a request")
    print("ok")
""")


def test_the_cupy_bridge_imports_without_cupy():
    """Without CuPy the bridge and its extension import (``import *`` too); making an
    allocator raises
    ImportError naming cupy, and the extension's core, not configured by the bridge, refuses
    a request with a TypeError naming the function to use instead of crashing."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
