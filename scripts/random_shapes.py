#!/usr/bin/env python3
"""Random shapes of traffic through `kvroute simulate`: shapes nobody chose.

The held-out shapes (scripts/held_out_shapes.py) are still shapes someone picked. This draws
SHAPES shapes at random from wide ranges (fleet size, workload, prompt and output lengths, turns,
think time, tenant skew, length spread, block size, cache size against the working set, offered
load against the fleet's capacity, open or closed loop, sometimes a CPU tier), runs each under
round-robin, least-load, prefix-hash and precise for several seeds, and prints, per shape,
precise's mean TTFT and TTFT p50/p90/p99 over the best other policy's (geometric mean over the
seeds; the mean TTFT is the steadiest figure, a p99 over a few hundred requests the least), and
in how many seeds precise was no worse than every other policy on that figure, and how far its
first tokens came from its predictions (mean and mean absolute error). A ratio above 1.05 is
marked LOSS. The draw is fixed by --draw, so a sweep can be re-run on another binary.

A p99 over a few hundred requests is its few slowest, so a lost figure may be the runs' luck.
Each lost figure is resampled: every run's requests drawn again with replacement, the figure
and the ratio computed again, BOOTSTRAP_ROUNDS times; the share of resamples in which precise
still loses is printed beside LOSS, and the last lines count the shapes lost on a figure that
stays lost in at least NOISE_CONFIDENCE of them. It measures the sampling of requests within
each run (not what another seed would do), and it does not change the verdict above.

Beside each lost figure it names the policy that was best on it and that policy's load imbalance
against precise's, and a last count gives the shapes whose one loss is the median, with
precise's mean no worse, to a policy that loads the fleet less evenly: in an overload, the
requests on that policy's lighter engines wait less and outnumber those on its heavier ones,
a trade of the median against the mean and tail.

usage: scripts/random_shapes.py BINARY OUT_DIR [--shapes 40] [--draw 1] [--seeds 1,2,3]
       (about 2 minutes for 40 shapes on 2 cores)

A run whose result is already in OUT_DIR is not run again, so give each binary its own OUT_DIR.
"""

import argparse
import json
import math
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from held_out_shapes import (  # noqa: E402
    POLICIES as POLICY_LIST, prediction_cell, prediction_errors, prediction_line, run)

POLICIES = tuple(POLICY_LIST.split(","))
# The simulator's default engine: prefill seconds per uncached token, and a decode step.
PREFILL_S_PER_TOKEN = 32e-6
DECODE_STEP_S = 0.0048
LOSS = 1.05
# Resamples of each lost figure, and the share of them in which precise must still lose for the
# loss to count as beyond the runs' sampling noise.
BOOTSTRAP_ROUNDS = 200
NOISE_CONFIDENCE = 0.9


def log_uniform(rng, low, high):
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def draw_shape(rng, index):
    """One shape: its name, its `kvroute simulate` arguments, and what was drawn."""
    engines = rng.choice((2, 3, 4, 4, 6, 8, 12))
    workload = rng.choice(("multi-turn", "shared-prefix", "tenants", "tenants"))
    block_size = rng.choice((16, 16, 16, 32))
    shared = int(log_uniform(rng, 100, 5000))
    user = int(log_uniform(rng, 20, 1500))
    output = int(log_uniform(rng, 8, 400))
    think = round(rng.uniform(0.0, 2.0), 2)
    args = [f"--engines {engines}", f"--workload {workload}", f"--block-size {block_size}",
            f"--shared-tokens {shared}", f"--user-tokens {user}", f"--output-tokens {output}",
            f"--think-s {think}"]
    if workload == "multi-turn":
        turns = rng.randint(2, 10)
        users = max(engines * rng.randint(3, 20), 4)
        requests = users * turns
        longest = shared + turns * (user + output)
        mean_prompt = shared + (turns + 1) / 2 * (user + output)
        working_set = shared + users * longest
    elif workload == "shared-prefix":
        turns = rng.randint(10, 60)
        users = max(1, int(engines * rng.uniform(0.5, 4)))
        requests = users * turns
        longest = shared + user
        mean_prompt = longest
        working_set = users * shared
    else:
        users = max(1, int(engines * rng.uniform(0.5, 8)))
        turns = rng.randint(1, 6)
        conversations = max(users, rng.randint(60, 400) // turns)
        requests = conversations * turns
        cv = round(rng.choice((0.0, 0.3, 0.8, 1.5)), 1)
        skew = rng.choice(("uniform", "uniform", "zipf:0.9", "zipf:1.3", "zipf:2.0"))
        args += [f"--conversations {conversations}", f"--length-cv {cv}", f"--tenant-skew {skew}"]
        longest = int((shared + turns * (user + output)) * (1 + 2 * cv))
        mean_prompt = shared + (turns + 1) / 2 * (user + output)
        working_set = users * shared
    args += [f"--users {users}", f"--turns {turns}"]
    # The cache against the working set, from a tenth of the pooled need to four times it; an
    # engine always holds its longest prompt twice over, and serves prompts as long as its
    # cache holds (no longer: vLLM would not start).
    cache_factor = log_uniform(rng, 0.1, 4.0)
    per_engine = working_set * cache_factor / engines / block_size
    blocks = int(max(per_engine, 2 * longest / block_size + 16))
    # vLLM refuses to start unless its cache holds one request of the longest length it serves.
    max_model_len = min(32768, blocks * block_size)
    args += [f"--num-gpu-blocks {blocks}", f"--max-model-len {max_model_len}"]
    if rng.random() < 0.15:
        args += [f"--num-cpu-blocks {blocks * rng.choice((2, 5, 10))}"]
    # Offered load against the fleet's capacity with no cache at all: every prompt token
    # prefilled, decode steps shared by about eight sequences, and no more sequences at once
    # than the cache holds (where it holds one or two, requests wait for room, not compute).
    # 1.0 saturates a cacheless fleet, so the top of the range is where a cache decides whether
    # the fleet keeps up.
    fits = max(1, blocks * block_size // (mean_prompt + output))
    per_request_s = max(mean_prompt * PREFILL_S_PER_TOKEN + output * DECODE_STEP_S / 8,
                        output * DECODE_STEP_S / min(fits, 8))
    load = log_uniform(rng, 0.2, 1.3)
    if rng.random() < 0.2:
        args += [f"--concurrency {rng.choice((8, 16, 32, 64, 128))}"]
        load_text = "closed"
    else:
        rate = round(load * engines / per_request_s, 2)
        args += [f"--rate {rate}"]
        load_text = f"x{load:.2f}"
    name = (f"r{index:02d}-{workload}-e{engines}-c{cache_factor:.2f}-{load_text}-n{requests}")
    return name, " ".join(args)


FIGURES = ("mean", "p50", "p90", "p99")


def geo_mean(values):
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


def figure_of(values, figure):
    """A TTFT figure ("mean" or a percentile "pNN") of `values`, in the order given or not;
    percentiles interpolate between the nearest ranks."""
    if figure == "mean":
        return sum(values) / len(values)
    ordered = sorted(values)
    rank = float(figure[1:]) / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def served_ttfts(out_dir, name, seeds):
    """Each policy's runs of shape `name`, one list of its served requests' first tokens (in
    seconds) per seed; `None` when a policy has a run without one."""
    ttfts = {p: [] for p in POLICIES}
    for seed in seeds:
        with open(os.path.join(out_dir, f"{name}-s{seed}", "simulate.json")) as f:
            for run_result in json.load(f):
                served = [r["ttft_s"] for r in run_result["records"]
                          if r.get("ttft_s") is not None]
                ttfts[run_result["name"]].append(served)
    if any(not runs or not all(runs) for runs in ttfts.values()):
        return None
    return ttfts


def still_lost(ttfts, figure, rng):
    """Share of BOOTSTRAP_ROUNDS resamples of a shape's runs (`ttfts`, from [served_ttfts]: each
    run's first tokens drawn again with replacement) in which precise's `figure` (geometric
    mean over the seeds) is more than LOSS times the best other policy's; NaN without runs."""
    if ttfts is None:
        return float("nan")
    lost = 0
    for _ in range(BOOTSTRAP_ROUNDS):
        value = {p: geo_mean([figure_of(rng.choices(run, k=len(run)), figure) for run in runs])
                 for p, runs in ttfts.items()}
        best_other = min(v for p, v in value.items() if p != "precise")
        lost += value["precise"] > LOSS * best_other
    return lost / BOOTSTRAP_ROUNDS


def table(out_dir, seeds, shapes):
    losses = {f: 0 for f in FIGURES}
    any_loss = 0
    beyond_noise = 0
    uneven_median = 0
    calibration = []
    print("| shape | mean | p50 | p90 | p99 | seeds no worse (mean/p50/p90/p99) | hit: precise "
          "(best other) | failed: precise (fewest other) | precise TTFT less predicted: mean / "
          "mean absolute, ms (of its mean TTFT) |")
    print("|---|---:|---:|---:|---:|---|---|---|---|")
    for name, args in shapes:
        per_seed = []
        for seed in seeds:
            with open(os.path.join(out_dir, f"{name}-s{seed}", "simulate.json")) as f:
                per_seed.append({r["name"]: r["summary"] for r in json.load(f)})
        ratios, wins, best = [], [], []
        for figure in FIGURES:
            value = lambda s, p: s[p]["ttft"][figure]
            best_other, best_policy = min((geo_mean([value(s, p) for s in per_seed]), p)
                                          for p in POLICIES if p != "precise")
            best.append(best_policy)
            ratios.append(geo_mean([value(s, "precise") for s in per_seed]) / best_other)
            wins.append(sum(all(value(s, "precise") <= value(s, p) * 1.0001
                                for p in POLICIES if p != "precise") for s in per_seed))
        hit = geo_mean([s["precise"]["hit_rate"] + 1e-6 for s in per_seed])
        best_hit = max(geo_mean([s[p]["hit_rate"] + 1e-6 for s in per_seed])
                       for p in POLICIES if p != "precise")
        failed = sum(s["precise"]["errors"] for s in per_seed)
        fewest = min(sum(s[p]["errors"] for s in per_seed) for p in POLICIES if p != "precise")
        errors = prediction_errors([s["precise"] for s in per_seed])
        if errors and errors[2] > 0:
            calibration.append(errors[1] / errors[2])
        lost = [f for f, r in zip(FIGURES, ratios) if r > LOSS]
        for f in lost:
            losses[f] += 1
        any_loss += bool(lost)
        imbalance = {p: geo_mean([s[p]["load_imbalance"] for s in per_seed]) for p in POLICIES}
        winner = dict(zip(FIGURES, best))
        # A lone lost median, to a policy that loads the fleet less evenly, with precise's mean
        # no worse: the other policy's lighter engines serve more than half of the requests
        # faster and its heavier ones the rest slower (a trade of the median against the mean
        # and tail, not a lost request).
        uneven_median += (lost == ["p50"] and ratios[0] <= LOSS
                          and imbalance[winner["p50"]] > imbalance["precise"])
        # The same draw of resamples for a shape whichever binary ran it.
        rng = random.Random(name)
        ttfts = served_ttfts(out_dir, name, seeds) if lost else None
        kept = {f: still_lost(ttfts, f, rng) for f in lost}
        beyond_noise += any(share >= NOISE_CONFIDENCE for share in kept.values())
        print(f"| {name} | " + " | ".join(f"{r:.2f}" for r in ratios) + " | "
              + "/".join(str(w) for w in wins) + f" of {len(seeds)} | {hit:.3f} ({best_hit:.3f}) | "
              f"{failed} ({fewest}) | {prediction_cell(errors)} |"
              + (" LOSS " + ",".join(
                  f"{f} ({kept[f]:.2f} of resamples; best {winner[f]}, load imbalance "
                  f"{imbalance[winner[f]]:.2f} against precise's {imbalance['precise']:.2f})"
                  for f in lost) if lost else ""))
    print(f"\nprecise within {LOSS}x of the best other on every TTFT figure in "
          f"{len(shapes) - any_loss} of {len(shapes)} shapes; losses by figure: "
          + ", ".join(f"{f} {n}" for f, n in losses.items()))
    print(f"of the {any_loss} shapes lost, {beyond_noise} lose on a figure that stays lost in at "
          f"least {NOISE_CONFIDENCE:.0%} of {BOOTSTRAP_ROUNDS} resamples of their requests")
    print(f"of them, {uneven_median} lose the median alone, with precise's mean TTFT no worse, to "
          f"a policy whose load imbalance is higher than precise's")
    print(prediction_line(calibration))


def main():
    parser = argparse.ArgumentParser(usage=__doc__)
    parser.add_argument("binary")
    parser.add_argument("out_dir")
    parser.add_argument("--shapes", type=int, default=40)
    parser.add_argument("--draw", type=int, default=1)
    parser.add_argument("--seeds", default="1,2,3")
    options = parser.parse_args()
    seeds = [int(s) for s in options.seeds.split(",")]
    rng = random.Random(options.draw)
    shapes = [draw_shape(rng, i) for i in range(options.shapes)]
    os.makedirs(options.out_dir, exist_ok=True)
    with open(os.path.join(options.out_dir, "shapes.txt"), "w") as f:
        f.writelines(f"{name}: {args}\n" for name, args in shapes)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda s: run(options.binary, options.out_dir, s, seeds), shapes))
    table(options.out_dir, seeds, shapes)


if __name__ == "__main__":
    main()
