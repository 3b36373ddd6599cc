#!/usr/bin/env bash
# kvroute's precise routing against SGLang's gateway (SMG, `pip install smg==1.13.0`) on issue
# 16's 12-tenant load, live and like for like: for each seed and router, a fresh simulated fleet
# (`kvroute sim`, 4 engines x 600 blocks), the router in front of it (`kvroute serve`, or
# `smg launch` with its `cache_aware` or `prefix_hash` policy) and `kvroute bench` with text
# prompts (SMG routes text), all real processes on loopback. Results land in
# kvroute-compare/sglang/qQ/seed-S/<router>.json with one table per seed (`kvroute bench compare`).
# SMG is installed in .cache/smg-venv on first use. Minutes per seed. Not part of CI.
#
#   scripts/vs-sglang.sh                 # seeds 42 and 10, 100 questions per tenant
#   SEEDS="42 3 10" ROUTERS="precise smg-prefix_hash" QUESTIONS=25 scripts/vs-sglang.sh
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --quiet
bin=target/release/kvroute
out=kvroute-compare/sglang/q${QUESTIONS:-100}
seeds=${SEEDS:-"42 10"}
routers=${ROUTERS:-"precise smg-cache_aware smg-prefix_hash"}
questions=${QUESTIONS:-100}
venv=.cache/smg-venv
if [ ! -x "$venv/bin/smg" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check smg==1.13.0
fi

# shellcheck source=scripts/processes.sh
source scripts/processes.sh

engines=4
blocks=600
load=(--workload shared-prefix --users 12 --turns "$questions" --shared-tokens 2000 --user-tokens 100
  --rate 45 --ceiling-blocks $((engines * blocks)))

run_one() { # seed router
  local seed=$1 router=$2 dir=$out/seed-$1
  "$bin" sim --engines "$engines" --num-gpu-blocks "$blocks" --port 18001 --events-port 15557 \
    --replay-port 16557 >"$dir/sim-$router.log" 2>&1 &
  pids+=($!)
  local urls=()
  for i in $(seq 0 $((engines - 1))); do
    urls+=("http://127.0.0.1:$((18001 + i))")
    wait_http "http://127.0.0.1:$((18001 + i))/health"
  done
  case $router in
    precise)
      {
        echo "listen: 127.0.0.1:18000"
        echo "models: [{name: sim-llama-3.1-8b}]"
        echo "scheduler: {policy: precise}"
        echo "scrape: {interval_ms: 200}"
        echo "endpoints:"
        for i in $(seq 0 $((engines - 1))); do
          echo "  - {url: '${urls[$i]}', events: 'tcp://127.0.0.1:$((15557 + i))', replay: 'tcp://127.0.0.1:$((16557 + i))'}"
        done
      } >"$dir/router-precise.yaml"
      "$bin" serve -c "$dir/router-precise.yaml" >"$dir/router-precise.log" 2>&1 &
      pids+=($!)
      wait_http http://127.0.0.1:18000/health
      ;;
    smg-*)
      "$venv/bin/smg" launch --host 127.0.0.1 --port 18000 --worker-urls "${urls[@]}" \
        --policy "${router#smg-}" --disable-tokenizer-autoload >"$dir/router-$router.log" 2>&1 &
      pids+=($!)
      wait_http http://127.0.0.1:18000/health 300
      ;;
    *)
      echo "unknown router $router: precise, smg-cache_aware or smg-prefix_hash" >&2
      exit 2
      ;;
  esac
  "$bin" bench --url http://127.0.0.1:18000/v1 --name "$router" --out "$dir" --seed "$seed" \
    "${load[@]}" >"$dir/bench-$router.txt"
  cleanup
}

for seed in $seeds; do
  mkdir -p "$out/seed-$seed"
  echo "== seed $seed: ${load[*]}"
  files=()
  for router in $routers; do
    run_one "$seed" "$router"
    files+=("$out/seed-$seed/$router.json")
  done
  "$bin" bench compare "${files[@]}" --out "$out/seed-$seed" | tee "$out/seed-$seed/table.txt"
done
