#!/usr/bin/env bash
# Many endpoints end to end (docs/benchmarks.md, "Many endpoints"): one `kvroute sim` process
# running ENGINES simulated engines (HTTP, KV events, replay), one `kvroute serve` in front of
# them with health checks, scraping and an event subscriber per engine, then `kvroute bench`
# driving it. Prints the router's CPU (from /proc/<pid>/stat) and memory (VmRSS, VmHWM from
# /proc/<pid>/status) over a fixed idle window and over the load, and the size of its
# /metrics. Real processes on loopback; not part of CI.
#
#   scripts/many-endpoints.sh                       # 64 engines, per-endpoint metrics on
#   PER_ENDPOINT=false scripts/many-endpoints.sh    # aggregate-only /metrics
#   ENGINES=128 IDLE_S=60 scripts/many-endpoints.sh
#   BENCH_ARGS='--workload multi-turn --users 64 --turns 4 --rate 8' scripts/many-endpoints.sh
set -euo pipefail
cd "$(dirname "$0")/.."

engines=${ENGINES:-64}
idle_s=${IDLE_S:-30}
per_endpoint=${PER_ENDPOINT:-true}
base=${BASE_PORT:-28000} # router base, admin base+90, engines base+1.., events/replay below
events_base=$((base - 3000))
replay_base=$((base - 2000))
bench_args=${BENCH_ARGS:-"--workload multi-turn --users 384 --turns 4 --rate 24 --shared-tokens 400 --user-tokens 250 --output-tokens 32 --think-s 1.0"}
out=${OUT:-kvroute-many-endpoints}
mkdir -p "$out"

if [ -z "${NO_BUILD:-}" ]; then cargo build --release --quiet -p kvroute; fi
bin=target/release/kvroute

# shellcheck source=scripts/processes.sh
source scripts/processes.sh

ticks=$(getconf CLK_TCK)
cpu_ticks() { # utime + stime of a process, in clock ticks
  awk '{print $14 + $15}' "/proc/$1/stat"
}
status_kib() { # a /proc/<pid>/status field, KiB
  awk -v f="$2:" '$1 == f {print $2}' "/proc/$1/status"
}
mib() { awk -v k="$1" 'BEGIN {printf "%.1f", k / 1024}'; }
pct() { awk -v t="$1" -v s="$2" -v hz="$ticks" 'BEGIN {printf "%.1f", 100 * t / hz / s}'; }

"$bin" sim --engines "$engines" --port $((base + 1)) --events-port "$events_base" \
  --replay-port "$replay_base" >"$out/sim.log" 2>&1 &
sim=$!
pids+=("$sim")
{
  echo "listen: 127.0.0.1:$base"
  echo "admin: {listen: '127.0.0.1:$((base + 90))'}"
  echo "models: [{name: sim-llama-3.1-8b}]"
  echo "metrics: {per_endpoint: $per_endpoint}"
  echo "endpoints:"
  for i in $(seq 0 $((engines - 1))); do
    echo "  - {name: engine-$i, url: 'http://127.0.0.1:$((base + 1 + i))', events: 'tcp://127.0.0.1:$((events_base + i))', replay: 'tcp://127.0.0.1:$((replay_base + i))'}"
  done
} >"$out/router.yaml"
for i in $(seq 0 $((engines - 1))); do wait_http "http://127.0.0.1:$((base + 1 + i))/health" 300; done
"$bin" serve -c "$out/router.yaml" >"$out/router.log" 2>&1 &
router=$!
pids+=("$router")
wait_http "http://127.0.0.1:$base/health" 300
sleep 3 # subscribers connect, first scrapes land

echo "== $engines engines, per_endpoint: $per_endpoint; idle for ${idle_s}s"
r0=$(cpu_ticks "$router")
s0=$(cpu_ticks "$sim")
sleep "$idle_s"
r1=$(cpu_ticks "$router")
s1=$(cpu_ticks "$sim")
idle_rss=$(status_kib "$router" VmRSS)
metrics_bytes=$(curl -sf "http://127.0.0.1:$((base + 90))/metrics" | wc -c)

echo "== load: kvroute bench $bench_args"
start=$(date +%s.%N)
r2=$(cpu_ticks "$router")
s2=$(cpu_ticks "$sim")
# shellcheck disable=SC2086
"$bin" bench --url "http://127.0.0.1:$base/v1" --name "many-$engines" --out "$out" $bench_args \
  >"$out/bench.txt"
r3=$(cpu_ticks "$router")
s3=$(cpu_ticks "$sim")
end=$(date +%s.%N)
load_s=$(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.1f", b - a}')
load_rss=$(status_kib "$router" VmRSS)
hwm=$(status_kib "$router" VmHWM)
metrics_after=$(curl -sf "http://127.0.0.1:$((base + 90))/metrics" | wc -c)
requests=$(python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
r = r[0] if isinstance(r, list) else r
print(r["summary"]["requests"])' "$out/many-$engines.json" || true)

cat <<EOF
engines: $engines   per_endpoint: $per_endpoint
router idle (${idle_s}s):  CPU $(pct $((r1 - r0)) "$idle_s")% of a core, RSS $(mib "$idle_rss") MiB; sim CPU $(pct $((s1 - s0)) "$idle_s")%
router load (${load_s}s, ${requests:-?} requests): CPU $(pct $((r3 - r2)) "$load_s")% of a core, RSS $(mib "$load_rss") MiB, peak RSS $(mib "$hwm") MiB; sim CPU $(pct $((s3 - s2)) "$load_s")%
router /metrics: $metrics_bytes bytes idle, $metrics_after bytes after the load
EOF
tail -n 20 "$out/bench.txt"
