"""Helpers of scripts/epp-vs-serve.sh.

  envoy_epp_modes.py streamed|headers|none < envoy.yaml > envoy.yaml
      The picker's ext_proc filter alone (the observer filter removed), its response modes
      set: `streamed` (response headers and every body chunk through the picker, each waited
      for), `headers` (response headers only, no body), `none` (nothing of the response).
  envoy_epp_modes.py summary < access.log
      Median and p90 of each timing field of Envoy's JSON access log lines.
"""

import json
import re
import statistics
import sys

MODES = {
    "streamed": ("SEND", "STREAMED"),
    "headers": ("SEND", "NONE"),
    "none": ("SKIP", "NONE"),
}


def set_modes(text: str, mode: str) -> str:
    """The picker's filter (the first ext_proc filter) with `mode`, the observer filter gone."""
    header, body = MODES[mode]
    observer = re.search(r"\n( *)- name: kvroute\.observe\n", text)
    if observer:
        indent = observer.group(1)
        end = re.compile(rf"\n{indent}- name: ").search(text, observer.end())
        text = text[: observer.start()] + text[end.start() :]
        # Its comment block above it goes too.
        text = re.sub(r"(\n *# [^\n]*)+(?=\n *- name: envoy\.filters\.http\.router)", "", text)
    # The first setting of each (not a comment naming it).
    header_mode = re.compile(r"^( *)response_header_mode: \w+", re.M)
    body_mode = re.compile(r"^( *)response_body_mode: \w+", re.M)
    text = header_mode.sub(rf"\1response_header_mode: {header}", text, count=1)
    return body_mode.sub(rf"\1response_body_mode: {body}", text, count=1)


def summary(lines) -> str:
    fields: dict[str, list[float]] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        for key, value in entry.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            fields.setdefault(key, []).append(number)
    out = []
    for key, values in fields.items():
        values.sort()
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        out.append(
            f"{key:28} median {statistics.median(values):10.1f}  p90 {p90:10.1f}  (n={len(values)})"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    command = sys.argv[1]
    if command == "summary":
        sys.stdout.write(summary(sys.stdin))
    else:
        sys.stdout.write(set_modes(sys.stdin.read(), command))


if __name__ == "__main__":
    main()
