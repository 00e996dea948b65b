"""MemoryManager at Python level on a big simulated device: the hit pair and a mixed workload,
with allocation tracking off and on, and with history recording off and on."""
from . import OPS_PER_CALL, KiB, MiB, MixedWorkload, sim_manager


class HitPair:
    """``free(malloc(n))`` for a size the cache holds, OPS_PER_CALL (1000) times per call:
    asv's time / 1000 is the time of one pair, the figure compare.py reports."""

    params = [[512, 4 * KiB, 1 * MiB, 8 * MiB], [False, True]]
    param_names = ["nbytes", "tracking"]

    def setup(self, nbytes, tracking):
        self.mm = sim_manager(track=tracking)
        self.mm.free(self.mm.malloc(nbytes))

    def teardown(self, nbytes, tracking):
        self.mm.close()

    def time_1000_pairs(self, nbytes, tracking):
        malloc, free = self.mm.malloc, self.mm.free
        for _ in range(OPS_PER_CALL):
            free(malloc(nbytes))

    def time_1000_pairs_with_block(self, nbytes, tracking):
        malloc = self.mm.malloc
        for _ in range(OPS_PER_CALL):
            with malloc(nbytes):
                pass

    def time_1000_tagged_pairs(self, nbytes, tracking):
        """Tagged buffers: with tracking on, the one per-buffer cost left (a dict store)."""
        malloc, free = self.mm.malloc, self.mm.free
        for _ in range(OPS_PER_CALL):
            free(malloc(nbytes, tag="t"))


class Recording:
    """The hit pair while ``record_history()`` runs or not (it reads the pool's C history:
    target <= 1.1x the pair), untagged and tagged."""

    params = [[4 * KiB, 1 * MiB], [False, True]]
    param_names = ["nbytes", "recording"]

    def setup(self, nbytes, recording):
        self.mm = sim_manager(track=False)
        self.rec = self.mm.record_history() if recording else None
        self.mm.free(self.mm.malloc(nbytes))

    def teardown(self, nbytes, recording):
        if self.rec is not None:
            self.rec.stop()
        self.mm.close()

    def time_1000_pairs(self, nbytes, recording):
        malloc, free = self.mm.malloc, self.mm.free
        for _ in range(OPS_PER_CALL):
            free(malloc(nbytes))

    def time_1000_tagged_pairs(self, nbytes, recording):
        malloc, free = self.mm.malloc, self.mm.free
        for _ in range(OPS_PER_CALL):
            free(malloc(nbytes, tag="t"))


class LoopFloor:
    """The same loop with two trivial calls (compare.py's "python loop + 2 calls" row): the
    Python-level floor under every 1000-pair figure, measured in the same run."""

    def time_1000_loop_and_2_calls(self):
        f1 = f2 = abs
        for _ in range(OPS_PER_CALL):
            f2(f1(4096))


class CythonFloor:
    """compare.py's "floor: Cython, no pool" row: ``free(malloc(4096))`` on _cbench's
    FloorManager, which builds and drops a Buffer-shaped Cython object through the same calling
    convention with no pool, lock or history behind it; what is left of HitPair above it is
    gpumem's own work. Skipped where _cbench cannot be built."""

    def setup(self):
        from . import load_cbench
        self.floor = load_cbench().FloorManager()

    def time_1000_pairs(self):
        malloc, free = self.floor.malloc, self.floor.free
        for _ in range(OPS_PER_CALL):
            free(malloc(4096))


class Mixed:
    """10,000 live buffers of log-uniform random sizes 1 KiB..4 MiB; each step frees a random
    one and allocates a new random size (1000 steps per call, after a 20,000-step warmup)."""

    params = [[False, True]]
    param_names = ["tracking"]
    timeout = 180

    def setup(self, tracking):
        self.mm = sim_manager(track=tracking)
        self.work = MixedWorkload(live=10_000, lo=1 * KiB, hi=4 * MiB)
        self.handles = self.work.start(self.mm.malloc)
        self.run = self.work.runner(self.mm.malloc, self.mm.free, self.handles)
        self.run(20_000)

    def teardown(self, tracking):
        self.handles.clear()
        self.mm.close()

    def time_steps_1000(self, tracking):
        self.run(1000)

    def track_reserved_over_live(self, tracking):
        c = self.mm.pool.counters()
        return c["reserved_bytes"] / max(1, c["requested_bytes"])

    track_reserved_over_live.unit = "ratio"


class CrossStream:
    """A buffer also used on a second stream (``record_stream``): free records an event there,
    and the next malloc collects the block once the event is done (sim: at once, no work)."""

    def setup(self):
        self.mm = sim_manager(track=False)
        self.stream = self.mm.device.create_stream()
        self.mm.free(self.mm.malloc(4 * KiB))

    def teardown(self):
        self.mm.close()

    def time_malloc_record_free(self):
        buf = self.mm.malloc(4 * KiB)
        buf.record_stream(self.stream)
        buf.free()
