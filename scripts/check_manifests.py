"""Validate rendered Kubernetes manifests (the output of `helm template`).

Usage:
  check_manifests.py [--kube-version V]... [--crds DIR] FILE...
  check_manifests.py --self-test [--kube-version V]... [--crds DIR] FILE

Built-in kinds are checked with the `kubernetes-validate` package's strict schemas (unknown
fields are errors, as with `kubectl apply`'s default strict field validation), once per
Kubernetes version given. Custom resources are checked against the `openAPIV3Schema` of their
CRD in DIR (the vendored CRDs under deploy/crds), made strict the same way; the CRDs' CEL rules
(`x-kubernetes-validations`) are not evaluated. A kind with neither a built-in schema nor a CRD
is an error. Configuration carried as text is parsed too: `*.yaml` keys of ConfigMaps and
Secrets as YAML, `*.json` keys as JSON. The references between the objects are checked
(selectors, named ports, volumes, the pool's picker Service), and so is the router's way to
its replica peers (`replicas.kubernetes`: a selector of the router pods only, their admin port,
a Role that lets it list and watch pods).

--self-test takes one valid rendered FILE, checks that it passes, then breaks it in ways the
checks must catch (a port given as a name where a number is needed, an unknown field, a bad
InferencePool, ...) and fails unless every broken copy is rejected.
"""

import argparse
import copy
import functools
import json
import re
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import yaml

# kubernetes-validate reads its (large) definitions file for every object; read each once.
kv_utils.schema_contents = functools.lru_cache(maxsize=None)(kv_utils.schema_contents)

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def openapi_to_jsonschema(node):
    """A CRD's structural OpenAPI v3 schema as JSON Schema, strict about unknown fields."""
    if isinstance(node, list):
        return [openapi_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "definitions"):
            out[key] = {k: openapi_to_jsonschema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not", "allOf", "anyOf", "oneOf"):
            out[key] = openapi_to_jsonschema(value)
        elif key.startswith("x-kubernetes-") or key in ("nullable", "description", "default", "example"):
            continue
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        node.get("type") == "object"
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def load_crds(directory):
    """{(apiVersion, kind): JSON Schema} for every served version of every CRD in directory."""
    schemas = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                schema = openapi_to_jsonschema(version["schema"]["openAPIV3Schema"])
                schema.setdefault("required", [])
                api_version = f"{spec['group']}/{version['name']}"
                schemas[(api_version, spec["names"]["kind"])] = schema
    return schemas


def name_of(doc):
    return f"{doc.get('kind', '?')}/{(doc.get('metadata') or {}).get('name', '?')}"


def check_embedded(doc):
    """Errors in the configuration files a ConfigMap or Secret carries as text."""
    errors = []
    if doc.get("kind") not in ("ConfigMap", "Secret"):
        return errors
    for field in ("data", "stringData"):
        if doc.get("kind") == "Secret" and field == "data":
            continue  # base64
        for key, text in (doc.get(field) or {}).items():
            try:
                if key.endswith((".yaml", ".yml")):
                    if not isinstance(yaml.safe_load(text), dict):
                        errors.append(f"{field}.{key}: not a YAML mapping")
                elif key.endswith(".json"):
                    json.loads(text)
            except (yaml.YAMLError, ValueError) as e:
                errors.append(f"{field}.{key}: does not parse: {e}")
    return errors


def check(doc, versions, crds):
    """Every error in one manifest, as strings."""
    errors = []
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (no apiVersion/kind)"]
    name = (doc.get("metadata") or {}).get("name", "")
    if not (isinstance(name, str) and len(name) <= 253 and DNS_SUBDOMAIN.match(name)):
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    key = (doc["apiVersion"], doc["kind"])
    if key in crds:
        validator = jsonschema.Draft7Validator(crds[key])
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.path)):
            path = ".".join(str(p) for p in e.path)
            errors.append(f"CRD schema: {path}: {e.message}")
    else:
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                errors.append(f"Kubernetes {version}: {path}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{e.message} (and no CRD for it under --crds)")
    if doc["kind"] == "Service" and doc.get("spec", {}).get("type", "ClusterIP") not in SERVICE_TYPES:
        errors.append(f"spec.type {doc['spec']['type']!r} is not one of {', '.join(SERVICE_TYPES)}")
    errors.extend(check_ports(doc.get("spec")))
    errors.extend(check_embedded(doc))
    return errors


IANA_SVC_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]([a-z0-9]|-(?=[a-z0-9]))*$")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")


def check_ports(node, path=""):
    """API-server rules the schemas do not carry: port numbers in range, port names valid."""
    errors = []
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}.{key}" if path else key
            if key in ("containerPort", "port", "targetPort", "number", "hostPort") and isinstance(value, int):
                if not 1 <= value <= 65535 and not (key == "hostPort" and value == 0):
                    errors.append(f"{here}: port {value} is not in 1..65535")
            elif key in ("targetPort", "port") and isinstance(value, str) and ".ports." in f".{here}.":
                if not IANA_SVC_NAME.match(value):
                    errors.append(f"{here}: {value!r} is not a valid port name")
            elif key == "name" and re.search(r"(^|\.)ports\.\d+$", path):
                if not IANA_SVC_NAME.match(str(value)):
                    errors.append(f"{here}: {value!r} is not a valid port name")
            errors.extend(check_ports(value, here))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            errors.extend(check_ports(value, f"{path}.{i}"))
    return errors


def pod_templates(docs):
    """(workload, pod template) for every Deployment, StatefulSet and DaemonSet."""
    for doc in docs:
        if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet"):
            yield doc, doc["spec"]["template"]


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_references(docs):
    """Errors in how the rendered objects refer to each other: selectors that select nothing
    of this release, named ports no container has, volumes, secrets and accounts that do not
    exist."""
    errors = []
    by_kind = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    templates = list(pod_templates(docs))
    for workload, template in templates:
        where = name_of(workload)
        labels = template["metadata"].get("labels") or {}
        if not selects(workload["spec"]["selector"].get("matchLabels"), labels):
            errors.append(f"{where}: spec.selector does not match the pod template's labels")
        spec = template["spec"]
        account = spec.get("serviceAccountName")
        if account and account not in by_kind.get("ServiceAccount", {}):
            errors.append(f"{where}: serviceAccountName {account!r} is not rendered")
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for volume in volumes.values():
            for kind, field, ref in (("Secret", "secret", "secretName"), ("ConfigMap", "configMap", "name")):
                name = (volume.get(field) or {}).get(ref)
                if name and name not in by_kind.get(kind, {}):
                    errors.append(f"{where}: volume {volume['name']!r} refers to a {kind} {name!r} that is not rendered")
        for c in spec["containers"]:
            ports = {p.get("name") for p in c.get("ports") or []}
            for mount in c.get("volumeMounts") or []:
                if mount["name"] not in volumes:
                    errors.append(f"{where}: container {c['name']!r} mounts an unknown volume {mount['name']!r}")
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                for handler in ("httpGet", "tcpSocket"):
                    port = ((c.get(probe) or {}).get(handler) or {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        errors.append(f"{where}: container {c['name']!r} {probe} uses a port name it does not have: {port!r}")
    for service in by_kind.get("Service", {}).values():
        selector = service["spec"].get("selector") or {}
        if "app.kubernetes.io/instance" not in selector:
            continue  # selects pods this chart does not run (the engines)
        matched = [t for _, t in templates if selects(selector, t["metadata"].get("labels") or {})]
        if not matched:
            errors.append(f"{name_of(service)}: its selector matches no pod template")
        names = {p.get("name") for t in matched for c in t["spec"]["containers"] for p in c.get("ports") or []}
        for port in service["spec"]["ports"]:
            if isinstance(port.get("targetPort"), str) and port["targetPort"] not in names:
                errors.append(f"{name_of(service)}: targetPort {port['targetPort']!r} is no container port name")
    for pdb in by_kind.get("PodDisruptionBudget", {}).values():
        selector = pdb["spec"]["selector"].get("matchLabels")
        if not any(selects(selector, t["metadata"].get("labels") or {}) for _, t in templates):
            errors.append(f"{name_of(pdb)}: its selector matches no pod template")
    for monitor in by_kind.get("ServiceMonitor", {}).values():
        selector = monitor["spec"]["selector"].get("matchLabels")
        services = [s for s in by_kind.get("Service", {}).values() if selects(selector, s["metadata"].get("labels") or {})]
        if not services:
            errors.append(f"{name_of(monitor)}: its selector matches no Service")
        port_names = {p.get("name") for s in services for p in s["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            if not isinstance(endpoint.get("port"), str) or endpoint["port"] not in port_names:
                errors.append(f"{name_of(monitor)}: port {endpoint.get('port')!r} is no port of the Services it selects")
            secret = ((endpoint.get("authorization") or {}).get("credentials") or {})
            if secret and secret.get("key") not in (by_kind.get("Secret", {}).get(secret.get("name")) or {}).get("stringData", {}):
                errors.append(f"{name_of(monitor)}: credentials {secret} are not in a rendered Secret")
    errors.extend(check_replica_peers(by_kind, templates))
    for pool in by_kind.get("InferencePool", {}).values():
        ref = pool["spec"].get("endpointPickerRef") or {}
        service = by_kind.get("Service", {}).get(ref.get("name"))
        if ref.get("kind", "Service") == "Service" and ref.get("name") and service is None:
            errors.append(f"{name_of(pool)}: endpointPickerRef names a Service that is not rendered")
        elif service is not None:
            number = (ref.get("port") or {}).get("number")
            if number not in [p["port"] for p in service["spec"]["ports"]]:
                errors.append(f"{name_of(pool)}: endpointPickerRef port {number} is no port of {name_of(service)}")
    return errors


def router_configs(by_kind):
    """(Secret or ConfigMap, parsed kvroute.yaml) for every rendered router configuration."""
    for kind, field in (("Secret", "stringData"), ("ConfigMap", "data")):
        for doc in by_kind.get(kind, {}).values():
            text = (doc.get(field) or {}).get("kvroute.yaml")
            if text:
                yield doc, yaml.safe_load(text) or {}


def check_replica_peers(by_kind, templates):
    """Errors in how router replicas find each other (`replicas.kubernetes`): the selector must
    select this release's router pods, which must expose the admin port, and the Role must let
    the router list and watch pods."""
    errors = []
    for doc, config in router_configs(by_kind):
        peers = (config.get("replicas") or {}).get("kubernetes")
        if not peers:
            continue
        where = name_of(doc)
        selector = peers.get("selector") or {}
        selected = [t for _, t in templates if selects(selector, t["metadata"].get("labels") or {})]
        routers = [t for t in selected if any(c["name"] == "kvroute" for c in t["spec"]["containers"])]
        if not routers:
            errors.append(f"{where}: replicas.kubernetes.selector {selector} matches no router pod template")
        if len(routers) < len(selected):
            errors.append(f"{where}: replicas.kubernetes.selector {selector} also selects pods that are not routers")
        ports = {p.get("containerPort") for t in routers for c in t["spec"]["containers"] for p in c.get("ports") or []}
        if routers and peers.get("admin_port") not in ports:
            errors.append(f"{where}: replicas.kubernetes.admin_port {peers.get('admin_port')} is no port of the router pods")
        admin = (config.get("admin") or {}).get("listen", "")
        if not str(admin).endswith(f":{peers.get('admin_port')}"):
            errors.append(f"{where}: replicas.kubernetes.admin_port {peers.get('admin_port')} is not admin.listen's port ({admin})")
        granted = {
            verb
            for role in by_kind.get("Role", {}).values()
            for rule in role.get("rules") or []
            if "" in (rule.get("apiGroups") or []) and "pods" in (rule.get("resources") or [])
            for verb in rule.get("verbs") or []
        }
        if not {"list", "watch"} <= granted:
            errors.append(f"{where}: replicas.kubernetes needs a Role granting list and watch on pods")
    return errors


def documents(path):
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    return [d for d in yaml.safe_load_all(text) if d is not None]


def validate_files(paths, versions, crds, quiet=False):
    failures, count = 0, 0
    for path in paths:
        docs = documents(path)
        for doc in docs:
            count += 1
            errors = check(doc, versions, crds)
            for error in errors:
                print(f"ERROR {path}: {name_of(doc)}: {error}")
            failures += bool(errors)
        if failures == 0:
            for error in check_references(docs):
                print(f"ERROR {path}: {error}")
                failures += 1
    if not quiet:
        print(f"{count - failures} of {count} manifests valid ({', '.join(Path(p).name for p in paths)})")
    return failures == 0 and count > 0


def first(docs, kind):
    for doc in docs:
        if doc.get("kind") == kind:
            return doc
    raise SystemExit(f"self-test: the rendered file has no {kind}")


def breakages(docs):
    """(what, broken copy of docs) pairs that a working validator must reject."""

    def broken(what, change):
        copied = copy.deepcopy(docs)
        change(copied)
        return what, copied

    def ours(d, kind):
        """The first object of `kind` that selects this release's own pods."""
        for doc in d:
            if doc.get("kind") == kind and "app.kubernetes.io/instance" in (doc["spec"].get("selector") or {}):
                return doc
        raise SystemExit(f"self-test: the rendered file has no {kind} of the release's pods")

    def container(d):
        return first(d, "Deployment")["spec"]["template"]["spec"]["containers"][0]

    yield broken("containerPort given as a name", lambda d: container(d)["ports"][0].update(containerPort="http"))
    yield broken("Service port out of range", lambda d: first(d, "Service")["spec"]["ports"][0].update(port=70000))
    yield broken("Service type misspelt", lambda d: first(d, "Service")["spec"].update(type="Loadbalancer"))
    yield broken(
        "Service targetPort names no container port",
        lambda d: ours(d, "Service")["spec"]["ports"][0].update(targetPort="htpp"),
    )
    yield broken(
        "probe on a port name the container lacks",
        lambda d: container(d)["readinessProbe"].update(httpGet={"path": "/health", "port": "web"}),
    )
    yield broken(
        "InferencePool picker port not on the picker's Service",
        lambda d: first(d, "InferencePool")["spec"]["endpointPickerRef"]["port"].update(number=9003),
    )
    yield broken("unknown field in a container", lambda d: container(d).update(readinesProbe={}))
    yield broken("replicas as text", lambda d: first(d, "Deployment")["spec"].update(replicas="two"))
    yield broken("Role verbs not a list", lambda d: first(d, "Role")["rules"][0].update(verbs="get"))
    yield broken("name not a DNS subdomain", lambda d: first(d, "ConfigMap")["metadata"].update(name="Kv_Route"))
    yield broken(
        "malformed YAML in a ConfigMap",
        lambda d: first(d, "ConfigMap")["data"].update({"envoy.yaml": "admin: [unclosed"}),
    )
    yield broken(
        "InferencePool target port as a name",
        lambda d: first(d, "InferencePool")["spec"]["targetPorts"][0].update(number="http"),
    )
    yield broken(
        "InferencePool failureMode not in the enum",
        lambda d: first(d, "InferencePool")["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
    )
    yield broken("InferencePool without targetPorts", lambda d: first(d, "InferencePool")["spec"].pop("targetPorts"))
    yield broken(
        "unknown field in an InferencePool (v1alpha2's targetPortNumber)",
        lambda d: first(d, "InferencePool")["spec"].update(targetPortNumber=8000),
    )
    def peer_config(d, change):
        secret = next(doc for doc in d if doc.get("kind") == "Secret" and "kvroute.yaml" in (doc.get("stringData") or {}))
        config = yaml.safe_load(secret["stringData"]["kvroute.yaml"])
        if not (config.get("replicas") or {}).get("kubernetes"):
            raise SystemExit("self-test: the rendered router configuration has no replicas.kubernetes (render with replicas > 1)")
        change(config["replicas"]["kubernetes"])
        secret["stringData"]["kvroute.yaml"] = yaml.safe_dump(config)

    yield broken(
        "replica peers selected by labels no router pod has",
        lambda d: peer_config(d, lambda k: k["selector"].update({"app.kubernetes.io/name": "kvroute-sim"})),
    )
    yield broken("replica peers on a port the router pods lack", lambda d: peer_config(d, lambda k: k.update(admin_port=9999)))
    yield broken(
        "ServiceMonitor endpoint port as a list",
        lambda d: first(d, "ServiceMonitor")["spec"]["endpoints"][0].update(port=["admin"]),
    )


def self_test(path, versions, crds):
    docs = documents(path)
    ok = True
    for doc in docs:
        errors = check(doc, versions, crds)
        if errors:
            ok = False
            print(f"self-test: the valid input fails: {name_of(doc)}: {errors}")
    for error in check_references(docs):
        ok = False
        print(f"self-test: the valid input fails: {error}")
    for what, broken in breakages(docs):
        rejected = [e for doc in broken for e in check(doc, versions, crds)] + check_references(broken)
        if rejected:
            print(f"self-test: rejected as it must be: {what}: {rejected[0].splitlines()[0]}")
        else:
            ok = False
            print(f"self-test: NOT REJECTED: {what}")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--kube-version", action="append", dest="versions")
    parser.add_argument("--crds", default=str(Path(__file__).resolve().parent.parent / "deploy" / "crds"))
    parser.add_argument("--self-test", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    versions = args.versions or [kv_utils.latest_version()]
    crds = load_crds(args.crds)
    if not crds:
        raise SystemExit(f"no CRDs under {args.crds}")
    if args.self_test:
        ok = self_test(args.files[0], versions, crds)
    else:
        ok = validate_files(args.files, versions, crds, args.quiet)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
