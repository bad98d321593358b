# The two commands a newcomer needs (see README): `make serve` and `make test`. Both install first.
ARGS ?=
.PHONY: install browser-deps scale-deps monitoring-deps serve test lint

install:
	@bash scripts/install.sh

# Debian chromium for tests/browser (needs root for apt-get; without it those tests skip, or fail under CI=true)
browser-deps: install
	@bash scripts/ci_browser_deps.sh || echo "warning: could not install chromium; browser tests will not run" >&2

# Debian redis-server and haproxy for the multi-replica tests (root for apt-get; without: skip, or fail under CI=true)
scale-deps: install
	@bash scripts/ci_scale_deps.sh || echo "warning: could not install redis-server/haproxy; multi-replica tests will not run" >&2

# Debian prometheus for promtool: deploy/'s alert rules and their unit tests (root for apt-get; without: skip, or fail under CI=true)
monitoring-deps: install
	@bash scripts/ci_monitoring_deps.sh || echo "warning: could not install promtool; alert rule tests will not run" >&2

serve: install
	.venv/bin/agent-server $(ARGS)

# the gates first (zero findings: mypy --strict and ruff, configured in pyproject.toml), then the suite
test: browser-deps scale-deps monitoring-deps lint
	.venv/bin/python -m pytest -q

lint: install
	.venv/bin/python -m mypy
	.venv/bin/python -m ruff check agent_server synth scripts tests/agent_server tests/synth tests/browser tests/conftest.py \
		tests/deploy tests/services.py tests/test_layering.py tests/test_docs.py tests/test_architecture_doc.py tests/test_gpu_check.py
