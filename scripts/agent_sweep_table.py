"""Per cell of scripts/agent-sweep.sh: precise's hit rate against the best other policy's, and
its TTFT p50/p90/p99 and ITL p99 over the best other policy's (medians over seeds). A cell is
flagged where a ratio passes 1.05 or the hit rate falls a point short.

Usage: python3 agent_sweep_table.py OUT
"""

import glob
import os
import statistics
import sys

METRICS = ["TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT p99 (ms)", "ITL p99 (ms)"]
HIT = "prefix-cache hit rate"


def read(path):
    """Each metric row of a `kvroute simulate` table, by policy."""
    lines = open(path).read().splitlines()
    header = next(line for line in lines if line.strip().startswith("round-robin"))
    policies = header.split()
    rows = {}
    for name in METRICS + [HIT]:
        line = next(line for line in lines if line.startswith(name))
        values = [float(v.rstrip("%")) for v in line[len(name):].split()]
        rows[name] = dict(zip(policies, values))
    return rows


cells = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.txt"))):
    cell = os.path.basename(path)[:-4].split("_", 1)[1]
    cells.setdefault(cell, []).append(read(path))

for cell, runs in sorted(cells.items()):
    def median(metric, policy):
        return statistics.median(run[metric][policy] for run in runs)

    others = [p for p in runs[0][HIT] if p != "precise"]
    ratios = [median(m, "precise") / min(median(m, p) for p in others) for m in METRICS]
    hit = median(HIT, "precise")
    best_hit = max(median(HIT, p) for p in others)
    flag = " <==" if max(ratios) > 1.05 or hit < best_hit - 1 else ""
    print(
        f"{cell:28s} hit {hit:5.1f} vs {best_hit:5.1f}  p50 {ratios[0]:.2f} p90 {ratios[1]:.2f} "
        f"p99 {ratios[2]:.2f} itl99 {ratios[3]:.2f}{flag}"
    )
