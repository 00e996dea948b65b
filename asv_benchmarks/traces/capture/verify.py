import glob, json, os, sys
import numpy as np
from gpumem.observe.trace import read_trace
for p in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '*.csv.gz'))):
    t = read_trace(p)
    print(t)
    m = t.metadata
    lb = t.live_bytes()
    ids_alloc = t.ids[t.ops == 0]
    assert (ids_alloc == np.arange(len(ids_alloc))).all(), "ids not 0..N-1 in alloc order"
    assert lb[-1] == 0 and t.n_allocs == t.n_frees
    assert m['n_events'] == len(t) and m['peak_live_bytes'] == t.peak_live_bytes
    assert (np.diff(t.t_ns) >= 0).all() and t.t_ns[0] == 0
    ph = t.phases
    assert ph[0].first_row == 0 and ph[-1].end_row == len(t)
    assert all(a.end_row == b.first_row for a, b in zip(ph, ph[1:]))
    assert all(len(p_) > 0 for p_ in ph), [p_ for p_ in ph if len(p_) == 0]
    mat = t.select('materialize', include_live=False)
    td = t.phase('teardown')
    print('  phases', len(ph), [(p_.name, len(p_)) for p_ in ph[:3]], '...', (ph[-1].name, len(ph[-1])),
          'live after materialize MiB %.1f' % (lb[ph[0].end_row-1]/2**20),
          'teardown frees', int((t.ops[td.first_row:td.end_row]==1).sum()))
