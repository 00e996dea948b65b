"""Zero-copy views on host memory (the cpu backend): building a typed view, and handing a
buffer to numpy through ``__array_interface__`` and through DLPack. The peer is numpy's own
``from_dlpack`` of an ndarray of the same size, in the same run."""
import numpy as np

import gpumem

from . import KiB


class Views:
    params = [[4 * KiB, 1 << 20]]
    param_names = ["nbytes"]

    def setup(self, nbytes):
        self.mm = gpumem.MemoryManager("cpu")
        self.buf = self.mm.malloc(nbytes)
        self.peer = np.zeros(nbytes, dtype=np.uint8)

    def teardown(self, nbytes):
        self.buf = None
        self.mm.close()

    def time_view(self, nbytes):
        self.buf.view("float32", (nbytes // 64, 16))

    def time_asarray_view(self, nbytes):
        np.asarray(self.buf.view("float32"))

    def time_asarray_buffer(self, nbytes):
        np.asarray(self.buf)

    def time_from_dlpack_buffer(self, nbytes):
        np.from_dlpack(self.buf)

    def time_from_dlpack_numpy_peer(self, nbytes):
        np.from_dlpack(self.peer)
