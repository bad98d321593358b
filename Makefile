# The two commands a newcomer needs (see README): `make serve` and `make test`. Both install first.
ARGS ?=
.PHONY: install browser-deps scale-deps serve test

install:
	@bash scripts/install.sh

# Debian chromium for tests/browser (needs root for apt-get; without it those tests skip, or fail under CI=true)
browser-deps: install
	@bash scripts/ci_browser_deps.sh || echo "warning: could not install chromium; browser tests will not run" >&2

# Debian redis-server and haproxy for the multi-replica tests (root for apt-get; without: skip, or fail under CI=true)
scale-deps: install
	@bash scripts/ci_scale_deps.sh || echo "warning: could not install redis-server/haproxy; multi-replica tests will not run" >&2

serve: install
	.venv/bin/agent-server $(ARGS)

test: browser-deps scale-deps
	.venv/bin/python -m pytest -q
