#!/usr/bin/env bash
# Live measurements of the scheduler's targets (docs/benchmarks.md, "Scheduler targets"): for
# each workload and each policy, a fresh simulated fleet (`kvroute sim`), a fresh router
# (`kvroute serve`) and the load driver (`kvroute bench`), all real processes on loopback.
# Results land in kvroute-targets/<workload>/<policy>.json; each workload's comparison table
# is printed by `kvroute bench compare`, with the pooled-cache ceiling. Long: minutes per
# workload. Not part of CI.
#
#   scripts/targets.sh [workload ...]     # default: every workload below
#   POLICIES="round-robin precise" scripts/targets.sh heavy-multi-turn
#   ROUTER_YAML='flow: {enabled: false}' SUFFIX=-noflow scripts/targets.sh heavy-multi-turn
#   SCHEDULER='weights: {eviction: 0}' SUFFIX=-noevict scripts/targets.sh mooncake
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --quiet
bin=target/release/kvroute
out=kvroute-targets
policies=${POLICIES:-"round-robin least-load prefix-hash approximate precise"}
router_yaml=${ROUTER_YAML:-}
scheduler=${SCHEDULER:+, $SCHEDULER}
suffix=${SUFFIX:-}
mkdir -p "$out"

# name | engines | blocks per engine | extra sim arguments | bench arguments
# (`--ceiling-blocks` is engines × blocks: the pooled-cache ceiling; `--ceiling-max-model-len`
# the engines' `--max-model-len` where it is not the default.)
workloads() {
  cat <<'LIST'
heavy-multi-turn|4|1200||--workload multi-turn --users 256 --turns 6 --rate 16 --shared-tokens 400 --user-tokens 250 --output-tokens 64 --think-s 1.0 --ceiling-blocks 4800
llm-d-shape-30|8|3000||--workload shared-prefix --users 24 --turns 40 --shared-tokens 6000 --user-tokens 200 --output-tokens 64 --rate 30 --ceiling-blocks 24000
llm-d-shape-60|8|3000||--workload shared-prefix --users 24 --turns 40 --shared-tokens 6000 --user-tokens 200 --output-tokens 64 --rate 60 --ceiling-blocks 24000
shared-prefix-tenants|4|4096||--workload shared-prefix --users 8 --turns 40 --shared-tokens 3000 --user-tokens 150 --output-tokens 32 --rate 4 --ceiling-blocks 16384
mooncake|8|62500|--max-model-len 131072|--workload trace --trace ../shared/traces/mooncake-conversation.jsonl --limit 1500 --speed 3 --output-tokens 256 --ceiling-blocks 500000 --ceiling-max-model-len 131072
LIST
}

# shellcheck source=scripts/processes.sh
source scripts/processes.sh

run_one() { # workload engines blocks sim-args policy bench-args...
  local name=$1 engines=$2 blocks=$3 sim_args=$4 policy=$5
  shift 5
  # shellcheck disable=SC2086
  "$bin" sim --engines "$engines" --num-gpu-blocks "$blocks" --port 18001 --events-port 15557 \
    --replay-port 16557 $sim_args >"$out/$name/sim.log" 2>&1 &
  pids+=($!)
  {
    echo "listen: 127.0.0.1:18000"
    echo "models: [{name: sim-llama-3.1-8b}]"
    echo "scheduler: {policy: $policy$scheduler}"
    echo "scrape: {interval_ms: 200}"
    if [ -n "$router_yaml" ]; then echo "$router_yaml"; fi
    echo "endpoints:"
    for i in $(seq 0 $((engines - 1))); do
      echo "  - {url: 'http://127.0.0.1:$((18001 + i))', events: 'tcp://127.0.0.1:$((15557 + i))', replay: 'tcp://127.0.0.1:$((16557 + i))'}"
    done
  } >"$out/$name/router-$policy$suffix.yaml"
  for i in $(seq 0 $((engines - 1))); do wait_http "http://127.0.0.1:$((18001 + i))/health"; done
  "$bin" serve -c "$out/$name/router-$policy$suffix.yaml" >"$out/$name/router-$policy$suffix.log" 2>&1 &
  pids+=($!)
  wait_http http://127.0.0.1:18000/health
  "$bin" bench --url http://127.0.0.1:18000/v1 --name "$policy$suffix" --out "$out/$name" "$@" \
    >"$out/$name/bench-$policy$suffix.txt"
  cleanup
}

selected=("$@")
while IFS='|' read -r name engines blocks sim_args args; do
  if [ ${#selected[@]} -gt 0 ] && [[ ! " ${selected[*]} " =~ " $name " ]]; then continue; fi
  mkdir -p "$out/$name"
  echo "== $name ($engines engines x $blocks blocks $sim_args): $args $router_yaml"
  files=()
  for policy in $policies; do
    # shellcheck disable=SC2086
    run_one "$name" "$engines" "$blocks" "$sim_args" "$policy" $args
    files+=("$out/$name/$policy$suffix.json")
  done
  grep -h '^Ceiling' "$out/$name/bench-$policy$suffix.txt" || true
  "$bin" bench compare "${files[@]}" --out "$out/$name" | tee "$out/$name/table$suffix.txt"
done < <(workloads)
