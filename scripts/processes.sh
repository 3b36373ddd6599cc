# Shared by the measurement scripts (source it): background processes stopped on exit, and
# waiting for an HTTP server to answer.
#
#   pids+=($!)                 # after starting a process in the background: stopped on exit
#   wait_http URL [TRIES]      # 0.1 s apart (default 100)
#   plain_envoy_yaml LISTEN ADMIN PORT...   # Envoy round-robin over 127.0.0.1:PORT...

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

# An Envoy configuration: a listener on 127.0.0.1:LISTEN (admin on ADMIN) balancing round robin
# over 127.0.0.1:PORT...; $ENVOY_ACCESS_LOG, if set, is inserted into the connection manager
# (an `access_log:` block indented 16 spaces).
plain_envoy_yaml() { # listen admin port...
  local listen=$1 admin=$2
  shift 2
  cat <<EOF
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: $admin}}
static_resources:
  listeners:
    - name: openai
      address: {socket_address: {address: 127.0.0.1, port_value: $listen}}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: openai
${ENVOY_ACCESS_LOG:-}
                route_config:
                  virtual_hosts:
                    - name: upstream
                      domains: ["*"]
                      routes:
                        - match: {prefix: "/"}
                          route: {cluster: upstream, timeout: 600s}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: upstream
      type: STATIC
      lb_policy: ROUND_ROBIN
      connect_timeout: 1s
      load_assignment:
        cluster_name: upstream
        endpoints:
          - lb_endpoints:
EOF
  for port in "$@"; do
    echo "              - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $port}}}"
  done
}
