# The two commands a newcomer needs (see README): `make serve` and `make test`. Both install first.
ARGS ?=
.PHONY: install serve test

install:
	@bash scripts/install.sh

serve: install
	.venv/bin/agent-server $(ARGS)

test: install
	.venv/bin/python -m pytest -q
