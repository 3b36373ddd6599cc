# Shared by the measurement scripts (source it): background processes stopped on exit, and
# waiting for an HTTP server to answer.
#
#   pids+=($!)                 # after starting a process in the background: stopped on exit
#   wait_http URL [TRIES]      # 0.1 s apart (default 100)

pids=()
cleanup() {
  for p in "${pids[@]:-}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]:-}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
trap cleanup EXIT

wait_http() {
  for _ in $(seq 1 "${2:-100}"); do
    curl -sf "$1" >/dev/null && return 0
    sleep 0.1
  done
  echo "no answer from $1" >&2
  return 1
}
