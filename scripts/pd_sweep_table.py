#!/usr/bin/env python3
"""Tabulates scripts/pd-sweep.sh's results: one Markdown row per model, workload and fleet
(median over the seeds run), TTFT p50/p90/p99 and ITL p99 in milliseconds; then issue 20's
verdict per model, workload and link: whether a cost-decided fleet (on kv_both engines, or on
prefill and decode engines) is no worse than the better of aggregated and always-P/D on each of
the four figures, from the unrounded medians, with the worst figure's ratio beside it (a cell
missed by 0.1% says so). A baseline that failed more requests than the cost-decided fleet is not
the better one: its latencies are of the requests it served (always-P/D over a saturated link
fails many), so it is left out of that cell's baseline, and the row says so.

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

FIGURES = (
    ("TTFT p50", lambda s: s["ttft"]["p50"]),
    ("TTFT p90", lambda s: s["ttft"]["p90"]),
    ("TTFT p99", lambda s: s["ttft"]["p99"]),
    ("ITL p99", lambda s: s["itl"]["p99"]),
)


def errors(key):
    """Requests one cell's fleet failed, over every seed (None if it was not run)."""
    runs = cells.get(key)
    return sum(s["errors"] for s in runs) if runs else None


def medians(key):
    """The four figures' medians over the seeds of one cell's fleet (None if it was not run)."""
    runs = cells.get(key)
    return [statistics.median(f(s) for s in runs) for _, f in FIGURES] if runs else None


def shortfall(mine, best):
    """Figures over the baseline, the worst ratio, and every ratio: sorts the fleet closest to
    meeting the target first."""
    ratios = [m / max(b, 1e-12) for m, b in zip(mine, best)]
    return sum(r > 1 for r in ratios), max(ratios), ratios


print()
print("| model | workload | link | cost-decided: worst figure over the better of aggregated and always-P/D | verdict |")
print("|---|---|---|---:|---|")
met = total = 0
for model in ("8b", "70b"):
    for workload in ("long8k", "multiturn", "mixed"):
        for link in ("tcp", "roce-100", "ib-400"):
            decided_keys = [(model, workload, f"{fleet}-{link}") for fleet in ("cost", "costsplit")]
            decided = [(medians(k), errors(k)) for k in decided_keys if medians(k)]
            baseline_keys = [(model, workload, "aggregated"), (model, workload, f"always-{link}")]
            if not decided:
                continue
            results = []
            for mine, failed in decided:
                baselines, left_out = [], []
                for key in baseline_keys:
                    m = medians(key)
                    if not m:
                        continue
                    if errors(key) > failed:
                        left_out.append(f"{key[2]} failed {errors(key)}")
                    else:
                        baselines.append(m)
                if baselines:
                    best = [min(values) for values in zip(*baselines)]
                    results.append((shortfall(mine, best), left_out))
            if not results:
                continue
            (over, worst, ratios), left_out = min(results)
            total += 1
            met += over == 0
            missed = ", ".join(name for (name, _), r in zip(FIGURES, ratios) if r > 1)
            note = f" (not a baseline: {'; '.join(left_out)})" if left_out else ""
            print(f"| {model} | {workload} | {link} | {worst:.3f} | {'met' if over == 0 else 'missed: ' + missed}{note} |")
print()
print(f"Met in {met} of {total} cells.")
