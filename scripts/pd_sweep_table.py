#!/usr/bin/env python3
"""Tabulates scripts/pd-sweep.sh's results: one Markdown row per model, workload and fleet
(median over the seeds run), TTFT p50/p90/p99 and ITL p99 in milliseconds.

usage: pd_sweep_table.py OUT_DIR
"""
import json
import pathlib
import statistics
import sys
from collections import defaultdict

out = pathlib.Path(sys.argv[1])
cells = defaultdict(list)
for run in sorted(out.glob("*/simulate.json")):
    model, workload, seed, *config = run.parent.name.split("-")
    summary = json.load(open(run))[0]["summary"]
    cells[(model, workload, "-".join(config))].append(summary)

order = ["aggregated"] + [
    f"{fleet}-{link}" for link in ("tcp", "roce-100", "ib-400") for fleet in ("always", "cost", "costsplit")
]
print("| model | workload | fleet | TTFT p50 | TTFT p90 | TTFT p99 | ITL p99 | errors |")
print("|---|---|---|---:|---:|---:|---:|---:|")
for model in ("8b", "70b"):
    for workload in ("long8k", "multiturn", "mixed"):
        for config in order:
            runs = cells.get((model, workload, config))
            if not runs:
                continue
            med = lambda f: statistics.median(f(s) for s in runs) * 1000
            print(
                f"| {model} | {workload} | {config} | {med(lambda s: s['ttft']['p50']):.0f} | "
                f"{med(lambda s: s['ttft']['p90']):.0f} | {med(lambda s: s['ttft']['p99']):.0f} | "
                f"{med(lambda s: s['itl']['p99']):.1f} | {sum(s['errors'] for s in runs)} |"
            )
