#!/usr/bin/env bash
# Agent-shaped traffic through `kvroute simulate` (not a matrix shape): each application has a
# 3,000-token context (tools and system prompt); each conversation runs 10 tool turns, a turn
# being an ~800-token tool result (log-normal, cv 0.5) and a 60-token call, 0.3 s apart.
# Sweeps applications, cache size and load (open and closed loop), two seeds; about 7 minutes.
#
#   scripts/agent-sweep.sh BIN OUT && python3 scripts/agent_sweep_table.py OUT
set -euo pipefail
bin=$1
out=$2
mkdir -p "$out"
for seed in 1 2; do
  for apps in 1 4 16; do
    for blocks in 1000 2500 6000; do
      for load in "--rate 0.5" "--rate 1.5" "--rate 3" "--concurrency 8" "--concurrency 32"; do
        tag="s${seed}_u${apps}_b${blocks}_${load// /}"
        # shellcheck disable=SC2086 # $load is two words on purpose
        "$bin" simulate --workload tenants --users "$apps" --turns 10 --conversations 100 \
          --shared-tokens 3000 --user-tokens 800 --length-cv 0.5 --output-tokens 60 --think-s 0.3 \
          $load --seed "$seed" --num-gpu-blocks "$blocks" \
          --policy round-robin,least-load,prefix-hash,precise --out "$out/$tag" >"$out/$tag.txt" 2>&1
      done
    done
  done
done
