# The two entry points the README promises. Both bootstrap .venv themselves.
.PHONY: demo test lint clean

demo:
	scripts/bootstrap.sh
	scripts/demo.sh $(if $(KEEP),--keep)

# Three workers: most tests wait on real daemons and subprocesses, so more workers than
# cores still shorten the wall clock on a 2-core machine (one 8.4 min, two 4.5 min when the
# suite was smaller; with the framework integrations, two 8.4 min and three 7.2 min). Every
# test has its own daemon instance, socket and directories; the few that look at node-wide
# leftovers (marked node_wide) run afterwards, alone.
test:
	scripts/bootstrap.sh --test
	.venv/bin/python -m pytest -n $${SHMSTAGE_TEST_WORKERS:-3} -m "not node_wide"
	.venv/bin/python -m pytest -m node_wide

lint:
	scripts/bootstrap.sh --test
	.venv/bin/ruff check .

# Remove what the commands above made: the virtualenv and demo leftovers of earlier runs.
clean:
	rm -rf .venv
	rm -rf "$${TMPDIR:-/tmp}"/shmstage-demo.*
