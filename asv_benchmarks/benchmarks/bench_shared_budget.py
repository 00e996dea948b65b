"""A memory budget shared across processes (docs/shared_budget.md): the hit pair of a manager
that joined a group against one that did not (target: <= 1.02x). The hit path never touches
the ledger; the miss path, releases and the watcher do (asv_benchmarks/shared_budget.py times
the release requests across processes)."""
from . import KiB


class SharedBudgetHitPair:
    params = [False, True]
    param_names = ["joined"]

    def setup(self, joined):
        import os
        import tempfile

        from gpumem import MemoryConfig, MemoryManager
        self._env = os.environ.get("GPUMEM_SHARED_DIR")
        self._folder = tempfile.mkdtemp(prefix="gmab", dir="/tmp")
        os.environ["GPUMEM_SHARED_DIR"] = self._folder
        config = MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0,
                              cpu_fallback_enabled=False, track_allocations=False)
        if joined:
            config = config.replace(shared_group="asv", shared_budget=1.0)
        self.mm = MemoryManager("sim:4GiB", config)
        self.mm.free(self.mm.malloc(4 * KiB))       # the segment: hits from now on

    def teardown(self, joined):
        import os
        import shutil
        self.mm.close()
        shutil.rmtree(self._folder, ignore_errors=True)
        if self._env is None:
            os.environ.pop("GPUMEM_SHARED_DIR", None)
        else:
            os.environ["GPUMEM_SHARED_DIR"] = self._env

    def time_hit_pair(self, joined):
        """One 4 KiB malloc + free from the cache."""
        self.mm.free(self.mm.malloc(4 * KiB))
