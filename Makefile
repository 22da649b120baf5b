# The two entry points the README promises. Both bootstrap .venv themselves.
.PHONY: demo test lint clean

demo:
	scripts/bootstrap.sh
	scripts/demo.sh $(if $(KEEP),--keep)

test:
	scripts/bootstrap.sh --test
	.venv/bin/python -m pytest

lint:
	scripts/bootstrap.sh --test
	.venv/bin/ruff check .

# Remove what the commands above made: the virtualenv and demo leftovers of earlier runs.
clean:
	rm -rf .venv
	rm -rf "$${TMPDIR:-/tmp}"/shmstage-demo.*
