"""Add 'stats_without_allocs_le_8_bytes' to each .json: the same figures with every allocation
of <= 8 bytes (and its free) left out. On CPU these are mostly host-scalar artifacts (wrapped
Python numbers, foreach-optimizer per-parameter step/bias-correction scalars) that on a GPU
would live in host memory or not exist. The trace files themselves keep them."""
import glob
import gzip
import json
import sys

for js in sorted(glob.glob(sys.argv[1] + "/*.json")):
    m = json.load(open(js))
    live = peak = n = tot = 0
    sizes = set()
    by_op = {}
    with gzip.open(js[:-5] + ".csv.gz", "rt") as f:
        next(f)
        for line in f:
            t, op, i, s = line.rstrip().split(",")
            s = int(s)
            if s <= 8:
                continue
            if op == "a":
                live += s
                n += 1
                tot += s
                sizes.add(s)
                peak = max(peak, live)
            else:
                live -= s
    m["stats_without_allocs_le_8_bytes"] = {"n_allocs": n, "peak_live_bytes": peak,
                                            "total_bytes_allocated": tot,
                                            "distinct_sizes": len(sizes)}
    with open(js, "w") as f:
        f.write(json.dumps(m, separators=(",", ":")) + "\n")
    print(m["workload"], m["n_allocs"], m["allocs_le_8_bytes"], m["stats_without_allocs_le_8_bytes"])
