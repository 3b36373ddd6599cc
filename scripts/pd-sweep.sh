#!/usr/bin/env bash
# The first P/D sweep on `kvroute simulate` (docs/benchmarks.md, "Prefill/decode
# disaggregation"): aggregated (4 engines, precise routing) against always-P/D (2 prefill +
# 2 decode engines) and cost-decided P/D (on 4 kv_both engines, and on 2 prefill + 2 decode
# engines), over tcp, roce-100 and ib-400,
# for Llama-3.1-8B and -70B, on 8k-token prompts, the demo's multi-turn chat, and a mixed
# workload (mostly short prompts, some long documents).
#
# usage: scripts/pd-sweep.sh KVROUTE_BINARY OUT_DIR [SEEDS] [CONFIGS]
#   SEEDS: default "1"; CONFIGS: which fleets, default "aggregated always cost costsplit"
#   PD_MODELS (environment): which models, default "8b 70b"
set -euo pipefail
kvroute=$1 out=$2 seeds=${3:-1} configs=${4:-aggregated always cost costsplit}
want() { [[ " $configs " == *" $1 "* ]]; }
mkdir -p "$out"

# Llama-3.1-8B on one H100 is the simulator's default model. Llama-3.1-70B on 4 H100s (TP 4):
# 2 x 70e9 FLOP per prompt token at half of 4 x 989 TFLOP/s = 70 us; each step streams 140 GB
# of weights over 4 x 3.35 TB/s = 10.4 ms; 320 KiB of KV per context token over 13.4 TB/s.
model_flags() {
  case $1 in
    8b) echo "--kv-bytes-per-token llama-3.1-8b" ;;
    70b) echo "--kv-bytes-per-token llama-3.1-70b --prefill-per-token-s 70e-6 --step-overhead-s 0.0104 --decode-per-context-token-s 24e-9" ;;
  esac
}
workload_flags() {
  case $1 in
    long8k) echo "--workload tenants --users 400 --conversations 100 --turns 1 --shared-tokens 8000 --user-tokens 192 --output-tokens 256 --rate $2" ;;
    multiturn) echo "--workload multi-turn --users 16 --turns 5 --shared-tokens 1500 --user-tokens 150 --output-tokens 128 --rate $2" ;;
    mixed) echo "--workload tenants --users 60 --conversations 120 --turns 2 --shared-tokens 1500 --length-cv 1.5 --user-tokens 150 --output-tokens 128 --rate $2" ;;
  esac
}
rate() { # sessions per second, loading the 4 engines without overrunning them
  case $1/$2 in
    8b/long8k) echo 4 ;; 70b/long8k) echo 1.5 ;;
    8b/multiturn) echo 2 ;; 70b/multiturn) echo 1 ;;
    8b/mixed) echo 4 ;; 70b/mixed) echo 1.5 ;;
  esac
}
common="--num-gpu-blocks 20000 --max-model-len 32768"
for seed in $seeds; do
  for model in ${PD_MODELS:-8b 70b}; do
    for wl in long8k multiturn mixed; do
      w=$(workload_flags $wl "$(rate $model $wl)")
      m=$(model_flags $model)
      dir=$out/$model-$wl-s$seed
      want aggregated && "$kvroute" simulate --engines 4 --policy precise $m $w $common --seed "$seed" --out "$dir-aggregated" >/dev/null
      for link in tcp roce-100 ib-400; do
        want always && "$kvroute" simulate --prefill-engines 2 --decode-engines 2 --kv-link $link --policy pd-always $m $w $common --seed "$seed" --out "$dir-always-$link" >/dev/null
        want cost && "$kvroute" simulate --engines 4 --kv-role both --kv-link $link --policy pd-cost $m $w $common --seed "$seed" --out "$dir-cost-$link" >/dev/null
        want costsplit && "$kvroute" simulate --prefill-engines 2 --decode-engines 2 --kv-link $link --policy pd-cost $m $w $common --seed "$seed" --out "$dir-costsplit-$link" >/dev/null
      done
      echo "done $model $wl seed $seed"
    done
  done
done
