#!/usr/bin/env bash
# A live smoke run of router-orchestrated P/D (docs/benchmarks-log.md, "Live P/D through kvroute
# serve"): `kvroute sim` engines, `kvroute serve` with `pd:`, and `kvroute bench`, one fleet at a
# time on ports 18000-18404: aggregated (4 engines), always-P/D and cost-decided P/D on 2
# prefill + 2 decode engines over ib-400, and cost-decided P/D on 4 kv_both engines.
#
# usage: scripts/pd-live-smoke.sh KVROUTE_BINARY OUT_DIR
set -u
K=$1
out=$2; mkdir -p "$out"
W="--workload tenants --users 30 --conversations 60 --turns 2 --shared-tokens 1500 --length-cv 1.5 --user-tokens 150 --output-tokens 64 --rate 3"
# Waits (up to 30 s) until GET $1/health answers 200.
wait_up() { for _ in $(seq 150); do curl -sf "$1/health" >/dev/null && return; sleep 0.2; done; echo "$1 never came up" >&2; exit 1; }
run() { # name, sim flags, pd yaml
  name=$1 simflags=$2 pd=$3
  $K sim $simflags --num-gpu-blocks 20000 --port 18101 --events-port 18201 --replay-port 18301 --side-channel-port 18401 >/dev/null 2>&1 &
  sim=$!
  for i in 0 1 2 3; do wait_up http://127.0.0.1:$((18101+i)); done
  eps=""
  for i in 0 1 2 3; do
    role=both
    case "$simflags" in *prefill-engines*) [ $i -lt 2 ] && role=prefill || role=decode ;; esac
    eps="$eps  - {name: e$i, role: $role, url: 'http://127.0.0.1:$((18101+i))', events: 'tcp://127.0.0.1:$((18201+i))', replay: 'tcp://127.0.0.1:$((18301+i))'}\n"
  done
  printf "listen: 127.0.0.1:18000\nadmin: {listen: 127.0.0.1:18090}\nmodels: [{name: sim-llama-3.1-8b}]\npd: $pd\nendpoints:\n$eps" > "$out/$name".yaml
  $K serve -c "$out/$name".yaml >/dev/null 2>"$out/$name".log &
  srv=$!
  wait_up http://127.0.0.1:18000
  $K bench --url http://127.0.0.1:18000/v1 --name $name --out "$out" $W --seed 1 > "$out/$name".txt 2>&1
  curl -s http://127.0.0.1:18090/metrics | grep "kvroute_pd_decisions_total\|kvroute_pd_fallbacks_total" > "$out/$name".pd
  kill $srv $sim; wait $srv $sim 2>/dev/null
}
run aggregated "--engines 4" "{mode: 'off'}"
run always-ib400 "--prefill-engines 2 --decode-engines 2 --kv-link ib-400" "{mode: always, link: ib-400}"
run cost-ib400 "--prefill-engines 2 --decode-engines 2 --kv-link ib-400" "{mode: orchestrate, link: ib-400}"
run cost-both-ib400 "--engines 4 --kv-role both --kv-link ib-400" "{mode: orchestrate, link: ib-400}"
echo done
