#!/usr/bin/env python3
"""Shapes of traffic that none of the scheduler's targets use, through `kvroute simulate`.

A rule that improves one benchmark must hold on loads it was not fitted to (the lessons in
docs/benchmarks.md). This runs 47 shapes, 3 seeds each, under round-robin, least-load,
prefix-hash and precise, and prints, per shape, precise's TTFT p50/p90/p99 over the best of the
others (median of the seeds), its hit rate, ITL p99 over round-robin's, load imbalance, and the
requests that failed (too long for an engine, or shed by flow control; the percentiles are of
the requests served) in the seed where most failed, precise's against the fewest of another
policy's, and how far precise's first tokens came from its predictions (`kvroute simulate`'s
`ttft_prediction_error`: mean and mean absolute error, beside its mean TTFT).
A shape where a ratio exceeds 1.05 is marked LOSS.

usage: [HELD_OUT_SEEDS="4 5 6"] scripts/held_out_shapes.py KVROUTE_BINARY OUT_DIR
       (about 2 minutes on 2 cores)

A run whose result is already in OUT_DIR is not run again (an interrupted sweep resumes), so
give each binary its own OUT_DIR.
"""

import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

POLICIES = "round-robin,least-load,prefix-hash,precise"
# Seeds 7-9 unless HELD_OUT_SEEDS names others ("4 5 6"): a rule must hold on seeds it was not
# checked on either.
SEEDS = tuple(int(x) for x in os.environ.get("HELD_OUT_SEEDS", "7 8 9").split())
# One simulation takes seconds; a run past this is stuck, not slow.
RUN_TIMEOUT_S = 600
TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces",
                     "mooncake-conversation.jsonl")


def shapes():
    out = []
    for engines in (2, 8, 16):
        for load in (0.5, 1.0):
            out.append((f"multi-turn-e{engines}-x{load}",
                        f"--engines {engines} --workload multi-turn --users {24 * engines} --turns 5 "
                        f"--shared-tokens 600 --user-tokens 200 --output-tokens 48 --think-s 0.5 "
                        f"--rate {2.0 * engines * load} --num-gpu-blocks 1000"))
            out.append((f"shared-prefix-e{engines}-x{load}",
                        f"--engines {engines} --workload shared-prefix --users {3 * engines} "
                        f"--turns 40 --shared-tokens 1500 --user-tokens 80 --output-tokens 24 "
                        f"--rate {8 * engines * load} --num-gpu-blocks 500"))
            out.append((f"zipf-tenants-e{engines}-x{load}",
                        f"--engines {engines} --workload tenants --users {4 * engines} "
                        f"--conversations {60 * engines} --turns 3 --tenant-skew zipf:1.1 "
                        f"--length-cv 0.5 --shared-tokens 1200 --user-tokens 120 --output-tokens 32 "
                        f"--think-s 0.5 --rate {3 * engines * load} --num-gpu-blocks 700"))
    for cv in (0.0, 1.0):
        for blocks in (300, 3000):
            out.append((f"tenants-cv{cv}-b{blocks}",
                        f"--engines 4 --workload tenants --users 10 --conversations 300 --turns 4 "
                        f"--tenant-skew uniform --length-cv {cv} --shared-tokens 1800 "
                        f"--user-tokens 150 --output-tokens 40 --think-s 0.3 --rate 10 "
                        f"--num-gpu-blocks {blocks}"))
    out.append(("block-size-32", "--engines 4 --block-size 32 --workload multi-turn --users 96 "
                "--turns 5 --shared-tokens 800 --user-tokens 200 --output-tokens 48 --think-s 0.5 "
                "--rate 8 --num-gpu-blocks 500"))
    out.append(("long-outputs", "--engines 4 --workload shared-prefix --users 8 --turns 40 "
                "--shared-tokens 1000 --user-tokens 50 --output-tokens 400 --rate 6 "
                "--num-gpu-blocks 800"))
    out.append(("default-8-engines", "--engines 8 --num-gpu-blocks 600"))
    out.extend(settings_shapes())
    if os.path.exists(TRACE):
        out.append(("mooncake-x4", f"--engines 4 --workload trace --speed 4 --trace {TRACE} "
                    "--limit 1500 --num-gpu-blocks 2000"))
        out.append(("mooncake-x10", f"--engines 4 --workload trace --speed 10 --trace {TRACE} "
                    "--limit 3000 --num-gpu-blocks 3000"))
        out.append(("mooncake-8-engines-x4", f"--engines 8 --workload trace --speed 4 "
                    f"--trace {TRACE} --limit 1500 --num-gpu-blocks 2000"))
    return out


def settings_shapes():
    """Axes the workload shapes above keep fixed: the engines' and the router's settings (stale
    events, a small chunked-prefill budget, few batch slots, slow engines), closed-loop clients,
    prompts that share nothing, overload, large blocks, long turns, one hot tenant or context,
    32 engines, caches that hold only a few requests at once, and offload tiers (CPU, SSD, a
    shared filesystem) under a small GPU cache."""
    mt = ("--workload multi-turn --users 96 --turns 5 --shared-tokens 600 --user-tokens 200 "
          "--output-tokens 48 --think-s 0.5")
    questions = ("--workload shared-prefix --users 12 --turns 40 --shared-tokens 1500 "
                 "--user-tokens 80 --output-tokens 24 --num-gpu-blocks 500")
    small_gpu = f"--engines 4 {mt} --num-gpu-blocks 300"
    return [
        ("stale-events-200ms", f"--engines 4 {mt} --rate 6 --num-gpu-blocks 1000 "
         "--event-delay 200ms"),
        ("chunk-budget-512", f"--engines 4 {questions} --rate 24 --max-num-batched-tokens 512"),
        ("batch-slots-4", f"--engines 4 {mt} --rate 8 --num-gpu-blocks 1000 --max-num-seqs 4"),
        ("slow-engines", f"--engines 4 {mt} --rate 3 --num-gpu-blocks 1000 "
         "--prefill-per-token-s 0.0001 --step-overhead-s 0.012 --decode-per-seq-s 0.00003"),
        ("closed-loop-64", f"--engines 4 {mt} --concurrency 64 --num-gpu-blocks 1000"),
        ("nothing-shared", "--engines 4 --workload multi-turn --users 400 --turns 1 "
         "--shared-tokens 0 --user-tokens 800 --output-tokens 64 --rate 12 "
         "--num-gpu-blocks 1000"),
        ("overload-questions", f"--engines 4 {questions} --rate 60"),
        ("block-size-64", f"--engines 4 --block-size 64 {mt} --rate 6 --num-gpu-blocks 250"),
        ("long-turns", "--engines 4 --workload multi-turn --users 48 --turns 4 "
         "--shared-tokens 300 --user-tokens 2000 --output-tokens 64 --think-s 1 --rate 1.5 "
         "--num-gpu-blocks 2000"),
        ("hot-tenant-zipf2", "--engines 4 --workload tenants --users 16 --conversations 400 "
         "--turns 3 --tenant-skew zipf:2.0 --shared-tokens 1500 --user-tokens 100 "
         "--output-tokens 32 --think-s 0.3 --rate 16 --num-gpu-blocks 700"),
        ("one-hot-context", "--engines 4 --workload shared-prefix --users 1 --turns 600 "
         "--shared-tokens 2000 --user-tokens 60 --output-tokens 24 --rate 40 "
         "--num-gpu-blocks 600"),
        ("engines-32", "--engines 32 --workload tenants --users 64 --conversations 1500 "
         "--turns 3 --tenant-skew zipf:1.1 --shared-tokens 1200 --user-tokens 120 "
         "--output-tokens 32 --think-s 0.5 --rate 60 --num-gpu-blocks 700"),
        ("few-requests-fit-250", f"--engines 4 {mt} --rate 3 --num-gpu-blocks 250"),
        ("few-requests-fit-300", f"--engines 4 {mt} --rate 6 --num-gpu-blocks 300"),
        ("cpu-tier-rate-4", f"{small_gpu} --rate 4 --num-cpu-blocks 3000"),
        ("cpu-tier-rate-6", f"{small_gpu} --rate 6 --num-cpu-blocks 3000"),
        ("cpu-tier-rate-8", f"{small_gpu} --rate 8 --num-cpu-blocks 3000"),
        ("ssd-tier", f"{small_gpu} --rate 6 --num-cpu-blocks 600 --num-ssd-blocks 6000"),
        ("shared-fs-tier", f"{small_gpu} --rate 6 --shared-fs-blocks 20000"),
    ]


def run(binary, out_dir, shape, seeds=SEEDS):
    """Runs `shape` (name, `kvroute simulate` arguments) under every policy for each seed not
    already in `out_dir`; exits on a failed or stuck run."""
    name, args = shape
    for seed in seeds:
        run_dir = os.path.join(out_dir, f"{name}-s{seed}")
        if os.path.exists(os.path.join(run_dir, "simulate.json")):
            continue
        cmd = [binary, "simulate", *args.split(), "--seed", str(seed), "--policy", POLICIES,
               "--out", run_dir]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            sys.exit(f"{name} seed {seed}: no result within {RUN_TIMEOUT_S} s ({args})")
        if done.returncode != 0:
            sys.exit(f"{name} seed {seed} failed: {done.stderr[-500:]} ({args})")
    return name


def prediction_errors(summaries):
    """Precise's time to first token less what it predicted, over one shape's seeds (its
    summaries, one per seed): (mean error, mean absolute error, mean TTFT) in seconds, or None
    when a result file carries no prediction error (one from before it was reported)."""
    errors = [s.get("ttft_prediction_error") for s in summaries]
    if not summaries or not all(errors):
        return None
    mean = lambda values: sum(values) / len(values)
    return (mean([e["mean_s"] for e in errors]), mean([e["mean_abs_s"] for e in errors]),
            mean([s["ttft"]["mean"] for s in summaries]))


def prediction_cell(errors):
    """A table cell for `prediction_errors`' answer: mean / mean absolute error (mean TTFT), ms."""
    if errors is None:
        return "-"
    bias, mae, ttft = errors
    return f"{bias * 1e3:.1f} / {mae * 1e3:.1f} ({ttft * 1e3:.1f})"


def prediction_line(relative_errors):
    """The closing line on precise's mean absolute errors over its mean TTFT, across shapes."""
    if not relative_errors:
        return ""
    ordered = sorted(relative_errors)
    return (f"precise's mean absolute TTFT prediction error over its mean TTFT, across the "
            f"shapes: median {ordered[len(ordered) // 2]:.2f}, worst {ordered[-1]:.2f}")


def table(out_dir, names):
    losses = 0
    relative = []
    print("| shape | p50 | p90 | p99 | precise hit (best other) | ITL p99 / RR | imbalance "
          "| failed: precise (fewest other) | precise TTFT less predicted: mean / mean absolute, "
          "ms (its mean TTFT) |")
    print("|---|---:|---:|---:|---|---:|---:|---|---|")
    for name in names:
        by_policy = {}
        precise_summaries = []
        for seed in SEEDS:
            with open(os.path.join(out_dir, f"{name}-s{seed}", "simulate.json")) as f:
                for run_result in json.load(f):
                    s = run_result["summary"]
                    if run_result["name"] == "precise":
                        precise_summaries.append(s)
                    by_policy.setdefault(run_result["name"], []).append(
                        (s["ttft"]["p50"], s["ttft"]["p90"], s["ttft"]["p99"], s["hit_rate"],
                         s["itl"]["p99"], s["load_imbalance"], s["errors"]))
        med = {p: [statistics.median(r[i] for r in rows) for i in range(7)]
               for p, rows in by_policy.items()}
        precise = med.pop("precise")
        ratios = [precise[i] / min(m[i] for m in med.values()) for i in range(3)]
        best_hit = max(m[3] for m in med.values())
        loss = max(ratios) > 1.05
        losses += loss
        itl = precise[4] / med["round-robin"][4]
        # Failed requests: the seed where most failed, so that one seed's failures show.
        failed = {p: max(r[6] for r in rows) for p, rows in by_policy.items()}
        fewest_failed = min(n for p, n in failed.items() if p != "precise")
        errors = prediction_errors(precise_summaries)
        if errors and errors[2] > 0:
            relative.append(errors[1] / errors[2])
        print(f"| {name} | {ratios[0]:.2f} | {ratios[1]:.2f} | {ratios[2]:.2f} | "
              f"{precise[3]:.3f} ({best_hit:.3f}) | {itl:.2f} | {precise[5]:.2f} | "
              f"{failed['precise']:.0f} ({fewest_failed:.0f}) | {prediction_cell(errors)} |"
              f"{' LOSS' if loss else ''}")
    print(f"\nprecise within 1.05x of the best other on every TTFT percentile in "
          f"{len(names) - losses} of {len(names)} shapes")
    print(prediction_line(relative))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    binary, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    with ThreadPoolExecutor(2) as pool:
        names = list(pool.map(lambda s: run(binary, out_dir, s), shapes()))
    table(out_dir, names)


if __name__ == "__main__":
    main()
