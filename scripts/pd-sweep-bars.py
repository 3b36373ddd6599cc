#!/usr/bin/env python3
"""Turns scripts/pd-sweep.sh's results into a grouped bar table for `kvroute report --bars`:
one group per workload and link, one series per fleet (aggregated, which has no link, repeated
in each of its workload's groups), the median over the seeds run of one TTFT or ITL percentile,
in milliseconds.

usage: pd-sweep-bars.py OUT_DIR MODEL [METRIC] > table.json
  MODEL: 8b or 70b; METRIC: ttft.p50, ttft.p90 (default), ttft.p99 or itl.p99
"""
import json
import pathlib
import statistics
import sys
from collections import defaultdict

out, model = pathlib.Path(sys.argv[1]), sys.argv[2]
metric = sys.argv[3] if len(sys.argv) > 3 else "ttft.p90"
kind, pct = metric.split(".")
cells = defaultdict(list)
for run in sorted(out.glob(f"{model}-*/simulate.json")):
    _, workload, _seed, *config = run.parent.name.split("-")
    summary = json.load(open(run))[0]["summary"]
    cells[(workload, "-".join(config))].append(summary[kind][pct] * 1000)

links = ("tcp", "roce-100", "ib-400")
workloads = [w for w in ("long8k", "multiturn", "mixed") if any(k[0] == w for k in cells)]
fleets = [f for f in ("aggregated", "always", "cost", "costsplit")
          if any(k[1].startswith(f) for k in cells)]
groups = [(w, link) for w in workloads for link in links]


def value(workload, fleet, link):
    runs = cells.get((workload, fleet if fleet == "aggregated" else f"{fleet}-{link}"))
    return round(statistics.median(runs), 1) if runs else None


names = {"aggregated": "aggregated (4 engines)", "always": "always P/D (2P+2D)",
         "cost": "cost-decided (4 kv_both)", "costsplit": "cost-decided (2P+2D)"}
label = {"ttft": "TTFT", "itl": "ITL"}[kind]
json.dump({
    "title": f"Llama-3.1-{model.upper()} on kvroute simulate: {label} {pct} by workload and link"
             " (median of seeds)",
    "y_label": f"{label} {pct} (ms)",
    "unit": " ms",
    "groups": [f"{w} {link}" for w, link in groups],
    "series": [{"name": names[f], "values": [value(w, f, link) for w, link in groups]}
               for f in fleets],
}, sys.stdout, indent=1)
print()
