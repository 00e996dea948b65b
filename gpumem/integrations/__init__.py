"""Integrations with array frameworks (numpy & DLPack views, pyopencl, CuPy, Numba, PyTorch).

Each submodule imports its framework lazily, inside its functions: importing
``gpumem.integrations`` (or ``gpumem``) never imports a framework.
"""
