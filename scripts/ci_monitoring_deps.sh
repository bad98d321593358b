#!/usr/bin/env bash
# What the monitoring tests (tests/deploy/test_monitoring.py) need: `promtool` from Debian's prometheus
# package, to check deploy/'s alert rules and run their unit tests offline. The Prometheus server in the same
# package is never started (policy-rc.d below). Idempotent, and quick when promtool is there. Needs root for
# apt-get (CI runs as root); without it those tests skip, or fail under CI=true.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v promtool >/dev/null 2>&1; then
    echo "installing Debian prometheus (promtool, for the alert rule tests)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d: install without starting the Prometheus server as a system service
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi
fi
