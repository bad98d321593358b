"""Write deploy/k8s/prometheus-rule.yaml: the alert rules of deploy/prometheus/agent-server.rules.yaml (the one
source) as a PrometheusRule for the Prometheus Operator, comments included.

    python scripts/gen_prometheus_rule.py            # after editing the rules file
    python scripts/gen_prometheus_rule.py --check    # exit 1 when the PrometheusRule is not what this writes

A plain rules file is `groups: [...]` and a PrometheusRule's spec is the same `groups: [...]`, so the rules
file's body goes under `spec:` as it is. tests/deploy/test_monitoring.py runs `--check`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "agent-server.rules.yaml"
PROMETHEUS_RULE = REPO / "deploy" / "k8s" / "prometheus-rule.yaml"

HEADER = """\
# Written by scripts/gen_prometheus_rule.py from deploy/prometheus/agent-server.rules.yaml: edit that file, then
# run the script (tests/deploy/test_monitoring.py fails while the two differ). Needs the Prometheus Operator's
# CRDs; its Prometheus picks rules up by its ruleSelector: give this the label it selects (for
# kube-prometheus-stack, `release: <its release name>`).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: agent-server
  labels: {app.kubernetes.io/name: agent-server}
spec:
"""


def prometheus_rule(rules_text: str) -> str:
    """The PrometheusRule for a rules file's text: its lines from `groups:` on, indented under `spec:`."""
    lines = rules_text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("groups:")]
    if len(starts) != 1:
        raise ValueError("the rules file must have one top-level `groups:`")
    body = lines[starts[0]:]
    return HEADER + "".join(f"  {line}\n" if line.strip() else "\n" for line in body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    wanted = prometheus_rule(RULES.read_text())
    if args.check:
        if not PROMETHEUS_RULE.is_file() or PROMETHEUS_RULE.read_text() != wanted:
            print(f"{PROMETHEUS_RULE.relative_to(REPO)} differs from {RULES.relative_to(REPO)}: run "
                  "python scripts/gen_prometheus_rule.py", file=sys.stderr)
            return 1
        return 0
    PROMETHEUS_RULE.write_text(wanted)
    print(f"wrote {PROMETHEUS_RULE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
