# The two entry points the README promises. Both bootstrap .venv themselves.
.PHONY: demo test lint clean

demo:
	scripts/bootstrap.sh
	scripts/demo.sh $(if $(KEEP),--keep)

# Two workers: most tests wait on real daemons and subprocesses, so two halve the wall
# clock even on a 2-core machine (8.4 -> 4.7 min). Every test has its own daemon instance,
# socket and directories; nothing is shared between workers.
test:
	scripts/bootstrap.sh --test
	.venv/bin/python -m pytest -n $${SHMSTAGE_TEST_WORKERS:-2}

lint:
	scripts/bootstrap.sh --test
	.venv/bin/ruff check .

# Remove what the commands above made: the virtualenv and demo leftovers of earlier runs.
clean:
	rm -rf .venv
	rm -rf "$${TMPDIR:-/tmp}"/shmstage-demo.*
