"""Run the kvroute commands a rendered chart would run, with the binary built here.

Usage: check_chart_commands.py KVROUTE RENDERED.yaml...

For each render: the router container's exact arguments (`serve` or `epp`, with the
configuration from the chart's Secret, its flags), with no cluster to reach, must get as far
as creating the Kubernetes client, that is past parsing the flags and every check of the
configuration; the sim demo fleet's `kvroute sim` arguments (ports moved to free ones, on
loopback) must start engines. Exits non-zero on the first command that does not.
"""

import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading

import yaml

NO_CLUSTER = "discovery: no Kubernetes client"


def run_until(argv, marker, seconds):
    """Runs `argv` until a line containing `marker` is printed, the process exits, or `seconds`
    pass, whichever comes first; then stops it. Returns (exit code, or None if it was still
    running, output so far, whether the marker was seen)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = "/nonexistent"
    lines = []
    seen = threading.Event()
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:

        def read():
            for line in p.stdout:
                lines.append(line)
                if marker in line:
                    seen.set()
            seen.set()  # end of output: the process exited

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        seen.wait(seconds)
        code = p.poll()
        if code is None:
            p.kill()
            p.wait()
        reader.join(5)
        out = "".join(lines)
        return code, out, marker in out


def check(kvroute, render, scratch):
    docs = [d for d in yaml.safe_load_all(pathlib.Path(render).read_text()) if d]
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-config"))
    name = secret["metadata"]["name"][: -len("-config")]
    config = scratch / f"{pathlib.Path(render).stem}.yaml"
    config.write_text(secret["stringData"]["kvroute.yaml"])
    failures = []
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = [str(a) for a in container["args"]]
        if deployment["metadata"]["name"] == name:
            args = [str(config) if a == "/etc/kvroute/kvroute.yaml" else a for a in args]
            args = ["127.0.0.1:0" if a.startswith("0.0.0.0:") else a for a in args]
            code, out, reached = run_until([kvroute, *args], NO_CLUSTER, 30)
            if not reached:
                failures.append(f"kvroute {' '.join(args)} (exit {code}):\n{out[-2000:]}")
        elif args[0] == "sim":
            args = [re.sub(r"^--(port|events-port|replay-port)=\d+$", r"--\1=0", a) for a in args]
            args = [a.replace("--host=0.0.0.0", "--host=127.0.0.1") for a in args]
            code, out, started = run_until([kvroute, *args], "engine 0", 30)
            if not started or code not in (None, 0):
                failures.append(f"kvroute {' '.join(args)} did not start (exit {code}):\n{out[-2000:]}")
    return failures


def main():
    kvroute, renders = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as scratch:
        failures = [f"{r}: {f}" for r in renders for f in check(kvroute, r, pathlib.Path(scratch))]
    for failure in failures:
        print(f"ERROR {failure}")
    if failures:
        sys.exit(1)
    print(f"kvroute runs the commands of {len(renders)} renders (router flags and configuration, sim fleet)")


if __name__ == "__main__":
    main()
