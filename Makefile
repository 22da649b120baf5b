# The two entry points the README promises. Both bootstrap .venv themselves.
.PHONY: demo test lint bench

demo:
	scripts/bootstrap.sh
	scripts/demo.sh

test:
	scripts/bootstrap.sh --test
	.venv/bin/python -m pytest

lint:
	scripts/bootstrap.sh --test
	.venv/bin/ruff check .
