#!/usr/bin/env bash
# What the multi-replica tests (tests/deploy/test_cluster.py, tests/agent_server/fleet/test_shared_state.py, ...) need:
# Debian's redis-server and haproxy, run by the tests themselves on free loopback ports (never as services).
# Idempotent, and quick when both are there. Needs root for apt-get (CI runs as root); without them those
# tests skip, or fail under CI=true.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing Debian ${missing[*]} (multi-replica tests)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d: install the programs without starting them as system services (the tests start their own)
    policy=/usr/sbin/policy-rc.d
    created_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && created_policy=1
    fi
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends redis-server haproxy >/dev/null
    if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi
fi
