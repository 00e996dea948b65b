"""The caching pool's hit path, at C level (through the public .pxd API) and Python level.

C level: ``_cbench`` (compiled in setup, see build_cbench.py) runs N gm_alloc+gm_free pairs in a
nogil loop, timed with clock_gettime (the O(1) cases call the GIL-holding variants instead, which
free into the heaps: the pool's lookup, not a front cache, serves each pair); when it cannot be
built the "c" parameters are skipped (NotImplementedError) and the "python" ones still run. Targets: a C-level pair <= 40 ns; the
pair with 1,000,000 cached free blocks of varied sizes <= 1.5x the pair with 10.
"""
import math
import random
import statistics

from . import KiB, MiB, load_cbench, sim_manager

PAIRS = 200_000          # pairs per C-level measurement
REPEATS = 7              # measurements per track_ value (median)

# request sizes cycled by the "mixed" O(1) case: 64 log-uniform sizes in [512 B, 16 MiB]
_rng = random.Random(7)
MIXED_SIZES = [int(math.exp(_rng.uniform(math.log(512), math.log(16 * MiB)))) for _ in range(64)]


class HitPair:
    """One alloc+free pair of a cached size (the pool holds one fitting segment)."""

    params = [["c", "python"], [512, 4 * KiB, 1 * MiB, 4 * MiB]]
    param_names = ["level", "nbytes"]

    def setup(self, level, nbytes):
        if level == "c":
            cb = load_cbench()
            self.bp = cb.BlockPool()
            self.bp.ensure_hits([nbytes])
            self.bp.hit_pair_ns([nbytes], 10_000)            # warm
        else:
            self.mm = sim_manager()
            self.mm.free(self.mm.malloc(nbytes))             # one segment: later pairs hit

    def teardown(self, level, nbytes):
        if level == "python":
            self.mm.close()

    def time_pairs_1000(self, level, nbytes):
        """1000 pairs per call: asv's figure / 1000 is the time of one pair."""
        if level == "c":
            self.bp.hit_pair_ns([nbytes], 1000)
        else:
            malloc, free = self.mm.malloc, self.mm.free
            for _ in range(1000):
                free(malloc(nbytes))

    def track_ns_per_pair(self, level, nbytes):
        """Median ns per pair over REPEATS measurements (C: PAIRS pairs in one nogil loop)."""
        if level == "c":
            return statistics.median(self.bp.hit_pair_ns([nbytes], PAIRS)
                                     for _ in range(REPEATS))
        import time
        malloc, free = self.mm.malloc, self.mm.free
        out = []
        for _ in range(REPEATS):
            t0 = time.perf_counter_ns()
            for _ in range(20_000):
                free(malloc(nbytes))
            out.append((time.perf_counter_ns() - t0) / 20_000)
        return statistics.median(out)

    track_ns_per_pair.unit = "ns"


def _populated(cb, nfree, lo=512):
    """A BlockPool caching `nfree` free blocks (log-uniform sizes lo..16 MiB, each between
    live neighbours), warmed so every MIXED_SIZES / 4 KiB request hits."""
    bp = cb.BlockPool()
    bp.populate(max(4 * nfree, 40) if nfree < 1000 else int(2.4 * nfree), lo=lo,
                target_free=nfree)
    bp.ensure_hits(MIXED_SIZES + [4 * KiB])
    return bp


class HitScaling:
    """The hit pair against a pool caching 10 or 1,000,000 free blocks of varied sizes."""

    params = [[10, 1_000_000], ["4KiB", "mixed64"]]
    param_names = ["cached_free_blocks", "sizes"]
    timeout = 300

    def setup(self, nfree, sizes):
        cb = load_cbench()
        self.bp = _populated(cb, nfree)
        self.sizes = [4 * KiB] if sizes == "4KiB" else MIXED_SIZES
        self.bp.hit_pair_ns(self.sizes, 10_000, front=False)

    def track_ns_per_pair(self, nfree, sizes):
        return statistics.median(self.bp.hit_pair_ns(self.sizes, PAIRS, front=False)
                                 for _ in range(REPEATS))

    track_ns_per_pair.unit = "ns"

    def track_free_blocks(self, nfree, sizes):
        return self.bp.free_blocks

    track_free_blocks.unit = "blocks"


class HitScalingRatio:
    """O(1) check in one run: median pair time with 1,000,000 cached free blocks over the
    median with 10 (measurements interleaved). Target <= 1.5."""

    params = [["4KiB", "mixed64"]]
    param_names = ["sizes"]
    timeout = 300

    def setup(self, sizes):
        cb = load_cbench()
        self.small = _populated(cb, 10)
        self.big = _populated(cb, 1_000_000)
        self.sizes = [4 * KiB] if sizes == "4KiB" else MIXED_SIZES

    def track_ratio_1m_over_10(self, sizes):
        small, big = [], []
        for _ in range(REPEATS):
            small.append(self.small.hit_pair_ns(self.sizes, PAIRS, front=False))
            big.append(self.big.hit_pair_ns(self.sizes, PAIRS, front=False))
        return statistics.median(big) / statistics.median(small)

    track_ratio_1m_over_10.unit = "ratio"


THREAD_CASES = {"1 thread": [0], "2 threads, 1 stream": [0, 0], "2 threads, 2 streams": [0, 1],
                "2 threads, 2 pools (ceiling)": [0, 0]}
#: the ceiling case: each thread on a pool of its own, so the threads share nothing at all; its
#: speedup is what the machine allows at that moment (another process on a core caps it)
CEILING = "2 threads, 2 pools (ceiling)"


def thread_scaling(cb, nbytes: int = 4 * KiB, pairs: int = 300_000, repeats: int = REPEATS,
                   cpu: bool = False) -> dict:
    """Hit-pair throughput (pairs/us) of native threads calling gm_alloc/gm_free without the
    GIL, for each case of THREAD_CASES, measured interleaved (1, 2, 2, 1, 2, 2, ...) on one pool
    per case. Returns {case: [pairs/us per repeat]}. cpu=True divides by the largest thread CPU
    time instead of the wall time (see _cbench.threaded_pairs_per_us)."""
    pools = {}
    for case, streams in THREAD_CASES.items():
        bps = [cb.BlockPool() for _ in (streams if case == CEILING else [0])]
        for bp in bps:
            for s in sorted(set(streams)):
                bp.ensure_hits([nbytes], s)
        pools[case] = bps

    def run(case, n):
        bps = pools[case]
        return cb.threaded_pairs_per_us(bps[0].pool, nbytes, n, THREAD_CASES[case], cpu,
                                        [bp.pool for bp in bps] if case == CEILING else None)

    for case in THREAD_CASES:
        run(case, pairs // 10)                                             # warm
    out = {case: [] for case in THREAD_CASES}
    for _ in range(repeats):
        for case in THREAD_CASES:
            out[case].append(run(case, pairs))
    return out


class ThreadScaling:
    """Throughput of 2 native threads doing nogil hit pairs over that of 1 thread, same run
    (interleaved repeats): target >= 1.6 on one stream and on two. "wall": pairs over the wall
    time; "cpu": over the largest thread CPU time (on a loaded machine the wall time also
    counts waiting for a core, which no allocator can help)."""

    params = [["2 threads, 1 stream", "2 threads, 2 streams", CEILING], ["wall", "cpu"]]
    param_names = ["case", "clock"]
    timeout = 300

    def setup(self, case, clock):
        self.cb = load_cbench()

    def track_speedup_over_1_thread(self, case, clock):
        r = thread_scaling(self.cb, cpu=clock == "cpu")
        return statistics.median(r[case]) / statistics.median(r["1 thread"])

    track_speedup_over_1_thread.unit = "ratio"


class HistoryCost:
    """The always-on C history: C-level hit pair with it on (the default) over the same pair
    with pool.set_history(0), interleaved in one run. Target <= 1.1."""

    params = [[4 * KiB, 4 * MiB]]
    param_names = ["nbytes"]

    def setup(self, nbytes):
        cb = load_cbench()
        self.on, self.off = cb.BlockPool(), cb.BlockPool()
        self.off.pool.set_history(0)
        for bp in (self.on, self.off):
            bp.ensure_hits([nbytes])
            bp.hit_pair_ns([nbytes], 10_000)

    def track_ratio_on_over_off(self, nbytes):
        on, off = [], []
        for _ in range(REPEATS):
            on.append(self.on.hit_pair_ns([nbytes], PAIRS, True))
            off.append(self.off.hit_pair_ns([nbytes], PAIRS, True))
        return statistics.median(on) / statistics.median(off)

    track_ratio_on_over_off.unit = "ratio"
