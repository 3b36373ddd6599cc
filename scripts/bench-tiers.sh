#!/usr/bin/env bash
# Live tier sweep (issue 21): `kvroute sim` (4 engines) behind `kvroute serve`, driven by
# `kvroute bench`, for GPU-only / +CPU / +CPU+SSD / +shared filesystem, each under round-robin,
# tier-blind precise (every tier credited as the GPU) and tier-aware precise routing.
# Usage: scripts/bench-tiers.sh [KVROUTE_BINARY] [OUT_DIR]
# CELLS picks the tier rows (default: all four), e.g. CELLS=cpu-ssd-shared.
set -euo pipefail
BIN=${1:-target/release/kvroute}
OUT=${2:-kvroute-bench-tiers}
GPU_BLOCKS=${GPU_BLOCKS:-250}
TIME_SCALE=${TIME_SCALE:-1}
WORKLOAD=(--workload multi-turn --users 48 --turns 4 --shared-tokens 400 --user-tokens 250
  --output-tokens 16 --think-s 0.3 --rate 10 --seed 21)
mkdir -p "$OUT"
BASE=$((20000 + RANDOM % 20000))

declare -A TIERS=(
  [gpu-only]=""
  [cpu]="--num-cpu-blocks 1500"
  [cpu-ssd]="--num-cpu-blocks 300 --num-ssd-blocks 1200"
  [cpu-ssd-shared]="--num-cpu-blocks 300 --num-ssd-blocks 1200 --shared-fs-blocks 4000"
)
declare -A POLICIES=(
  [round-robin]="scheduler: {policy: round-robin}"
  [tier-blind]="scheduler: {policy: precise, tiers: {cpu_weight: 1.0, storage_weight: 1.0, shared_weight: 1.0}}"
  [tier-aware]="scheduler: {policy: precise}"
)

wait_up() {
  for _ in $(seq 1 200); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "$1 did not come up" >&2
  return 1
}

CELLS=${CELLS:-gpu-only cpu cpu-ssd cpu-ssd-shared}
for tiers in $CELLS; do
  for policy in round-robin tier-blind tier-aware; do
    http=$BASE events=$((BASE + 10)) replay=$((BASE + 20)) listen=$((BASE + 30)) admin=$((BASE + 31))
    BASE=$((BASE + 40))
    # shellcheck disable=SC2086
    "$BIN" sim --engines 4 --num-gpu-blocks "$GPU_BLOCKS" ${TIERS[$tiers]} --time-scale "$TIME_SCALE" \
      --port "$http" --events-port "$events" --replay-port "$replay" >/dev/null 2>&1 &
    sim=$!
    mount=""
    [[ $tiers == *shared ]] && mount=", offload: {shared_mount: fs}"
    {
      echo "listen: 127.0.0.1:$listen"
      echo "admin: {listen: 127.0.0.1:$admin}"
      echo "models: [{name: sim-llama-3.1-8b}]"
      echo "${POLICIES[$policy]}"
      echo "endpoints:"
      for i in 0 1 2 3; do
        echo "  - {url: 'http://127.0.0.1:$((http + i))', events: 'tcp://127.0.0.1:$((events + i))', replay: 'tcp://127.0.0.1:$((replay + i))'$mount}"
      done
    } >"$OUT/$tiers-$policy.yaml"
    "$BIN" serve -c "$OUT/$tiers-$policy.yaml" >"$OUT/$tiers-$policy.log" 2>&1 &
    router=$!
    for i in 0 1 2 3; do wait_up "http://127.0.0.1:$((http + i))"; done
    wait_up "http://127.0.0.1:$listen"
    "$BIN" bench --url "http://127.0.0.1:$listen/v1" --name "$tiers-$policy" --out "$OUT" \
      "${WORKLOAD[@]}" >/dev/null
    kill "$router" "$sim"
    wait "$router" "$sim" 2>/dev/null || true
  done
done
"$BIN" bench compare "$OUT"/*.json --out "$OUT"
