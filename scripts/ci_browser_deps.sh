#!/usr/bin/env bash
# What the browser tests (tests/browser/) need: Debian's chromium and the playwright Python package.
# Playwright only drives the browser here (executable_path=/usr/bin/chromium); it never downloads one.
# Idempotent, and quick when both are already there. Needs root for apt-get (CI runs as root).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}

if [ ! -x "$CHROMIUM" ]; then
    echo "installing Debian chromium (browser tests)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi

# (pyproject's `test` extra lists playwright too, so scripts/install.sh brings it; this covers a venv made before)
if [ -x "$PYTHON" ] && ! "$PYTHON" -c "import playwright.sync_api" >/dev/null 2>&1; then
    echo "installing playwright (Python package only; the browser is Debian's)" >&2
    "$PYTHON" -m pip install --disable-pip-version-check -q 'playwright>=1.45' 2> >(grep -v "^WARNING: Location" >&2)
fi
