"""The seed table's five scenarios (asv_benchmarks/seed_table.py; defined in docs/benchmarks.md,
"The seed table") on opencl:0: one pass of each scenario's allocations and frees through gpumem
(``malloc`` + ``.native``, what an OpenCL kernel takes), pyopencl's ``MemoryPool`` and no pool
(a ``cl.Buffer`` per allocation). Skipped (NotImplementedError) without an OpenCL device.
``compare.py --seed-table`` runs the same scenarios with every peer interleaved in one process
and prints the paired ratios; these track each row over commits."""
import sys

from . import ASV_DIR, opencl_available, replay

SCENARIOS = ["same-size", "large", "training", "pressure", "variable"]
PEERS = ["gpumem", "pyopencl", "no pool"]


def _seed_table():
    if str(ASV_DIR) not in sys.path:
        sys.path.insert(0, str(ASV_DIR))
    import seed_table
    return seed_table


class SeedTable:
    """One pass of a scenario (its quick size; each pass starts and ends with nothing live),
    after one untimed pass that warms the pool."""

    params = [SCENARIOS, PEERS]
    param_names = ["scenario", "peer"]
    timeout = 300

    def setup(self, scenario, peer):
        ok, reason = opencl_available()
        if not ok:
            raise NotImplementedError(f"OpenCL unavailable: {reason}")
        st = _seed_table()
        build = dict(zip(SCENARIOS, (b for _, b, _ in st.SCENARIOS)))[scenario]
        self.trace = build(True)
        budget = st.PRESSURE_BUDGET if scenario == "pressure" else None
        if peer == "gpumem":
            self.peer = st.GpumemSeedPeer("opencl:0", native=True, budget=budget)
        elif peer == "pyopencl":
            self.peer = st.PyOpenCLSeedPeer(budget)
        else:
            self.peer = st.OpenCLNoPoolPeer()
        try:
            self.peer.open()
        except st.Skip as exc:
            raise NotImplementedError(str(exc)) from None
        self.inst = self.peer.make()
        replay(self.trace, self.inst.alloc, self.inst.free)

    def teardown(self, scenario, peer):
        self.inst.close()
        self.peer.shutdown()

    def time_pass(self, scenario, peer):
        replay(self.trace, self.inst.alloc, self.inst.free)
