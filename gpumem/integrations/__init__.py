"""Bridges between gpumem and array frameworks, one module per framework.

Each module imports its framework lazily (inside the functions that need it), so importing
``gpumem`` or this package never imports pyopencl, cupy, numba or torch. Import the module you
need, e.g. ``from gpumem.integrations import pyopencl as gm_cl``.
"""
